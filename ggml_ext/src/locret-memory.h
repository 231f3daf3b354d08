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

#include "llama-locret-debug.h"
#include "locret-cells.h"
#include "locret-stores.h"
#include "locret-compact.h"
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

// faults a test can inject (llama_locret_debug_inject_fault)
enum locret_fault {
    LOCRET_FAULT_NONE           = 0,
    LOCRET_FAULT_EVICT_ALLOC    = 1, // the next compaction graph cannot be allocated
    LOCRET_FAULT_EVICT_COMPUTE  = 2, // the next compaction graph fails to start
    LOCRET_FAULT_UBATCH         = 3, // the next ubatch fails after it was placed and computed
    LOCRET_FAULT_STATE_READ     = 4, // the next state load fails after the KV cells were restored
};

// locret_step and locret_ubatch_plan (a ubatch's plan) are in locret-plan.h, with the planning rules

// One sequence's cells and their bookkeeping (which unit each cell holds, at which positions): locret-cells.h

struct locret_stream_meta; // a sequence's bookkeeping in a state file (locret-state.cpp)

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

    // kept positions: evictions that compacted positions because a part would pass the limit (all sequences)
    uint64_t repositions() const { return n_repositions; }

    // the eviction the plan puts before its ubatch, on the memory's own scheduler: 1 if the context's scheduler was used
    // too (an iSWA window cache was shifted: the context's last graph cannot be reused), 0 otherwise (evicted or not
    // due), -1 on failure (the cache is then as before, or, if the computation failed part-way, the affected sequences
    // are emptied; with more sequences than one turn takes, those of the turns before the failed one stay evicted,
    // each as consistent as after a whole eviction)
    int evict(llama_context * lctx, const locret_ubatch_plan & plan);

    // the most sequences one compaction graph moves (its move tables and compute buffers are sized for them, not for
    // every stream): a ubatch that evicts more sequences evicts them in turns of this many
    static constexpr uint32_t COMPACT_MAX_SEQ = 4;

    // the inner cache placed the plan's ubatch: record its units
    void placed(const locret_ubatch_plan & plan);
    // layer groups 1..: place the plan's ubatch (the graph's copy) in each group's cache, into one context per group
    // (out[g - 1]), before placed()
    void place_in_groups(const locret_ubatch_plan & plan, const llama_ubatch & ubatch,
                         std::vector<std::unique_ptr<llama_kv_cache_context>> & out) const;

    // the score store the graph writes each ubatch's causal importance scores into (heads policy), or a policy's
    // eviction-time graph its scores (lagkv, snapkv), empty for the others: layer i (index into get_layers()) is F32
    // [n_head_kv, n_cells*n_streams]; a unit's score sits at row strm*n_cells + cell like its key (locret-stores.h)
    const locret_score_store & score_store() const { return scores; }
    // the query store of a policy that reads queries (locret_policy::query_rows; empty for the others): layer i F32
    // [d_k*n_head, rows*n_stream], its leading pin_rows() a pinned query's (locret_policy::query_pin_rows); and the
    // attention scale each layer's graph applies, recorded when it captures the queries
    locret_query_store       & query_store()       { return queries; }
    const locret_query_store & query_store() const { return queries; }
    // the pinned positions of sequence seq_id whose queries the graph captures into the pinned rows now: n_pinned
    // before its first eviction (its ubatches' positions are then its logical ones), 0 after it or without a pin
    uint32_t pinned_to_capture(llama_seq_id seq_id) const;

    // the scheduler and compute buffers of the eviction graphs (selection, compaction), apart from the context's so
    // that its graphs stay allocated (and reusable) across evictions; made for the worst case when the context
    // reserves its own graphs. false (with the reason in llama_locret_last_error) when that fails.
    bool reserve(llama_context * lctx);
    size_t evict_buffer_size() const; // bytes of the eviction graphs' compute buffers
    size_t move_tables_size() const { return evict_moves.device_bytes(); } // bytes of the compaction's move tables
    uint32_t compact_seq() const { return evict_turn_seq; } // the most sequences one compaction moves

    // a fault injected for the next matching operation; consumes it when it matches
    void inject_fault(locret_fault f) { fault = f; }
    bool take_fault(locret_fault f);

    // Locret-Q: positions [0, n_tokens) of a sequence (the query placed at its start) are never evicted and count in
    // the budget. Only before the sequence's first eviction (or to the value it has); false with the reason in
    // llama_locret_last_error otherwise, or when the pinned units and the stabilizers leave no room in the budget.
    bool pin_prefix(llama_seq_id seq_id, uint32_t n_tokens);

    // a budget schedule's budget of layers[i] (config().budget without one)
    uint32_t layer_budget(size_t i) const { return cfg.layer_budget.empty() ? cfg.budget : cfg.layer_budget[i]; }
    bool     has_schedule() const { return !cfg.layer_budget.empty(); }
    // the smallest layer budget (what a pinned query and the stabilizers must fit in)
    uint32_t min_layer_budget() const;
    // a budget schedule: the cells of layers[i] that its attention must not read in stream strm, [*c0, *c1) (empty when
    // *c0 == *c1)
    void masked_cells(size_t i, uint32_t strm, uint32_t * c0, uint32_t * c1) const;
    // the same in the cells of the layer's own cache (its group's): [*c0, *c1) below the group's live end
    void group_masked_cells(size_t i, uint32_t strm, uint32_t * c0, uint32_t * c1) const;

    // Layer groups (locret_layer_groups; one group without a schedule). Every sequence's bookkeeping (cells, units'
    // positions, scores) is laid out in group 0's cells; group g's cache holds the same cells except those no layer of
    // the group reads: below the group's live end a cell is its own, from the dead end on it sits `gap` cells lower
    // (dead end - the group's live end), and the cells between do not exist in that cache.
    size_t n_groups() const { return group_layers.size(); }
    llama_kv_cache * group_cache(size_t g) const { return g == 0 ? kv : group_caches[g - 1].get(); }
    // the cells of stream s that group g's layers may read below the dead end: [0, live end)
    uint32_t group_live_end(size_t g, const locret_cells & s) const;
    uint32_t group_gap(size_t g, const locret_cells & s) const { return s.dead_end - group_live_end(g, s); }
    // cell c of stream s in layers[i]'s own cache, or -1 for a cell that cache does not hold
    int64_t layer_cell(size_t i, const locret_cells & s, uint32_t c) const;

    const locret_config & config() const { return cfg; }
    const locret_policy & get_policy() const { return *policy; }
    const std::vector<locret_kv_layer> & get_layers() const { return layers; }
    const locret_cells * get_stream(llama_seq_id seq_id) const;
    uint32_t n_streams() const { return (uint32_t) streams.size(); }
    llama_kv_cache * get_kv() const { return kv; }
    llama_kv_cache * get_kv_swa() const { return kv_swa; }
    bool get_v_trans() const { return v_trans; }
    int32_t layer_index(uint32_t il) const; // index into get_layers(), or -1 for a layer this cache does not evict
    // speculative decoding: the most tokens sequence seq_id's next generation part may hold (locret_plan_room); 0 for
    // a sequence it does not have
    uint32_t generation_room(llama_seq_id seq_id) const;

    uint64_t kv_bytes() const;

    // where eviction time goes (microseconds, summed over sequences)
    struct timing {
        uint64_t select_us   = 0; // choosing what stays: the selection graph or the host's selection, and bookkeeping
        uint64_t compact_us  = 0; // the compaction graph and the window cache's shifts
        uint64_t readback_us = 0; // copying what the host needs (the kept cells, or the scores for a host selection)
        uint64_t n_compactions = 0; // compaction graphs run (one per turn of an eviction that moved rows)
        // what evictions cost in rows, one row per (layer, KV head, unit), and in host round trips
        uint64_t n_rows_moved   = 0; // K/V rows written to another cell
        uint64_t n_rows_rotated = 0; // keys re-rotated (their position changed)
        uint64_t n_rows_kept    = 0; // units retained at evictions
        uint64_t n_host_syncs   = 0; // times the eviction waited for the backend or read data back
        // evictions and units evicted of every sequence, never reset (a server's counters; not in states)
        uint64_t n_evictions     = 0;
        uint64_t n_units_evicted = 0;
    } t;


private:
    const llama_model & model;
    locret_config cfg;
    std::unique_ptr<locret_policy> policy;

    llama_memory_ptr inner;                  // the model's own memory
    llama_kv_cache      * kv      = nullptr; // the cache that evicts: inner itself, or the base cache of an iSWA pair
    std::vector<std::unique_ptr<llama_kv_cache>> group_caches; // the caches of layer groups 1.. (group 0's is kv)
    std::vector<std::vector<size_t>>             group_layers; // per group: its layers (indices into layers)
    llama_kv_cache_iswa * iswa    = nullptr; // inner as an iSWA pair, or NULL
    llama_kv_cache      * kv_swa  = nullptr; // the window cache of the pair, or NULL
    bool v_trans = true;

    std::vector<locret_kv_layer> layers;
    std::vector<int32_t>         layer_of_il; // model layer -> index into layers, or -1
    std::vector<locret_cells>   streams;     // one per sequence

    locret_score_store scores;  // beside the keys they rank (locret-stores.h)
    locret_query_store queries; // the queries a policy reads (locret_policy::query_rows)

    // each layer's re-rotation factors, resident where its keys are (locret_rerotation::factors)
    std::vector<ggml_context_ptr>        rope_factors_ctx;
    std::vector<ggml_backend_buffer_ptr> rope_factors_buf;
    void make_rope_factors();

    // where the heads policy selects: on the device with a graph (the default when the scores are not in host memory),
    // or on the host; LOCRET_DEBUG_SELECT=graph|host overrides it (tests compare both)
    bool select_graph = false;

    // The eviction's graphs, each kind with a scheduler of its own. ggml's scheduler keeps the allocation of the last
    // graph it was given: a graph of another shape (node count, or a tensor larger than reserved) is re-reserved, and
    // with more than one backend (a GPU) ggml_backend_sched_alloc_graph first waits for every backend. On one shared
    // scheduler the selection, scoring and compaction graphs alternated, so each allocation hid a host round trip
    // (found on an H200: the selection's timer held the ubatch's whole compute). One scheduler per kind, reserved for
    // its worst case, sees the same shape eviction after eviction and allocates without waiting.
    enum locret_graph_kind { GRAPH_SCORE, GRAPH_SELECT, GRAPH_COMPACT_COPY, GRAPH_COMPACT_ROTATE, GRAPH_KINDS };
    struct locret_graph_slot {
        ggml_backend_sched_ptr            sched;
        std::unique_ptr<llm_graph_result> res;
    };
    locret_graph_slot evict_graphs[GRAPH_KINDS];
    // a scheduler on the context's backends, to wait for them (every slot's is)
    ggml_backend_sched_t evict_sched() const { return evict_graphs[GRAPH_COMPACT_ROTATE].sched.get(); }
    // reserve(), in steps: each slot's scheduler on the context's backends, the host threads and the ubatch-end events
    void make_evict_scheds(llama_context * lctx);
    // the move tables and the selection's read-back for the worst case, the moves at their capacity (the shapes the
    // reservation needs); false (with the reason in llama_locret_last_error) when the tables cannot be allocated
    bool reserve_evict_tables(ggml_backend_sched_t ctx_sched);
    // reserves slot `kind`'s scheduler for the graph `build` makes in the slot's result; false when that fails
    bool reserve_slot(locret_graph_kind kind, const std::function<ggml_cgraph *(llm_graph_result *)> & build);
    // every slot reserved for its worst case (the compactions, the selection, the policy's scoring); false on failure
    bool reserve_evict_graphs();
    // On a backend that computes asynchronously (a GPU) the ubatch whose scores an eviction reads may still be running
    // when the eviction starts: an event recorded then marks the ubatch's end, and the eviction's one wait is taken in
    // two steps, to that event (the ubatch's compute: not the eviction's time) and then to the end of what the eviction
    // queued. The device's queue is not drained in between: still one round trip, counted once.
    struct locret_event_free { void operator()(ggml_backend_event_t e) const { ggml_backend_event_free(e); } };
    std::vector<std::pair<ggml_backend_t, std::unique_ptr<ggml_backend_event, locret_event_free>>> ubatch_end_events;
    bool ubatch_end_marked = false;
    uint64_t ubatch_wait_us = 0; // this turn's wait for the ubatch's end
    void mark_ubatch_end();   // records the events (none on a CPU-only context)
    void wait_ubatch_end();   // waits for them, once per turn

    // per pending eviction: the positions after it, swapped in when it succeeds
    std::vector<std::vector<std::vector<int32_t>>> pos_next;
    std::vector<std::vector<std::vector<int32_t>>> rope_pos_next; // and the RoPE positions (kept positions)
    uint64_t n_repositions = 0; // kept positions: evictions that compacted positions (the limit), all sequences

    locret_fault fault = LOCRET_FAULT_NONE;

    // An eviction waits for the backend once per turn: for the data its selection reads (the device's selection read
    // back, a scoring graph's result, the scores the host selects from) or, when it reads nothing, before the
    // compaction's move tables are written (the last turn's compaction may still read them). The graphs it queues
    // (selection, scoring, compaction) run on the context's own backends, in order after the ubatch that wrote the
    // scores, and the compaction is not waited for: the next ubatch is queued after it.
    bool evict_waited = false; // this turn has waited for the backend
    // waits for the context's backends unless the turn already has
    void wait_for_backend(llama_context * lctx);
    // the device's selection for stream `strm` into select_idx: I32 [n_top] per (layer, KV head), unordered
    bool select_on_device(uint32_t strm, uint32_t cell0, uint32_t n_cand, uint32_t n_top);
    // runs the selection graph `build` makes (its outputs, each with where its result goes in select_idx) and reads
    // every output back with the eviction's one wait; false if it could not run
    bool run_selection(const std::function<void(ggml_context *, std::vector<std::pair<ggml_tensor *, size_t>> &)> & build);
    // one layer's cut at an eviction: Algorithm 1 over the cells the layer reads ([0, m0) and [m0 + gap, n_used), m0 =
    // its live end, m0 + gap = the dead end; gap 0 without a schedule), as if consecutive ("held" order)
    struct layer_cut {
        uint32_t m0     = 0;
        uint32_t gap    = 0; // its masked cells
        uint32_t n_held = 0; // units the layer holds
        uint32_t n_live = 0; // ... and keeps
        uint32_t stab   = 0; // of which its last ones kept as stabilizers
        uint32_t n_cand = 0; // candidates: held [n_pin, n_held - stab)
        uint32_t n_top  = 0; // ... of which kept by score
        uint32_t c0 = 0, n0 = 0, c1 = 0, n1 = 0; // the candidates as runs of cells: [c0, c0 + n0), then [c1, c1 + n1)
        size_t   off = SIZE_MAX; // where its device selection is in select_idx (SIZE_MAX: chosen on the host)
        bool on_device() const { return n_top > 0 && n_top < n_cand; }
    };
    layer_cut cut_layer(size_t i, const locret_cells & s, uint32_t n_keep, uint32_t n_pin, uint32_t n_stab) const;
    // a budget schedule's device selection of stream strm: one graph for every layer whose cut selects there (its
    // result at select_idx + cut.off, [n_head_kv][n_top]), read back with one wait; false if it could not run
    bool select_layers_on_device(uint32_t strm, std::vector<layer_cut> & cuts);
    std::vector<layer_cut> evict_cuts; // scratch of an eviction
    locret_workers evict_workers;      // the host threads that turn an eviction's choice into keep lists and moves
    static unsigned host_threads(llama_context * lctx, size_t n_work); // ... how many for n_work units
    // stream strm's scores of every layer for a host selection, [n_used][n_head_kv] per layer, into blocks: read in
    // place from host memory, else copied from the device with one wait for all layers
    void read_scores(llama_context * lctx, uint32_t strm, uint32_t n_used, std::vector<const float *> & blocks);
    // the kept cells of layer i's KV heads, in cell order, at keep[(row0 + h)*n_keep]: from select_idx (from_idx), else
    // by the host from `block` (the stream's scores of the layer, [n_used][n_head_kv]) or the policy's scores
    void select_layer(size_t i, size_t row0, uint32_t n_used, uint32_t n_keep, uint32_t n_pin, uint32_t n_stab,
                      bool from_idx, const float * block, const locret_cells & s, uint32_t * keep) const;
    // a budget schedule's selection for layer i: the cut's n_live of the cells it reads (its masked cells left out),
    // into keep[(row0 + h)*n_keep] in cell order; the stabilizers are its last cut.stab cells read. The device's
    // selection when `top` is not NULL (the layer's rows, [n_head_kv][cut.n_top]), else by `block` or the policy
    void select_layer_masked(size_t i, size_t row0, const layer_cut & cut, uint32_t n_used, uint32_t n_keep,
                             uint32_t n_pin, const float * block, const locret_cells & s, uint32_t * keep,
                             const int32_t * top) const;
    std::vector<std::vector<uint32_t>> live_next; // per pending eviction: each layer's units after it
    std::vector<uint64_t> turn_moved;    // per layer: rows the turn's compaction moves to another cell
    std::vector<uint64_t> turn_rotated;  // per layer: keys it re-rotates
    // stream strm's scores of layer i in the store: [n_used][n_head_kv] from its byte offset
    // scratch of an eviction, kept between evictions (no allocation once they have grown)
    locret_host_block     select_idx_block; // the device's selection, read back (pinned when the cache is on a device)
    int32_t *             select_idx     = nullptr;
    size_t                select_idx_cap = 0;
    std::vector<float>    select_scores; // the scores read back for a host selection
    std::vector<uint32_t> evict_keep;    // the kept cells of every (layer, KV head)
    locret_moves          evict_moves;
    uint32_t              evict_turn_seq = 1; // sequences per turn of an eviction (min(streams, COMPACT_MAX_SEQ))
    std::vector<locret_step> evict_steps;     // the steps of the ubatch being evicted that drop units (kept for its room)
    // one turn of an eviction: select, compact and record steps [0, n_steps); -1 on failure (see evict()). In steps
    // (locret-evict.cpp): choose_step and plan_step for each step of the turn, then compact_turn and commit_step for
    // each, or abandon_turn when the compaction failed part-way.
    int evict_turn(llama_context * lctx, const locret_step * steps, size_t n_steps);
    struct turn_step { // a step of the turn that evicts or repositions
        locret_evict_args args;
        locret_protect    prot;
        bool              reposition;
        bool              evicts;
    };
    struct turn_choice { // what choose_step found for the plan
        uint32_t n_pin = 0, n_stab = 0;
        bool on_device = false;  // the device selected (into select_idx)
        bool ends_only = false;  // nothing chosen by score
        bool sched     = false;  // a budget schedule
        std::vector<const float *> blocks; // per layer: the stream's scores [n_used][n_head_kv] for a host selection
        int64_t t_prepared_us = 0, t_chosen_us = 0;
    };
    std::vector<turn_step> turn_pending; // the turn's steps that evict or reposition
    std::vector<size_t>    turn_row0;    // first (layer, KV head) row of each layer
    uint64_t               turn_kept = 0;
    bool choose_step(llama_context * lctx, const locret_step & st, turn_choice & ch);
    void plan_step(llama_context * lctx, const locret_step & st, const turn_choice & ch);
    void keep_layer(size_t i, const locret_step & st, const turn_choice & ch);
    void plan_layer(size_t i, const locret_step & st, const turn_choice & ch, size_t p);
    locret_compact_status compact_turn(llama_context * lctx, int64_t t_selected_us);
    bool commit_step(llama_context * lctx, size_t p, bool & shifted);
    void abandon_turn();
    // builds one eviction-time scoring graph on the memory's own scheduler and runs it; false (the reason logged and
    // in llama_locret_last_error) when it cannot run. `what` names what it scored, for LOCRET_PROFILE.
    bool run_score_graph(const char * policy_name, const std::string & what,
                         const std::function<void(ggml_context *, ggml_cgraph *)> & build,
                         const std::function<void()> & set_inputs);
    // what the policy sees of this memory (locret_policy_env)
    locret_policy_env policy_env();

    // the settings ubatch planning reads (locret-plan.h: the rules, as pure functions)
    locret_plan_params plan_params() const;
    // what planning needs of stream s, as the stream stands
    locret_plan_stream plan_stream(size_t s) const;
    // init_batch(), in steps: the batch's ubatches into `ubatches`, split by the planning rules for the batch's
    // sequences (seqs) and the streams as they stand (sim); fewer tokens than the batch's when a split fails
    void split_batch(llama_batch_allocr & balloc, uint32_t n_ubatch, const locret_plan_params & params,
                     const locret_batch_seqs & seqs, const std::vector<locret_plan_stream> & sim,
                     std::vector<llama_ubatch> & ubatches) const;
    // the plan of every ubatch, advancing sim through the batch's evictions and placements: per ubatch the inner
    // cache's slot, the plan, the graph's copy at physical positions, and (iSWA) a copy at the window cache's
    // positions; the planning's error at the first ubatch that cannot be planned
    locret_plan_error plan_batch(const locret_plan_params & params, const std::vector<llama_ubatch> & ubatches,
                                 std::vector<locret_plan_stream> & sim, llama_kv_cache::slot_info_vec_t & sinfos,
                                 std::vector<locret_ubatch_plan> & plans, std::vector<llama_ubatch> & physical,
                                 std::vector<llama_ubatch> & window_frame) const;

    // state files (locret-state.cpp): per sequence a meta part (its bookkeeping) and a data part (its units' positions
    // and scores, the policy's captured queries); one reader for every version, checks before anything is trusted
    void state_write_meta(llama_io_write_i & io, uint32_t id) const;
    void state_write_data(llama_io_write_i & io, uint32_t id) const;
    // the version; rope_from_cells: a state of compact positions loaded by a context of in-place positions (the same
    // cells, whose RoPE positions follow from them)
    uint32_t state_read_header(llama_io_read_i & io, llama_seq_id seq_id, bool & rope_from_cells) const;
    locret_stream_meta state_read_meta(llama_io_read_i & io, uint32_t version) const;
    void state_check_meta(const locret_stream_meta & m) const;
    void state_read_data(llama_io_read_i & io, uint32_t version, uint32_t id, bool rope_from_cells);
    void state_read_groups(llama_io_read_i & io, llama_seq_id seq_id, llama_state_seq_flags flags); // groups 1..

    void setup(const llama_cparams & cparams); // the layers, streams and stores, once the caches are known
    // setup(), in steps: the evicting layers of every group's cache, in model order (layers, layer_of_il,
    // group_layers); throws for caches that differ in streams or V layout, or a K/V layout eviction cannot move
    void setup_layers(const llama_cparams & cparams, uint32_t n_seq);
    // logs the eviction's settings (and a budget schedule's layers and groups), each line prefixed with func
    void log_setup(const char * func, const llama_cparams & cparams, uint32_t n_seq) const;
    void free_cells(uint32_t strm, llama_pos pos_from); // the inner cells holding positions >= pos_from become free
    void free_group_tails(uint32_t strm); // after an eviction: layer groups 1.. free their cells past their live end
    // f(memory) for every cache the memory holds: the model's own memory (group 0's cache, or the iSWA pair), then
    // layer groups 1..
    template <typename F> void each_cache(F f) {
        f(static_cast<llama_memory_i &>(*inner));
        for (auto & c : group_caches) {
            f(static_cast<llama_memory_i &>(*c));
        }
    }
    bool shift_window(llama_context * lctx, uint32_t strm, llama_pos delta); // the window cache follows a compaction
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
