// The Locret memory type: llama.cpp's own KV cache (or iSWA pair of caches) behind a memory that evicts.
//
// Algorithm 1 of the Locret paper as a property of the cache, with the ubatch as the chunk, for every sequence on its
// own (one KV stream per sequence):
//   - after a prefill chunk (a part without outputs) that leaves more than b units, every layer and KV head keeps its
//     top-b units by score; the last n_s units are kept as stabilizers unless the next part ends the prompt (the final
//     chunk of Algorithm 1 is evicted without stabilizers);
//   - otherwise (generation, or a new prompt after generation) the cache evicts back to b only when the next part
//     would not fit in b + B: every unit is scored like any other;
//   - a batch whose last token of a sequence asks for an output is a prompt end: its last n_loc tokens form their own
//     ubatch, processed after the compression and never evicted while the prompt is processed (a prompt that fits in
//     the budget with what the sequence holds evicts nothing: its tail is not split off, locret_plan_tail_alone).
//
// Where units sit. Every sequence has a stream of n_cells cells; each part (the sequence's tokens of one ubatch) goes
// to the cells right after the ones in use, so every (layer, KV head) holds its units in cells [0, n_used). The cells
// of the parts placed since the last eviction hold the same tokens in every layer and head, in order, at consecutive
// RoPE (physical) positions; below them each (layer, KV head) holds the units it kept, and the layout
// (--locret-positions, locret_config) decides their cells and positions:
//   - compact (the paper's; the default for the policies that read cells in position order, lagkv, sage and snapkv,
//     and for models without RoPE or without a full-attention layer): an eviction moves the kept units, in order, to
//     cells 0..n-1 and re-rotates their keys to positions 0..n-1, so cell c holds position c (a schedule aside);
//   - in place (the default elsewhere; locret_config::rotate_in_place): the same positions 0..n-1 in the kept units'
//     order, but a kept unit in a cell below n stays there (its key re-rotated in place) and the chunk's survivors
//     are copied into the holes in cell order: the model reads what compact gives it, from other cells;
//   - keep (locret_config::keep_positions): kept units keep the positions they were read at, the chunk's survivors
//     are copied into the holes without rotation, and positions grow with the input. When a part would pass
//     position_limit, the eviction before it repositions: the kept units in position order at cells and positions
//     0..n-1, as compact places them.
// In every layout the kept units' positions keep their order and lie below every later token's. With in-place and kept
// positions the cells below the last eviction are not in position order, and each (layer, KV head, cell) records its
// own RoPE position (locret_cells::rope). A budget schedule masks cells in its smaller layers and shifts their
// positions (locret_cells::live_end). Keys whose position changes are re-rotated by the change (locret-compact).
//
// Clients keep their own (logical) positions: the memory reports them (seq_pos_min/max), takes them in seq_rm/seq_add,
// and gives the graph ubatches whose positions are the physical (RoPE) ones, as copies: the client's batch is never
// changed. The cells of llama.cpp's own cache (the largest budget's, with a schedule), whose positions its causal
// mask and seq_rm read, hold their index (compact, in place), or below the budget their index and above it the
// position they were placed at (keep); the other layer groups' caches hold positions that grow with the cell too.
// So a new token's position is above that of every cell it may read.
//
// With an iSWA model the window layers keep llama.cpp's own window cache; it follows the global cache's physical frame:
// when an eviction moves the next RoPE position back by d (every eviction with compact or in-place positions; with
// kept positions only a repositioning), the window cache's positions are shifted by -d (K-shift), so the window layers
// see the true distances.
#pragma once

#include "locret-hooks.h"

#include "llama-locret-debug.h"
#include "locret-cells.h"
#include "locret-stores.h"
#include "locret-compact.h"
#include "locret-evictor.h"
#include "locret-faults.h"
#include "locret-groups.h"
#include "locret-plan.h"
#include "locret-policy.h"
#include "locret-settings.h"
#include "locret-workers.h"

#include "llama-kv-cache-iswa.h"
#include "llama-kv-cache.h"
#include "llama-memory.h"
#include "llama-graph.h"

#include "ggml-cpp.h"

#include <cmath>
#include <memory>
#include <functional>
#include <string>
#include <vector>

struct llama_context;

// locret_step and locret_ubatch_plan (a ubatch's plan) are in locret-plan.h, with the planning rules

// One sequence's cells and their bookkeeping (which unit each cell holds, at which positions): locret-cells.h


class llama_locret_memory : public llama_memory_i {
public:
    // wraps `inner`, the model's own memory made for this context with cfg.n_cells cells per sequence: a
    // llama_kv_cache, or a llama_kv_cache_iswa whose base (full-attention) cache evicts. Throws for another memory.
    llama_locret_memory(const llama_model & model, const llama_cparams & cparams, const locret_config & cfg,
                        llama_memory_ptr inner);
    // a budget schedule's layers in caches of their own (locret_layer_groups): group g's cache holds its layers in
    // the group's cells; groups[0] holds the largest budget in cfg.n_cells cells and plays `inner`'s part
    llama_locret_memory(const llama_model & model, const llama_cparams & cparams, const locret_config & cfg,
                        std::vector<std::unique_ptr<llama_kv_cache>> groups);

    //
    // llama_memory_i
    //

    llama_memory_context_ptr init_batch(llama_batch_allocr & balloc, uint32_t n_ubatch, bool embd_all) override;
    llama_memory_context_ptr init_full() override;
    llama_memory_context_ptr init_update(llama_context * lctx, bool optimize) override;

    bool get_can_shift() const override { return false; } // positions are compacted by the cache itself

    void clear(bool data) override;

    bool seq_rm  (llama_seq_id seq_id,                              llama_pos p0, llama_pos p1) override;
    void seq_cp  (llama_seq_id seq_id_src, llama_seq_id seq_id_dst, llama_pos p0, llama_pos p1) override;
    void seq_keep(llama_seq_id seq_id) override;
    void seq_add (llama_seq_id seq_id,                              llama_pos p0, llama_pos p1, llama_pos shift) override;
    void seq_div (llama_seq_id seq_id,                              llama_pos p0, llama_pos p1, int d) override;

    llama_pos seq_pos_min(llama_seq_id seq_id) const override;
    llama_pos seq_pos_max(llama_seq_id seq_id) const override;

    std::map<ggml_backend_buffer_type_t, size_t> memory_breakdown() const override;

    void state_write(llama_io_write_i & io, llama_seq_id seq_id = -1, llama_state_seq_flags flags = 0) const override;
    void state_read (llama_io_read_i  & io, llama_seq_id seq_id = -1, llama_state_seq_flags flags = 0) override;

    //
    // Locret
    //

    // the eviction (locret-evictor.h): its graphs' reservation, each eviction the plans put before their ubatches,
    // its timers and counters
    locret_evictor       & evictor()       { return ev; }
    const locret_evictor & evictor() const { return ev; }

    // the inner cache placed the plan's ubatch (the graph's copy): the layer groups 1.. place it in their caches,
    // into one context per group (group_contexts[g - 1]), and the streams record its units
    void placed(const locret_ubatch_plan & plan, const llama_ubatch & ubatch,
                std::vector<std::unique_ptr<llama_kv_cache_context>> & group_contexts);
    // the score store the graph writes each ubatch's causal importance scores into (heads policy), or a policy's
    // eviction-time graph its scores (lagkv, snapkv), empty for the others: layer i (index into get_layers()) is F32
    // [n_head_kv, n_cells*n_streams]; a unit's score sits at row strm*n_cells + cell like its key (locret-stores.h)
    const locret_score_store & score_store() const { return scores; }
    // the query store of a policy that reads queries (locret_policy::query_rows; empty for the others): layer i F32
    // [d_k*n_head, rows*n_stream], its leading pin_rows() a pinned query's (locret_policy::query_pin_rows); and the
    // attention scale each layer's graph applies, recorded when it captures the queries
    locret_query_store       & query_store()       { return queries; }
    const locret_query_store & query_store() const { return queries; }

    locret_faults faults; // what a test injected (llama_locret_debug_inject_fault)

    // Locret-Q: positions [0, n_tokens) of a sequence (the query placed at its start) are never evicted and count in
    // the budget. Only before the sequence's first eviction (or to the value it has); false with the reason in
    // llama_locret_last_error otherwise, or when the pinned units and the stabilizers leave no room in the budget.
    bool pin_prefix(llama_seq_id seq_id, uint32_t n_tokens);

    // The prompt a sequence starts with is n_tokens long: with the config's pool_from, decides once (while the sequence
    // holds no token) whether its scores are pooled. Returns whether they are, or -1 for a sequence it does not have.
    int32_t tell_prompt(llama_seq_id seq_id, uint32_t n_tokens);

    // the caches of a budget schedule's layer groups and their cell maps (locret-groups.h; one group without a
    // schedule, group 0's cache is the one that evicts)
    const locret_group_caches & groups() const { return grp; }

    const locret_config & config() const { return cfg; }
    const locret_policy & get_policy() const { return *policy; }
    const std::vector<locret_kv_layer> & get_layers() const { return layers; }
    const locret_cells * get_stream(llama_seq_id seq_id) const;
    uint32_t n_streams() const { return (uint32_t) streams.size(); }
    llama_kv_cache * get_kv_swa() const { return kv_swa; }
    bool get_v_trans() const { return v_trans; }
    int32_t layer_index(uint32_t il) const; // index into get_layers(), or -1 for a layer this cache does not evict

    uint64_t kv_bytes() const;

private:
    const llama_model & model;
    locret_config cfg;
    std::unique_ptr<locret_policy> policy;

    llama_memory_ptr inner;                  // the model's own memory
    llama_kv_cache      * kv      = nullptr; // the cache that evicts: inner itself, or the base cache of an iSWA pair
    locret_group_caches grp;                 // the caches of the layer groups (group 0's is kv)
    llama_kv_cache_iswa * iswa    = nullptr; // inner as an iSWA pair, or NULL
    llama_kv_cache      * kv_swa  = nullptr; // the window cache of the pair, or NULL
    locret_kv_state_keep_masked_scope keep_masked; // its saves keep every cell kv_swa holds (locret-hooks.h)
    bool v_trans = true;

    std::vector<locret_kv_layer> layers;
    std::vector<int32_t>         layer_of_il; // model layer -> index into layers, or -1
    std::vector<locret_cells>   streams;     // one per sequence

    locret_score_store scores;  // beside the keys they rank (locret-stores.h)
    locret_query_store queries; // the queries a policy reads (locret_policy::query_rows)

    // each layer's re-rotation factors, resident where its keys are (locret_rerotation::factors)
    std::vector<ggml_context_ptr>        rope_factors_ctx;
    std::vector<ggml_backend_buffer_ptr> rope_factors_buf;

    // where the heads policy selects: on the device with a graph (the default when the scores are not in host memory),
    // or on the host; LOCRET_DEBUG_SELECT=graph|host overrides it (tests compare both)
    bool select_graph = false;

    // the eviction, working on the parts above (declared after them)
    locret_evictor ev;
    locret_evict_parts evict_parts(); // what the eviction works on

    void setup(const llama_cparams & cparams); // the layers, streams and stores, once the caches are known
    // setup(), in steps: the evicting layers of every group's cache, in model order (layers, layer_of_il, the
    // groups' layers); throws for caches that differ in streams or V layout, or a K/V layout eviction cannot move
    void setup_layers(const llama_cparams & cparams, uint32_t n_seq);
    // logs the eviction's settings (and a budget schedule's layers and groups), each line prefixed with func
    void log_setup(const char * func, const llama_cparams & cparams, uint32_t n_seq) const;
    // f(memory) for every cache the memory holds: the model's own memory (group 0's cache, or the iSWA pair), then
    // layer groups 1..
    template <typename F> void each_cache(F f) {
        f(static_cast<llama_memory_i &>(*inner));
        grp.each_own([&](llama_kv_cache & c) { f(static_cast<llama_memory_i &>(c)); });
    }
};

// the Locret memory behind a llama_context's memory, or NULL
llama_locret_memory * locret_memory_of(llama_memory_i * mem);
const llama_locret_memory * locret_memory_of(const llama_memory_i * mem);

// the Locret memory a memory context belongs to (a ubatch's or the full view of graph reservation), or NULL
llama_locret_memory * locret_memory_of_context(const llama_memory_context_i * mctx);

// layer group g's context within a Locret memory context (group 0: the context itself), or NULL
const llama_kv_cache_context * locret_group_context(const llama_memory_context_i * mctx, size_t g);

// the plan of the ubatch a memory context is at, when the context is a Locret one (else NULL)
const locret_ubatch_plan * locret_plan_of(const llama_memory_context_i * mctx, llama_locret_memory ** mem);

// speculative decoding: the most tokens sequence seq_id's next generation part may hold (locret_plan_room); 0 for a
// sequence the memory does not have
uint32_t locret_generation_room(const llama_locret_memory & mem, llama_seq_id seq_id);

// the pooling window sequence seq_id's scores are stored with (0: none): the config's, for every sequence or for the
// ones told a long prompt (locret_config::pool_from)
uint32_t locret_pool_of(const llama_locret_memory & mem, llama_seq_id seq_id);
