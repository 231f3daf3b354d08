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
    uint64_t kv      = 0;      // K and V of the evicting layers: their group's cells each (locret_layer_groups)
    uint64_t window  = 0;      // K and V of the sliding-window layers' own cache (iSWA): n_cells_window cells each
    uint64_t scores  = 0;      // the F32 score store: one score per (evicting layer, KV head, cell)
    uint64_t queries = 0;      // the F32 query store of policies that capture queries (snapkv, sage)
    uint32_t n_cells_window = 0;
    uint32_t n_groups       = 1;  // caches the evicting layers are held in (locret_layer_groups)
    std::vector<uint64_t> layer; // K and V bytes of each layer (n_layer entries; 0 for a layer without KV)

    uint64_t total() const { return kv + window + scores + queries; }
};

// A budget schedule's layers in caches of their own: each group of evicting layers of one budget gets one
// llama_kv_cache sized for that budget, so a schedule's KV bytes are a sum over layers of b_l + B cells instead of
// every layer sized for the largest budget. Group 0 holds the largest budget, in cfg.n_cells cells (the cells every
// sequence's bookkeeping is laid out in); every other group holds b_g + B cells. Why groups of caches and not per-layer
// cell counts in one cache: docs/policies.md, "Per-layer allocation".
struct locret_layer_group {
    std::vector<uint32_t> layers;      // indices into the evicting layers, ascending
    uint32_t              n_cells = 0; // cells per sequence of the group's cache
};

// K and V bytes of one cell of model layer il, as llama_kv_cache sizes its rows (a transposed V is sized for the
// widest layer)
uint64_t locret_layer_row_bytes(const llama_model & model, uint32_t il, ggml_type type_k, ggml_type type_v, bool v_trans);

// The groups of a context made with `cfg` over n_layers evicting layers: one group of every layer in cfg.n_cells cells
// without a schedule, when one_cache is set, or with LOCRET_DEBUG_ALLOC=masked (each layer then masks what it does not
// keep; tests compare both forms).
std::vector<locret_layer_group> locret_layer_groups(const locret_config & cfg, size_t n_layers, bool one_cache);
// the same for a model: one cache for an iSWA model (its window cache follows the evicting cache's frame) or an ALiBi
// one (its mask holds distances, which the groups' cells do not share)
std::vector<locret_layer_group> locret_layer_groups_for(const llama_model & model, const locret_config & cfg);

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
