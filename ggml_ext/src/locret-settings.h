// Locret settings: what a model was configured with (llama_locret_model_configure) and what a context
// resolves them to when it is created.
#pragma once

#include "llama-locret.h"

#include "ggml.h"

#include <cstdint>

struct llama_cparams;
struct llama_model;

// the settings of one evicting context, resolved when the context is created
struct locret_config {
    const llama_locret_heads * heads = nullptr; // scores the units with the heads policy
    llama_locret_policy policy = LLAMA_LOCRET_POLICY_HEADS;

    uint32_t budget      = 0; // b: units kept per layer and KV head
    uint32_t stabilizers = 0; // n_s (SAGE-KV: its recent window, b/4)
    uint32_t local       = 0; // n_loc
    uint32_t pool        = 0; // score pooling window in tokens (odd; 0: none)
    uint32_t lag         = 0; // LagKV's partition in units (0: another policy)
    uint32_t n_ubatch    = 0; // B: the chunk
    uint32_t capacity    = 0; // b + B: generation evicts back to b when the next ubatch would pass it (SAGE-KV: the
                              // context per sequence, which a prompt must fit)
    uint32_t n_cells     = 0; // KV cells per sequence: capacity padded to 256
};

// the settings registered for `model`; false when there are none
bool locret_settings_find(const llama_model & model, llama_locret_params & out);

// The settings for a context that evicts (p.budget > 0), checked against the model, the context parameters and the
// K cache type. n_ubatch_requested is the ubatch the caller asked for, before llama.cpp clamped it to n_ctx. Throws
// std::runtime_error (message without prefix) for settings that cannot work.
locret_config locret_settings_resolve(const llama_model & model, const llama_locret_params & p,
                                      const llama_cparams & cparams, uint32_t n_ubatch_requested, ggml_type type_k);

// KV cells per sequence for a budget and a ubatch: b + B padded to 256
uint32_t locret_kv_cells(uint32_t budget, uint32_t n_ubatch);
