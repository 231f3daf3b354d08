// Per-context Locret state (internal): attached heads, score recorder, and the eviction state that
// the KV cache hooks (locret-evict.cpp) work on.
#pragma once

#include "locret-heads.h"

#include "llama.h"

#include <cstdint>
#include <vector>

class llama_kv_cache;
struct llama_context;

// Eviction bookkeeping. Invariant kept by the cache hooks: the units of every (layer, KV head) are
// compacted into cells [0, n_used) in their original order, and cell c holds physical position c in
// every layer and head. Only the data differs per head: which token each cell holds.
struct locret_evict_state {
    uint32_t budget      = 0; // b
    uint32_t stabilizers = 0; // n_s
    uint32_t local       = 0; // n_loc
    uint32_t n_ubatch    = 0; // B: the chunk
    uint32_t capacity    = 0; // b + B: generation evicts back to b when the next ubatch would pass it
    uint32_t n_cells     = 0; // cells allocated in the KV cache (capacity padded)
    llama_locret_policy policy = LLAMA_LOCRET_POLICY_HEADS; // where unit_score comes from

    llama_kv_cache * kv = nullptr;

    // per model layer, head-major [n_head_kv][n_cells]: logical position and score of the unit in each cell
    // (the CIS with the heads policy; the other policies fill the scores when they evict)
    std::vector<std::vector<int32_t>> unit_pos;
    std::vector<std::vector<float>>   unit_score;
    std::vector<uint32_t>             n_head_kv; // per model layer

    uint32_t  n_used       = 0;    // cells in use
    uint32_t  uniform_from = 0;    // cells >= this were placed after the last eviction: same token in every head
    bool      prev_output  = true; // the last ubatch placed requested outputs (prompt tail or generation)
    llama_pos logical_next = 0;    // logical position of the next token of the sequence
    uint32_t  last_start   = 0;    // cells of the last ubatch placed, whose scores arrive after compute
    uint32_t  last_n       = 0;

    uint64_t n_evictions     = 0;
    uint64_t n_units_evicted = 0; // summed over layers and KV heads

    // host data of the eviction graph's inputs, per KV-cache layer: [n_keep*n_head_kv] rows and deltas
    std::vector<std::vector<int32_t>> ev_rows;
    std::vector<std::vector<int32_t>> ev_delta;
};

struct llama_locret_context {
    const llama_locret_heads * heads = nullptr;

    // score recorder: token-major, [n_recorded][n_layer][n_head_kv]; positions [n_recorded]
    bool record = false;
    std::vector<float>   scores;
    std::vector<int32_t> positions;
    std::vector<float>   staging; // one layer of one ubatch: [n_tokens][n_head_kv]
    size_t rec_n_layer   = 0;     // layout of the recorded scores (the heads may be detached later)
    size_t rec_n_head_kv = 0;

    bool evicting = false; // configured with a budget when the context was created
    locret_evict_state ev;
};

// the patches make this struct a friend of llama_context and llama_kv_cache
struct llama_locret_access;

#include "llama-context.h"
#include "llama-kv-cache.h"

struct llama_locret_access {
    static llama_locret_context *& state(llama_context * ctx) { return ctx->locret; }
    static const llama_locret_context * state(const llama_context * ctx) { return ctx->locret; }

    static llama_kv_cells & cells(llama_kv_cache * kv) { return kv->v_cells[0]; }
    static uint32_t       & head (llama_kv_cache * kv) { return kv->v_heads[0]; }
    static size_t        n_layers(const llama_kv_cache * kv) { return kv->layers.size(); }
    static uint32_t      layer_il(const llama_kv_cache * kv, size_t ikv) { return kv->layers[ikv].il; }
    static ggml_tensor * layer_k (const llama_kv_cache * kv, size_t ikv) { return kv->layers[ikv].k; }
    static ggml_tensor * layer_v (const llama_kv_cache * kv, size_t ikv) { return kv->layers[ikv].v; }
    static bool          v_trans (const llama_kv_cache * kv) { return kv->v_trans; }
    static bool          rot_k   (const llama_kv_cache * kv) { return kv->attn_rot_k; }
    static const llama_model   & model  (const llama_kv_cache * kv) { return kv->model; }
    static const llama_hparams & hparams(const llama_kv_cache * kv) { return kv->hparams; }
};
