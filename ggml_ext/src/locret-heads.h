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

// one layer's head: S = fc2_w · act(fc1_w · x + fc1_b) + fc2_b
struct locret_head_layer {
    ggml_tensor * fc1_w = nullptr; // [d_in, d_R]      F32, F16 or Q8_0
    ggml_tensor * fc1_b = nullptr; // [d_R]            F32, optional
    ggml_tensor * fc2_w = nullptr; // [d_R, n_head_kv] F32, F16 or Q8_0
    ggml_tensor * fc2_b = nullptr; // [n_head_kv]      F32, optional
};

struct llama_locret_heads {
    const llama_model * model = nullptr; // the model the heads were validated against

    std::string path;
    uint32_t d_in      = 0;
    uint32_t d_r       = 0;
    uint32_t n_head_kv = 0;
    locret_activation activation = LOCRET_ACT_SILU;
    llama_locret_settings recommended = {};

    std::vector<locret_head_layer> layers; // [n_layer]

    // one context and one backend buffer per buffer type the layers live on
    std::vector<ggml_context_ptr>        ctxs;
    std::vector<ggml_backend_buffer_ptr> bufs;
};

// the error message of the last failed API call on this thread
void locret_set_error(const std::string & msg);
