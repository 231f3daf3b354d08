// The Locret memory's state files (see locret-memory.h): the eviction bookkeeping written after llama.cpp's own cells
// and K/V data, and one reader for every version since 2.

#include "locret-memory.h"
#include "locret-heads.h"
#include "locret-policy.h"

#include "llama-impl.h"
#include "llama-io.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <vector>

//
// state save/load: the bookkeeping follows llama.cpp's own cells and K/V data
//

// Variable-length parts of the state (a schedule, a sequence's rows) may be empty; an empty std::vector's data()
// may be null, and llama.cpp's buffer readers and writers memcpy it, which is undefined for a null pointer even
// at size 0 (UBSan reports it). These skip empty spans.
static void locret_write_span(llama_io_write_i & io, const void * src, size_t size) {
    if (size > 0) {
        io.write(src, size);
    }
}

static void locret_read_span(llama_io_read_i & io, void * dst, size_t size) {
    if (size > 0) {
        io.read(dst, size);
    }
}

static const uint32_t LOCRET_STATE_MAGIC   = 0x5443524c; // "LRCT"
// 6: the budget schedule after the header (its count of layers, 0 for none, then their budgets), and per sequence the
// cells each layer masks (dead_end, then live_end per layer) after its fields; 5: SAGE-KV's pending selection per
// sequence, and its captured query after the layers' units; 4: LagKV's scored_to per sequence; 3: a sequence's pinned
// query (Locret-Q). 5, 4, 3 and 2 (read as unpinned) load too, into a context without a schedule.
// 7: after the schedule, the positions mode (0 compact, 1 kept, 2 in place) and limit; per sequence its next RoPE position after
// the masks, and with kept (or in-place) positions each (layer, KV head)'s RoPE positions after its scores.
// 8: a policy's captured queries include the rows of a pinned question (SnapKV: its question setting's rows
// before its window's); such a policy's state of an earlier version is refused.
// 9: after the positions, the policy's own settings (locret-policy.h: their layout's version, their count, their
// values); the header's window is then the score pooling alone. Before, a policy with settings and no pooling (LagKV)
// kept its one setting there.
// 10: per sequence, after its policy's words, whether it was told a long prompt (locret_cells::long_prompt: the
// heads' pooling for long prompts applies to it); earlier versions read as not told.
static const uint32_t LOCRET_STATE_VERSION = 10;

// the positions mode a state records (enum llama_locret_positions: 0 compact, 1 kept, 2 in place; the value 2 needs no
// new version: an older build refuses it as another mode, and both modes with holes write their RoPE positions)
static uint32_t state_positions_mode(const locret_config & cfg) {
    return cfg.keep_positions  ? (uint32_t) LLAMA_LOCRET_POSITIONS_KEEP :
           cfg.rotate_in_place ? (uint32_t) LLAMA_LOCRET_POSITIONS_INPLACE : (uint32_t) LLAMA_LOCRET_POSITIONS_COMPACT;
}

// what a saved state must agree on with the context that loads it
struct locret_state_header {
    uint32_t magic;
    uint32_t version;
    uint32_t n_layers;   // evicting layers
    uint32_t n_cells;    // cells per sequence
    uint32_t budget;
    uint32_t policy;
    uint32_t n_streams;  // streams that follow
    uint32_t window;     // score pooling (0: none); before 9, a policy's one setting when it had no pooling; a zero
                         // "reserved" field before pooling existed
    uint64_t heads_fingerprint;
};

// A sequence's bookkeeping in a state file (its meta part; its data part, the units' positions, scores and captured
// queries, follows it). Fields of later versions read as zero from earlier ones.
struct locret_stream_meta {
    uint32_t id;
    uint32_t n_used;
    uint32_t uniform_from;
    uint32_t prev_output;
    uint32_t n_pinned;     // 3
    uint32_t policy_word0; // 4 (LagKV's scored_to before the policy interface named it)
    uint32_t policy_word1; // 5 (SAGE-KV's pending selection)
    uint32_t long_prompt;  // 10
    int64_t  logical_next;
    uint64_t n_evictions;
    uint64_t n_units_evicted;
    uint32_t dead_end;              // 6
    std::vector<uint32_t> live_end; // 6, per evicting layer
    uint32_t rope_next;             // 7 (before: n_used, compact positions)
};

// the 32-bit fields of a sequence's meta part in each version (id, n_used, uniform_from, prev_output, then what each
// version added)
static size_t locret_meta_fields(uint32_t version) {
    return version == 2 ? 4 : version == 3 ? 5 : version == 4 ? 6 : version < 10 ? 7 : 8;
}

//
// the policy's own settings
//

static void state_write_policy_settings(llama_io_write_i & io, const locret_config & cfg, const locret_policy & pol) {
    const uint32_t head[2] = { pol.settings_version(), cfg.policy_values.n };
    io.write(head, sizeof(head));
    locret_write_span(io, cfg.policy_values.value, sizeof(int32_t) * cfg.policy_values.n);
}

// a state continues only under the settings its scores were made with: the same score pooling (else the saved scores
// are on another scale than the ones this context computes next) and the same policy settings (LagKV's saved scores
// rank partitions of its size)
static void state_check_policy_settings(llama_io_read_i & io, uint32_t version, uint32_t window, const locret_config & cfg,
        const locret_policy & pol) {
    const locret_policy_entry & e = *locret_policy_find(cfg.policy);
    uint32_t saved_version = pol.settings_version();
    std::vector<int32_t> saved(cfg.policy_values.value, cfg.policy_values.value + cfg.policy_values.n);
    bool window_is_pool = true;
    if (version >= 9) {
        uint32_t head[2];
        io.read(head, sizeof(head));
        if (head[1] > locret_policy_values::MAX) {
            throw std::runtime_error("Locret: the saved state is corrupt (bad policy settings)");
        }
        saved_version = head[0];
        saved.resize(head[1]);
        locret_read_span(io, saved.data(), sizeof(int32_t) * head[1]);
    } else {
        // before 9 a policy's settings were fixed at their defaults (SnapKV's window and question rows, which size
        // its saved queries), but for a policy with settings and no pooling (LagKV), whose one setting the window held
        const std::vector<locret_policy_knob> knobs = pol.knobs();
        for (size_t i = 0; i < saved.size(); ++i) {
            saved[i] = knobs[i].def;
        }
        if (!saved.empty() && !pol.pools_scores()) {
            saved[0] = (int32_t) window;
            window_is_pool = false;
        }
    }
    if (window_is_pool && window != cfg.pool) {
        throw std::runtime_error(format("Locret: the saved state's scores were pooled over %u tokens, this context's "
                "over %u (--locret-pool)", window, cfg.pool));
    }
    const std::string why = locret_policy_settings_mismatch(e, saved_version, saved, cfg.policy_values);
    if (!why.empty()) {
        throw std::runtime_error("Locret: " + why);
    }
}

// what a state file is written from and checked against: the memory's settings, layers and stores
struct locret_state_view {
    const locret_config &                cfg;
    const locret_policy &                policy;
    const std::vector<locret_kv_layer> & layers;
    const locret_score_store &           scores;
    const locret_query_store &           queries;
    uint32_t                             n_streams;
};

//
// a sequence's parts and the header's checks
//

static void state_write_meta(llama_io_write_i & io, const locret_cells & s, uint32_t id) {
    const uint32_t fields[] = { id, s.n_used, s.uniform_from, (uint32_t) s.prev_output, s.n_pinned,
                                s.policy_state.word[0], s.policy_state.word[1], (uint32_t) s.long_prompt };
    const int64_t  next     = s.logical_next;
    const uint64_t stats[]  = { s.n_evictions, s.n_units_evicted };
    io.write(fields, sizeof(fields));
    io.write(&next, sizeof(next));
    io.write(stats, sizeof(stats));
    io.write(&s.dead_end, sizeof(s.dead_end));
    locret_write_span(io, s.live_end.data(), sizeof(uint32_t) * s.live_end.size());
    io.write(&s.rope_next, sizeof(s.rope_next));
}

static void state_write_data(llama_io_write_i & io, const locret_state_view & v, const locret_cells & s, uint32_t id) {
    // per layer and KV head: the units' logical positions, then their v.scores (zeros for a policy without a store)
    std::vector<float> block; // layer i's v.scores [n_used][n_head_kv]
    std::vector<float> row(s.n_used);
    for (size_t i = 0; i < v.layers.size(); ++i) {
        const uint32_t n_head_kv = v.layers[i].n_head_kv;
        block.assign((size_t) s.n_used * n_head_kv, 0.0f);
        if (!v.scores.empty()) {
            v.scores.get(i, id, s.n_used, block.data());
        }
        for (uint32_t hd = 0; hd < n_head_kv; ++hd) {
            for (uint32_t c = 0; c < s.n_used; ++c) {
                row[c] = block[(size_t) c * n_head_kv + hd];
            }
            locret_write_span(io, s.pos[i].data() + (size_t) hd * v.cfg.n_cells, sizeof(int32_t) * s.n_used);
            locret_write_span(io, row.data(), sizeof(float) * s.n_used);
            if (!s.rope.empty()) {
                locret_write_span(io, s.rope[i].data() + (size_t) hd * v.cfg.n_cells, sizeof(int32_t) * s.n_used);
            }
        }
    }
    // the v.queries the policy's next scoring reads, per layer
    std::vector<uint8_t> qrow;
    for (ggml_tensor * q : v.queries.tensors()) {
        qrow.resize(v.queries.block_bytes(q));
        ggml_backend_tensor_get(q, qrow.data(), (size_t) id * qrow.size(), qrow.size());
        locret_write_span(io, qrow.data(), qrow.size());
    }
}

static uint32_t state_read_header(llama_io_read_i & io, const locret_state_view & v, llama_seq_id seq_id,
        bool & rope_from_cells) {
    locret_state_header h;
    try {
        io.read(&h, sizeof(h));
    } catch (const std::exception &) {
        // a state saved by a cache without eviction ends with the cells
        throw std::runtime_error("Locret: the saved state ends before its Locret section (saved without eviction, or truncated)");
    }
    if (h.magic != LOCRET_STATE_MAGIC) {
        throw std::runtime_error("Locret: the saved state has no Locret section (saved without eviction?)");
    }
    if (h.version < 2 || h.version > LOCRET_STATE_VERSION) {
        throw std::runtime_error(format("Locret: the saved state has version %u, this build reads %u", h.version, LOCRET_STATE_VERSION));
    }
    const uint64_t fp = v.policy.uses_heads() ? llama_locret_heads_fingerprint(v.cfg.heads) : 0;
    if (h.n_layers != v.layers.size() || h.n_cells != v.cfg.n_cells || h.budget != v.cfg.budget) {
        throw std::runtime_error(format("Locret: the saved state was made with another model or budget "
                "(%u v.layers, %u cells, budget %u; this context: %zu, %u, %u)", h.n_layers, h.n_cells, h.budget,
                v.layers.size(), v.cfg.n_cells, v.cfg.budget));
    }
    if (h.policy != (uint32_t) v.cfg.policy || h.heads_fingerprint != fp) {
        throw std::runtime_error("Locret: the saved state was scored by another policy or other retaining heads");
    }
    std::vector<uint32_t> sched;
    if (h.version >= 6) {
        uint32_t n_sched = 0;
        io.read(&n_sched, sizeof(n_sched));
        if (n_sched != 0 && n_sched != v.layers.size()) {
            throw std::runtime_error("Locret: the saved state is corrupt (bad budget schedule)");
        }
        sched.resize(n_sched);
        locret_read_span(io, sched.data(), sizeof(uint32_t) * n_sched);
    }
    uint32_t positions[2] = { 0, 0 };
    if (h.version >= 7) {
        io.read(positions, sizeof(positions));
    }
    state_check_policy_settings(io, h.version, h.window, v.cfg, v.policy);
    // compact positions are a case of in-place ones (every unit in its rank's cell): such a state loads into either
    rope_from_cells = positions[0] == LLAMA_LOCRET_POSITIONS_COMPACT && v.cfg.rotate_in_place;
    if (!rope_from_cells &&
            (positions[0] != state_positions_mode(v.cfg) || (v.cfg.keep_positions && positions[1] != v.cfg.position_limit))) {
        const auto name = [](uint32_t mode, uint32_t limit) {
            return mode == LLAMA_LOCRET_POSITIONS_KEEP ? format("keep:%u", limit) :
                   mode == LLAMA_LOCRET_POSITIONS_INPLACE ? std::string("inplace") :
                   mode == LLAMA_LOCRET_POSITIONS_COMPACT ? std::string("compact") : format("unknown (%u)", mode);
        };
        throw std::runtime_error(format("Locret: the saved state was made with --locret-positions %s, this context "
                "uses %s", name(positions[0], positions[1]).c_str(),
                name(state_positions_mode(v.cfg), v.cfg.position_limit).c_str()));
    }
    if (sched != v.cfg.layer_budget) {
        throw std::runtime_error(format("Locret: the saved state was made with %s budget schedule than this context's "
                "(--locret-budget-schedule)", sched.empty() || v.cfg.layer_budget.empty() ? "a different" : "another"));
    }
    if (!v.queries.empty() && h.version < 5) {
        throw std::runtime_error("Locret: the saved state has no captured v.queries (saved by an older build)");
    }
    if (v.queries.pin_rows() > 0 && h.version < 8) {
        throw std::runtime_error("Locret: the saved state's captured v.queries have no rows for a pinned question (saved "
                "by an older build)");
    }
    const uint32_t n_expected = seq_id < 0 ? (uint32_t) v.n_streams : 1;
    if (h.n_streams != n_expected) {
        throw std::runtime_error(format("Locret: the saved state holds %u sequences, expected %u", h.n_streams, n_expected));
    }
    return h.version;
}

static locret_stream_meta state_read_meta(llama_io_read_i & io, const locret_state_view & v, uint32_t version) {
    uint32_t fields[8] = {};
    io.read(fields, sizeof(uint32_t) * locret_meta_fields(version));
    locret_stream_meta m;
    m.id           = fields[0];
    m.n_used       = fields[1];
    m.uniform_from = fields[2];
    m.prev_output  = fields[3];
    m.n_pinned     = fields[4];
    m.policy_word0 = fields[5];
    m.policy_word1 = fields[6];
    m.long_prompt  = fields[7];
    io.read(&m.logical_next, sizeof(m.logical_next));
    uint64_t stats[2];
    io.read(stats, sizeof(stats));
    m.n_evictions     = stats[0];
    m.n_units_evicted = stats[1];
    m.dead_end = 0;
    m.live_end.assign(v.layers.size(), 0);
    if (version >= 6) {
        io.read(&m.dead_end, sizeof(m.dead_end));
        locret_read_span(io, m.live_end.data(), sizeof(uint32_t) * m.live_end.size());
    }
    m.rope_next = m.n_used;
    if (version >= 7) {
        io.read(&m.rope_next, sizeof(m.rope_next));
    }
    // before schedules every layer read every cell: live_end == dead_end == 0 above
    return m;
}

static void state_check_meta(const locret_state_view & v, const locret_stream_meta & m) {
    bool masks_ok = m.dead_end <= m.n_used;
    for (size_t i = 0; i < v.layers.size(); ++i) {
        masks_ok = masks_ok && m.live_end[i] <= m.dead_end && (m.dead_end == m.live_end[i] || !v.cfg.layer_budget.empty());
    }
    if (!masks_ok) {
        throw std::runtime_error("Locret: the saved state is corrupt (bad masked cells)");
    }
    const bool rope_ok = v.cfg.keep_positions ? m.rope_next >= m.n_used && m.rope_next <= v.cfg.position_limit :
                                              m.rope_next == m.n_used;
    if (!rope_ok || m.id >= v.n_streams || m.n_used > v.cfg.n_cells || m.uniform_from > m.n_used || m.logical_next < m.n_used ||
            m.logical_next > std::numeric_limits<llama_pos>::max() ||
            (m.n_pinned > 0 && (uint64_t) m.n_pinned + v.cfg.stabilizers + v.policy.unscored_units(v.cfg) >= v.cfg.min_layer_budget()) ||
            !v.policy.state_ok(v.cfg, locret_policy_state { { m.policy_word0, m.policy_word1 } }, m.n_used)) {
        throw std::runtime_error("Locret: the saved state is corrupt (bad sequence header)");
    }
}

static void state_read_data(llama_io_read_i & io, const locret_state_view & v, locret_cells & s, uint32_t id,
        bool rope_from_cells, const llama_kv_cache & kv, locret_score_store & scores) {
    // every version writes the units the same way; the queries' presence was checked
    std::vector<float> block;
    std::vector<float> row(s.n_used);
    std::vector<int32_t> seen; // kept positions: a row's logical and RoPE positions, each once
    for (size_t i = 0; i < v.layers.size(); ++i) {
        const uint32_t n_head_kv = v.layers[i].n_head_kv;
        block.assign((size_t) s.n_used * n_head_kv, 0.0f);
        for (uint32_t hd = 0; hd < n_head_kv; ++hd) {
            int32_t * pos  = s.pos[i].data() + (size_t) hd * v.cfg.n_cells;
            int32_t * rope = s.rope.empty() ? nullptr : s.rope[i].data() + (size_t) hd * v.cfg.n_cells;
            locret_read_span(io, pos, sizeof(int32_t) * s.n_used);
            locret_read_span(io, row.data(), sizeof(float) * s.n_used);
            if (rope != nullptr && rope_from_cells) {
                // compact positions: cell c sits at position c, after the layer's masked cells when below them
                const int32_t masked = (int32_t) (s.dead_end - s.live_end[i]);
                for (uint32_t c = 0; c < s.n_used; ++c) {
                    rope[c] = c >= s.live_end[i] && c < s.dead_end ? -1 :
                              (int32_t) c + (c < s.live_end[i] ? masked : 0);
                }
            } else if (rope != nullptr) {
                locret_read_span(io, rope, sizeof(int32_t) * s.n_used);
                // cells below the last eviction's hold units in any order, each at one position; later ones in order
                for (const int32_t * v : { pos, rope }) {
                    seen.clear();
                    for (uint32_t c = 0; c < s.n_used; ++c) {
                        if (v[c] >= 0) {
                            seen.push_back(v[c]);
                        }
                    }
                    std::sort(seen.begin(), seen.end());
                    if (std::adjacent_find(seen.begin(), seen.end()) != seen.end()) {
                        throw std::runtime_error("Locret: the saved state is corrupt (a position held twice)");
                    }
                }
            }
            int32_t prev = -1;
            for (uint32_t c = 0; c < s.n_used; ++c) {
                if (c >= s.live_end[i] && c < s.dead_end) {
                    if (pos[c] != -1 || (rope != nullptr && rope[c] != -1)) {
                        throw std::runtime_error("Locret: the saved state is corrupt (a masked cell holds a unit)");
                    }
                    continue; // masked in this layer: no unit
                }
                const bool ordered = rope == nullptr || c >= s.uniform_from;
                if (pos[c] < 0 || pos[c] >= s.logical_next || (ordered && pos[c] <= prev) ||
                        (rope != nullptr && (rope[c] < 0 || rope[c] >= (int32_t) s.rope_next))) {
                    throw std::runtime_error("Locret: the saved state is corrupt (positions out of order)");
                }
                prev = ordered ? pos[c] : prev;
                // pinned units are never evicted: every head holds the same ones, in the first cells
                const int32_t pos0 = s.pos[0][c]; // layer 0, KV head 0 (read first)
                if ((pos[c] < (int32_t) s.n_pinned || (pos0 >= 0 && pos0 < (int32_t) s.n_pinned)) && pos[c] != pos0) {
                    throw std::runtime_error("Locret: the saved state is corrupt (pinned units differ between heads)");
                }
                block[(size_t) c * n_head_kv + hd] = row[c];
            }
        }
        if (!scores.empty()) {
            scores.set(i, id, s.n_used, block.data());
        }
    }
    std::vector<uint8_t> qrow;
    for (ggml_tensor * q : v.queries.tensors()) {
        qrow.resize(v.queries.block_bytes(q));
        locret_read_span(io, qrow.data(), qrow.size());
        ggml_backend_tensor_set(q, qrow.data(), (size_t) id * qrow.size(), qrow.size());
    }
    // llama.cpp restored the cells from 0: they must be exactly the used ones
    const llama_kv_cells & cells = kv.get_cells((llama_seq_id) id);
    if (cells.get_used() != s.n_used || (s.n_used > 0 && cells.used_max_p1() != s.n_used)) {
        throw std::runtime_error("Locret: the restored cells do not match the saved Locret state");
    }
}

static void state_read_groups(llama_io_read_i & io, const locret_group_caches & grp, const std::vector<locret_cells> & streams,
        llama_seq_id seq_id, llama_state_seq_flags flags) {
    uint32_t n_extra = 0;
    try {
        io.read(&n_extra, sizeof(n_extra));
    } catch (const std::exception &) {
        throw std::runtime_error("Locret: the saved state has no layer groups' caches (saved by a context that holds its "
                "budget schedule in one cache, or truncated)");
    }
    if (n_extra != grp.size() - 1) {
        throw std::runtime_error(format("Locret: the saved state holds %u layer groups, this context %zu", n_extra + 1,
                grp.size()));
    }
    for (size_t g = 1; g < grp.size(); ++g) {
        grp.cache(g)->state_read(io, seq_id, flags);
        // llama.cpp restored each stream's cells from 0: exactly the ones the group's layers hold
        for (size_t id = 0; id < streams.size(); ++id) {
            if (seq_id >= 0 && (size_t) seq_id != id) {
                continue;
            }
            const locret_cells & s = streams[id];
            const uint32_t n_own = s.n_used - grp.gap(g, s);
            const llama_kv_cells & cells = grp.cache(g)->get_cells((llama_seq_id) id);
            if (cells.get_used() != n_own || (n_own > 0 && cells.used_max_p1() != n_own)) {
                throw std::runtime_error(format("Locret: the restored cells of layer group %zu do not match the saved "
                        "Locret state", g));
            }
        }
    }
}

//
// writing
//

void llama_locret_memory::state_write(llama_io_write_i & io, llama_seq_id seq_id, llama_state_seq_flags flags) const {
    if (flags & LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) {
        throw std::runtime_error("Locret: a partial (window-only) state cannot be saved from an evicting cache");
    }
    inner->state_write(io, seq_id, flags);
    const locret_state_view view = { cfg, *policy, layers, scores, queries, (uint32_t) streams.size() };

    std::vector<uint32_t> ids;
    for (size_t s = 0; s < streams.size(); ++s) {
        if (seq_id < 0 || (size_t) seq_id == s) {
            ids.push_back((uint32_t) s);
        }
    }
    locret_state_header h = {};
    h.magic             = LOCRET_STATE_MAGIC;
    h.version           = LOCRET_STATE_VERSION;
    h.n_layers          = (uint32_t) layers.size();
    h.n_cells           = cfg.n_cells;
    h.budget            = cfg.budget;
    h.policy            = (uint32_t) cfg.policy;
    h.n_streams         = (uint32_t) ids.size();
    h.window            = cfg.pool;
    h.heads_fingerprint = policy->uses_heads() ? llama_locret_heads_fingerprint(cfg.heads) : 0;
    io.write(&h, sizeof(h));
    const uint32_t n_sched = (uint32_t) cfg.layer_budget.size();
    io.write(&n_sched, sizeof(n_sched));
    locret_write_span(io, cfg.layer_budget.data(), sizeof(uint32_t) * n_sched);
    const uint32_t positions[2] = { state_positions_mode(cfg), cfg.keep_positions ? cfg.position_limit : 0u };
    io.write(positions, sizeof(positions));
    state_write_policy_settings(io, cfg, *policy);
    for (uint32_t id : ids) {
        state_write_meta(io, streams[id], id);
        state_write_data(io, view, streams[id], id);
    }
    // layer groups 1..: their caches' own states, after a count (a context without groups writes neither)
    if (grp.size() > 1) {
        const uint32_t n_extra = (uint32_t) (grp.size() - 1);
        io.write(&n_extra, sizeof(n_extra));
        for (size_t g = 1; g < grp.size(); ++g) {
            grp.cache(g)->state_write(io, seq_id, flags);
        }
    }
}



//
// reading: one reader for every version, the fields a version lacks read as zero
//

void llama_locret_memory::state_read(llama_io_read_i & io, llama_seq_id seq_id, llama_state_seq_flags flags) {
    if (flags & LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) {
        throw std::runtime_error("Locret: a partial (window-only) state cannot be loaded into an evicting cache");
    }
    if (seq_id >= 0 && (size_t) seq_id >= streams.size()) {
        throw std::runtime_error(format("Locret: no sequence %d to load a state into", seq_id));
    }
    // the sequences being replaced start empty (the inner cache then restores its cells from cell 0 on)
    auto empty_target = [&]() {
        if (seq_id < 0) {
            each_cache([](llama_memory_i & m) { m.clear(true); });
            for (auto & s : streams) {
                s.reset();
            }
        } else {
            each_cache([&](llama_memory_i & m) { m.seq_rm(seq_id, -1, -1); });
            streams[seq_id].reset();
        }
    };
    empty_target();
    const locret_state_view view = { cfg, *policy, layers, scores, queries, (uint32_t) streams.size() };
    try {
        inner->state_read(io, seq_id, flags);
        if (faults.take(LOCRET_FAULT_STATE_READ)) {
            throw std::runtime_error("Locret: state load failed after the KV cells were restored (injected)");
        }
        bool rope_from_cells = false;
        const uint32_t version = state_read_header(io, view, seq_id, rope_from_cells);
        const uint32_t n_streams = seq_id < 0 ? (uint32_t) streams.size() : 1;
        for (uint32_t k = 0; k < n_streams; ++k) {
            locret_stream_meta m = state_read_meta(io, view, version);
            if (seq_id >= 0) {
                m.id = (uint32_t) seq_id;
            }
            state_check_meta(view, m);
            locret_cells & s = streams[m.id];
            s.n_used          = m.n_used;
            s.uniform_from    = m.uniform_from;
            s.prev_output     = m.prev_output != 0;
            s.logical_next    = (llama_pos) m.logical_next;
            s.n_pinned        = m.n_pinned;
            s.long_prompt     = m.long_prompt != 0;
            s.policy_state    = locret_policy_state { { m.policy_word0, m.policy_word1 } };
            s.n_evictions     = m.n_evictions;
            s.n_units_evicted = m.n_units_evicted;
            s.dead_end        = m.dead_end;
            s.live_end        = m.live_end;
            s.rope_next       = m.rope_next;
            state_read_data(io, view, s, m.id, rope_from_cells, *kv, scores);
            // what each part passed alone must hold together too (locret-cells.h's invariants)
            const std::string why = s.check();
            if (!why.empty()) {
                throw std::runtime_error(format("Locret: the state of sequence %u is inconsistent: %s", m.id, why.c_str()));
            }
        }
        if (grp.size() > 1) {
            state_read_groups(io, grp, streams, seq_id, flags);
        }
    } catch (...) {
        // a failed load leaves the sequences it was loading empty and consistent
        empty_target();
        throw;
    }
}





