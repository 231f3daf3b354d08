// What the C++ tests that write retaining heads share: the heads GGUF header for a model's attention shape, the keys
// llama_locret_heads_load checks (format, base shape, input and Q/K layout, hidden size, activation). The tensors are
// each test's own (the fuzzer adds biases, the API test scales its weights).
#pragma once

#include "gguf.h"
#include "llama.h"

#include <cstdint>

// heads for `n_layer` layers of `model` with hidden size d_r; returns the fc1 input width (Q, K and V of every head)
static uint32_t heads_header(gguf_context * gguf, const llama_model * model, uint32_t n_layer, uint32_t d_r) {
    char arch[64];
    llama_model_meta_val_str(model, "general.architecture", arch, sizeof(arch));
    const uint32_t n_head    = llama_model_n_head(model);
    const uint32_t n_head_kv = llama_model_n_head_kv(model);
    const uint32_t head_dim  = llama_model_n_embd(model) / n_head;

    gguf_set_val_str (gguf, "general.architecture", arch);
    gguf_set_val_str (gguf, "general.type", "locret_heads");
    gguf_set_val_u32 (gguf, "locret.format_version", 1);
    gguf_set_val_str (gguf, "locret.base.architecture", arch);
    gguf_set_val_u32 (gguf, "locret.base.n_layer", n_layer);
    gguf_set_val_u32 (gguf, "locret.base.n_head", n_head);
    gguf_set_val_u32 (gguf, "locret.base.n_head_kv", n_head_kv);
    gguf_set_val_u32 (gguf, "locret.base.head_dim_k", head_dim);
    gguf_set_val_u32 (gguf, "locret.base.head_dim_v", head_dim);
    gguf_set_val_str (gguf, "locret.input_layout", "q,k,v pre-rope");
    gguf_set_val_str (gguf, "locret.qk_layout", "llama.cpp");
    gguf_set_val_bool(gguf, "locret.qk_permuted", true);
    gguf_set_val_u32 (gguf, "locret.hidden_size", d_r);
    gguf_set_val_str (gguf, "locret.activation", "silu");
    return (n_head + 2 * n_head_kv) * head_dim;
}
