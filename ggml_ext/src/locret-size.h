// What an evicting context allocates, and the budget that fits a memory size: the rule book's sizes, written once.
// llama_locret_resolve_file and llama_locret_budget_for_mib (the tools' --locret-budget-mib, -fit, locret plan,
// locret.Llama) read them from here; tests compare them with what a context really allocates.
#pragma once

#include "locret-settings.h"

#include "ggml.h"

#include <cstdint>
#include <vector>

struct llama_cparams;
struct llama_model;

// Bytes per sequence (one KV stream) of the memory a Locret context holds for its settings. The K and V rows follow
// llama_kv_cache (a row per layer and cell, of the cache's type); the stores follow llama_locret_memory.
struct locret_memory_size {
    uint64_t kv      = 0;      // K and V of the evicting layers: cfg.n_cells cells each
    uint64_t window  = 0;      // K and V of the sliding-window layers' own cache (iSWA): n_cells_window cells each
    uint64_t scores  = 0;      // the F32 score store: one score per (evicting layer, KV head, cell)
    uint64_t queries = 0;      // the F32 query store of policies that capture queries (snapkv, sage)
    uint32_t n_cells_window = 0;
    std::vector<uint64_t> layer; // K and V bytes of each layer (n_layer entries; 0 for a layer without KV)

    uint64_t total() const { return kv + window + scores + queries; }
};

// The memory of a context made with `cfg` (from locret_config_make) and these cache settings. v_trans: the V cache
// is stored transposed (flash attention off), whose rows llama.cpp sizes for the widest layer; swa_full: the window
// layers get a full-size cache (--swa-full).
locret_memory_size locret_memory_size_make(const llama_model & model, const locret_config & cfg, const llama_cparams & cparams,
                                           ggml_type type_k, ggml_type type_v, bool v_trans, bool swa_full);

// The largest budget b (p.budget is ignored) whose memory per sequence (locret_memory_size::total) is at most `bytes`,
// with the other settings as locret_config_make resolves them; *cfg_out and *size_out get that budget's config and
// memory. The memory grows with b in steps of 256 cells (the cache's padding), so b is the last budget of its step and
// b + 1 does not fit. Throws std::runtime_error (message without prefix) when the smallest budget the rules accept
// does not fit (the message names its size), for a schedule file (its budgets fix b), for SAGE-KV (its cache holds
// the whole prompt, so -c sets its memory), or for settings the rules refuse at every budget.
uint32_t locret_budget_for_bytes(const llama_model & model, const llama_locret_params & p, const locret_schedule_spec & schedule,
                                 const llama_cparams & cparams, uint32_t n_ubatch_requested, ggml_type type_k,
                                 ggml_type type_v, bool v_trans, bool swa_full, uint64_t bytes,
                                 locret_config * cfg_out, locret_memory_size * size_out);
