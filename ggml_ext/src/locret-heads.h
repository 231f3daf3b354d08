// Retaining heads loaded for one model (internal; the C API is in llama-locret.h).
#pragma once

#include "llama-locret.h"

#include "ggml-cpp.h"

#include <string>
#include <vector>

struct llama_model;

enum locret_activation {
    LOCRET_ACT_SILU,
    LOCRET_ACT_GELU, // tanh approximation (ggml_gelu), as the gemma family's FFN
    LOCRET_ACT_RELU,
};

// one layer's head: S = fc2_w · act(fc1_w · x + fc1_b) + fc2_b with x = concat(Q, K, V) (pre-RoPE).
struct locret_head_layer {
    ggml_tensor * fc1_w = nullptr; // [d_in, d_R]      F32, F16, BF16 or Q8_0; d_in = Q | K | V columns
    ggml_tensor * fc1_b = nullptr; // [d_R]            F32, optional
    ggml_tensor * fc2_w = nullptr; // [d_R, n_head_kv] F32, F16, BF16 or Q8_0
    ggml_tensor * fc2_b = nullptr; // [n_head_kv]      F32, optional
};

// Every layer's head in one tensor per weight, when all layers live on one buffer type with one weight type each;
// the layers' tensors are then slices of these. A small ubatch (generation) scores every layer with one op per stage
// over the stack instead of one per layer: on a GPU a generated token's time is mostly kernel launches, and the
// per-layer heads' graph was ~10 kernels a layer (locret-graph.cpp).
struct locret_heads_stack {
    ggml_tensor * fc1_w = nullptr; // [d_in, d_R, n_layer]
    ggml_tensor * fc1_b = nullptr; // [d_R, 1, n_layer]       optional
    ggml_tensor * fc2_w = nullptr; // [d_R, n_head_kv, n_layer]
    ggml_tensor * fc2_b = nullptr; // [n_head_kv, 1, n_layer] optional
};

struct llama_locret_heads {
    const llama_model * model = nullptr; // the model the heads were validated against

    std::string path;
    uint32_t d_in      = 0; // n_q + n_k + n_v
    uint32_t n_q       = 0; // Q columns of fc1: n_head * head_dim_k
    uint32_t n_k       = 0; // K columns: n_head_kv * head_dim_k
    uint32_t n_v       = 0; // V columns: n_head_kv * head_dim_v
    uint32_t d_r       = 0;
    uint32_t n_head_kv = 0;
    locret_activation activation = LOCRET_ACT_SILU;
    llama_locret_settings recommended = {};
    uint64_t fingerprint = 0xcbf29ce484222325ULL; // of the tensor data as read from the file (a saved state names it)

    std::vector<locret_head_layer> layers; // [n_layer]
    locret_heads_stack stack;               // fc1_w nullptr: the layers' tensors are not stacked

    // one context and one backend buffer per buffer type the layers live on
    std::vector<ggml_context_ptr>        ctxs;
    std::vector<ggml_backend_buffer_ptr> bufs;
};

// the error message of the last failed API call on this thread
void locret_set_error(const std::string & msg);

// a fingerprint of the heads' tensor data (0 for NULL)
uint64_t llama_locret_heads_fingerprint(const llama_locret_heads * heads);
