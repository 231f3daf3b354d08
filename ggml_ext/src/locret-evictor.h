// The Locret memory's eviction (locret-memory.h owns one): the eviction graphs on schedulers of their own, reserved
// for their worst case, and each eviction in turns of at most COMPACT_MAX_SEQ sequences, each turn in steps:
//   choose  (choose_step: the policy's scoring through its hooks, each layer's cut, the selection on the device or the
//            host), plan (plan_step: keep lists, positions after the eviction and the layout's row moves, locret-layout.h),
//   compact (compact_turn: one compaction graph for every sequence of the turn, locret-compact.h),
//   commit  (commit_step: each sequence's cells take their new positions, locret-cells.h),
// or abandon (abandon_turn) after a compaction that failed part-way. Nothing changes before the compaction has run: a
// failure before it leaves the cache as it was.
//
// It works on the memory's layers, streams and stores (locret_evict_parts: bound at construction, read as the memory
// sets them up), and knows nothing else of the memory; it keeps its own scratch between evictions, so that an eviction
// allocates nothing once they have grown.
#pragma once

#include "locret-cells.h"
#include "locret-compact.h"
#include "locret-faults.h"
#include "locret-groups.h"
#include "locret-plan.h"
#include "locret-policy.h"
#include "locret-select.h"
#include "locret-settings.h"
#include "locret-stores.h"
#include "locret-workers.h"

#include "llama-graph.h"
#include "llama-kv-cache.h"

#include "ggml-cpp.h"

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

struct llama_context;

// What the eviction works on: the memory's parts, which the memory (locret-memory.h) hands its evictor when it is made
// and sets up afterwards (the references are read at each eviction, never at construction).
struct locret_evict_parts {
    const locret_config &                  cfg;
    const std::unique_ptr<locret_policy> & policy;
    const std::vector<locret_kv_layer> &   layers;
    std::vector<locret_cells> &            streams;
    const locret_score_store &             scores;
    const locret_query_store &             queries;
    const locret_group_caches &            grp;
    llama_kv_cache * const &               kv;           // the cache that evicts (group 0's)
    llama_kv_cache * const &               kv_swa;       // an iSWA pair's window cache, or NULL
    const bool &                           v_trans;
    const bool &                           select_graph; // the heads policy selects on the device
    locret_faults &                        faults;
    // empties sequence s in every cache the memory holds and its bookkeeping (after a compaction failed part-way)
    std::function<void(llama_seq_id)>      drop_sequence;
};

// where eviction time goes (microseconds, summed over sequences) and what evictions did
struct locret_evict_timing {
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
    // kept positions: evictions that compacted positions because a part would pass the limit (all sequences)
    uint64_t n_repositions = 0;
};

class locret_evictor {
public:
    explicit locret_evictor(const locret_evict_parts & parts);

    // the most sequences one compaction graph moves (its move tables and compute buffers are sized for them, not for
    // every stream): a ubatch that evicts more sequences evicts them in turns of this many
    static constexpr uint32_t COMPACT_MAX_SEQ = 4;

    // the schedulers and compute buffers of the eviction graphs (selection, scoring, compaction), apart from the
    // context's so that its graphs stay allocated (and reusable) across evictions; made for the worst case when the
    // context reserves its own graphs. false (with the reason in llama_locret_last_error) when that fails.
    bool reserve(llama_context * lctx);
    size_t buffer_size() const; // bytes of the eviction graphs' compute buffers
    size_t move_tables_size() const { return moves.device_bytes(); } // bytes of the compaction's move tables
    uint32_t compact_seq() const { return turn_seq; } // the most sequences one compaction moves

    // the eviction the plan puts before its ubatch: 1 if the context's scheduler was used too (an iSWA window cache
    // was shifted: the context's last graph cannot be reused), 0 otherwise (evicted or not due), -1 on failure (the
    // cache is then as before, or, if the computation failed part-way, the affected sequences are emptied; with more
    // sequences than one turn takes, those of the turns before the failed one stay evicted, each as consistent as
    // after a whole eviction)
    int evict(llama_context * lctx, const locret_ubatch_plan & plan);

    // waits for what the eviction queued and never waited for (the last compaction moved the scores): before the
    // host copies a sequence's scores
    void wait_idle();

    locret_evict_timing t;

private:
    const locret_evict_parts mem; // what the eviction works on: the memory's parts

    // The eviction's graphs, each kind with a scheduler of its own. ggml's scheduler keeps the allocation of the last
    // graph it was given: a graph of another shape (node count, or a tensor larger than reserved) is re-reserved, and
    // with more than one backend (a GPU) ggml_backend_sched_alloc_graph first waits for every backend. On one shared
    // scheduler the selection, scoring and compaction graphs alternated, so each allocation hid a host round trip
    // (found on an H200: the selection's timer held the ubatch's whole compute). One scheduler per kind, reserved for
    // its worst case, sees the same shape eviction after eviction and allocates without waiting.
    enum graph_kind { GRAPH_SCORE, GRAPH_SELECT, GRAPH_COMPACT_COPY, GRAPH_COMPACT_ROTATE, GRAPH_KINDS };
    struct graph_slot {
        ggml_backend_sched_ptr            sched;
        std::unique_ptr<llm_graph_result> res;
    };
    graph_slot graphs[GRAPH_KINDS];
    size_t slot_buffer_size(graph_kind kind) const; // bytes of one kind's compute buffers (0: never reserved)
    // a scheduler on the context's backends, to wait for them (every slot's is)
    ggml_backend_sched_t any_sched() const { return graphs[GRAPH_COMPACT_ROTATE].sched.get(); }
    // reserve(), in steps: each slot's scheduler on the context's backends, the host threads and the ubatch-end events
    void make_scheds(llama_context * lctx);
    // the move tables and the selection's read-back for the worst case, the moves at their capacity (the shapes the
    // reservation needs); false (with the reason in llama_locret_last_error) when the tables cannot be allocated
    bool reserve_tables(ggml_backend_sched_t ctx_sched);
    // reserves slot `kind`'s scheduler for the graph `build` makes in the slot's result; false when that fails
    bool reserve_slot(graph_kind kind, const std::function<ggml_cgraph *(llm_graph_result *)> & build);
    // every slot reserved for its worst case (the compactions, the selection, the policy's scoring); false on failure
    bool reserve_graphs();

    // On a backend that computes asynchronously (a GPU) the ubatch whose scores an eviction reads may still be running
    // when the eviction starts: an event recorded then marks the ubatch's end, and the eviction's one wait is taken in
    // two steps, to that event (the ubatch's compute: not the eviction's time) and then to the end of what the eviction
    // queued. The device's queue is not drained in between: still one round trip, counted once.
    struct event_free { void operator()(ggml_backend_event_t e) const { ggml_backend_event_free(e); } };
    std::vector<std::pair<ggml_backend_t, std::unique_ptr<ggml_backend_event, event_free>>> ubatch_end_events;
    bool ubatch_end_marked = false;
    uint64_t ubatch_wait_us = 0; // this turn's wait for the ubatch's end
    void mark_ubatch_end();   // records the events (none on a CPU-only context)
    void wait_ubatch_end();   // waits for them, once per turn

    // An eviction waits for the backend once per turn: for the data its selection reads (the device's selection read
    // back, a scoring graph's result, the scores the host selects from) or, when it reads nothing, before the
    // compaction's move tables are written (the last turn's compaction may still read them). The graphs it queues
    // (selection, scoring, compaction) run on the context's own backends, in order after the ubatch that wrote the
    // scores, and the compaction is not waited for: the next ubatch is queued after it.
    bool waited = false; // this turn has waited for the backend
    // waits for the context's backends unless the turn already has
    void wait_for_backend(llama_context * lctx);

    // the device's selection for stream `strm` into select_idx: I32 [n_top] per (layer, KV head), unordered
    bool select_on_device(uint32_t strm, uint32_t cell0, uint32_t n_cand, uint32_t n_top);
    // runs the selection graph `build` makes (its outputs, each with where its result goes in select_idx) and reads
    // every output back with the eviction's one wait; false if it could not run
    bool run_selection(const std::function<void(ggml_context *, std::vector<std::pair<ggml_tensor *, size_t>> &)> & build);
    // a budget schedule's device selection of stream strm: one graph for every layer whose cut selects there (its
    // result at select_idx + cut.off, [n_head_kv][n_top]), read back with one wait; false if it could not run
    bool select_layers_on_device(uint32_t strm, std::vector<locret_layer_cut> & cuts);
    static unsigned host_threads(llama_context * lctx, size_t n_work); // host threads for n_work units
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
    void select_layer_masked(size_t i, size_t row0, const locret_layer_cut & cut, uint32_t n_used, uint32_t n_keep,
                             uint32_t n_pin, const float * block, const locret_cells & s, uint32_t * keep,
                             const int32_t * top) const;

    // builds one eviction-time scoring graph on the eviction's own scheduler and runs it; false (the reason logged and
    // in llama_locret_last_error) when it cannot run. `what` names what it scored, for LOCRET_PROFILE.
    bool run_score_graph(const char * policy_name, const std::string & what,
                         const std::function<void(ggml_context *, ggml_cgraph *)> & build,
                         const std::function<void()> & set_inputs);
    // what the policy sees of the memory (locret_policy_env)
    locret_policy_env policy_env();

    // one turn of an eviction: select, compact and record steps [0, n_steps); -1 on failure (see evict())
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
    bool choose_step(llama_context * lctx, const locret_step & st, turn_choice & ch);
    void plan_step(llama_context * lctx, const locret_step & st, const turn_choice & ch);
    void keep_layer(size_t i, const locret_step & st, const turn_choice & ch);
    void plan_layer(size_t i, const locret_step & st, const turn_choice & ch, size_t p);
    locret_compact_status compact_turn(llama_context * lctx, int64_t t_selected_us);
    bool commit_step(llama_context * lctx, size_t p, bool & shifted);
    void abandon_turn();
    // the window cache (iSWA) follows a compaction that moved stream strm's next RoPE position by delta
    bool shift_window(llama_context * lctx, uint32_t strm, llama_pos delta);

    // scratch of an eviction, kept between evictions (no allocation once they have grown)
    std::vector<locret_step>            steps_evicting; // the steps of the ubatch being evicted that drop units
    std::vector<turn_step>              turn_pending;   // the turn's steps that evict or reposition
    std::vector<size_t>                 turn_row0;      // first (layer, KV head) row of each layer
    uint64_t                            turn_kept = 0;
    std::vector<uint64_t>               turn_moved;     // per layer: rows the turn's compaction moves to another cell
    std::vector<uint64_t>               turn_rotated;   // per layer: keys it re-rotates
    std::vector<locret_layer_cut>       cuts;           // per layer: the step's cut
    // per pending step: the positions after it (and the RoPE positions, kept positions) and each layer's units,
    // swapped in when it succeeds
    std::vector<std::vector<std::vector<int32_t>>> pos_next;
    std::vector<std::vector<std::vector<int32_t>>> rope_pos_next;
    std::vector<std::vector<uint32_t>>             live_next;
    locret_host_block     select_idx_block; // the device's selection, read back (pinned when the cache is on a device)
    int32_t *             select_idx     = nullptr;
    size_t                select_idx_cap = 0;
    std::vector<float>    select_scores; // the scores read back for a host selection
    std::vector<uint32_t> keep_cells;    // the kept cells of every (layer, KV head)
    locret_moves          moves;
    uint32_t              turn_seq = 1;  // sequences per turn of an eviction (min(streams, COMPACT_MAX_SEQ))
    locret_workers        workers;       // the host threads that turn an eviction's choice into keep lists and moves
};
