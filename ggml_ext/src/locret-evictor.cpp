// The Locret memory's eviction (see locret-evictor.h): the eviction graphs' reservation, and each turn of an eviction
// in steps: choose (the policy's scoring through its hooks, each layer's cut, selection on the device or the host),
// plan (keep lists, and the layout's moves: locret-layout.h), compact (one graph per turn of sequences), commit (each
// sequence's cells: locret-cells.h), or abandon after a compaction that failed part-way.

#include "locret-evictor.h"
#include "locret-heads.h"
#include "locret-layout.h"
#include "locret-select.h"

#include "llama-context.h"
#include "llama-impl.h"

#include <algorithm>
#include <cstdlib>
#include <functional>

//
// eviction
//

locret_evictor::locret_evictor(const locret_evict_parts & parts) : mem(parts) {
}

size_t locret_evictor::slot_buffer_size(graph_kind kind) const {
    const graph_slot & g = graphs[kind];
    size_t n = 0;
    for (int i = 0; g.sched && i < ggml_backend_sched_get_n_backends(g.sched.get()); ++i) {
        n += ggml_backend_sched_get_buffer_size(g.sched.get(), ggml_backend_sched_get_backend(g.sched.get(), i));
    }
    return n;
}

size_t locret_evictor::buffer_size() const {
    size_t n = 0;
    for (int kind = 0; kind < GRAPH_KINDS; ++kind) {
        n += slot_buffer_size((graph_kind) kind);
    }
    return n;
}

void locret_evictor::wait_idle() {
    if (any_sched() != nullptr) {
        ggml_backend_sched_synchronize(any_sched());
    }
}

bool locret_evictor::shift_window(llama_context * lctx, uint32_t strm, llama_pos delta) {
    if (mem.kv_swa == nullptr || delta == 0) {
        return true;
    }
    mem.kv_swa->seq_add((llama_seq_id) strm, -1, -1, delta);
    // apply the K-shift now: the next ubatch reads the window cache in the new frame
    return mem.kv_swa->update(lctx, true, {});
}

// the first of the scheduler's backends that can use t's buffer (the device it lives on), NULL if none
static ggml_backend_t locret_backend_holding(ggml_backend_sched_t sched, const ggml_tensor * t) {
    for (int b = 0; b < ggml_backend_sched_get_n_backends(sched); ++b) {
        ggml_backend_t cand = ggml_backend_sched_get_backend(sched, b);
        if (ggml_backend_supports_buft(cand, ggml_backend_buffer_get_type(t->buffer))) {
            return cand;
        }
    }
    return nullptr;
}

void locret_evictor::make_scheds(llama_context * lctx) {
    // the context's backends, each with its default buffer type
    ggml_backend_sched_t ctx_sched = lctx->get_sched();
    std::vector<ggml_backend_t> backends;
    std::vector<ggml_backend_buffer_type_t> bufts;
    for (int i = 0; i < ggml_backend_sched_get_n_backends(ctx_sched); ++i) {
        backends.push_back(ggml_backend_sched_get_backend(ctx_sched, i));
        bufts.push_back(ggml_backend_get_default_buffer_type(backends.back()));
    }
    // the host threads of the evictions' bookkeeping, started now rather than in the first eviction
    workers.reserve((unsigned) std::min<size_t>(mem.layers.size(), host_threads(lctx, SIZE_MAX)));
    const size_t max_nodes = std::max(32 * mem.layers.size() + 64, mem.policy->score_graph_nodes(mem.layers.size()));
    for (auto & g : graphs) {
        g.sched.reset(ggml_backend_sched_new(backends.data(), bufts.data(), (int) backends.size(), max_nodes, false, false));
        g.res.reset(new llm_graph_result((int64_t) max_nodes));
    }
    // the end of each ubatch on the backends that compute asynchronously (events: GPUs; a CPU backend has none)
    ubatch_end_events.clear();
    for (ggml_backend_t b : backends) {
        ggml_backend_dev_t dev = ggml_backend_get_device(b);
        if (dev == nullptr || ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU) {
            continue;
        }
        if (ggml_backend_event_t ev = ggml_backend_event_new(dev)) {
            ubatch_end_events.emplace_back(b, std::unique_ptr<ggml_backend_event, event_free>(ev));
        }
    }
}

// every move of the tables at their capacity, from and to row 0: the shapes the reservation needs
static void locret_fill_moves_for_reserve(locret_moves & moves) {
    for (auto & m : moves.layer) {
        // only the shapes matter for the reservation, but a transposed V's element indices are made from the rows
        std::fill(m.src, m.src + m.cap, 0);
        std::fill(m.dst, m.dst + m.cap, 0);
        std::fill(m.delta, m.delta + m.cap, 0);
        if (m.kv_src != nullptr) {
            std::fill(m.kv_src, m.kv_src + m.cap, 0);
            std::fill(m.kv_dst, m.kv_dst + m.cap, 0);
        }
        m.n      = m.cap;
        m.n_copy = m.cap;
    }
}

bool locret_evictor::reserve_tables(ggml_backend_sched_t ctx_sched) {
    // the worst cases: every retained unit of every sequence of a turn moves; a selection from a full cache. The moves
    // and the selection's read-back get their host memory here, pinned when the cache is on a device. A turn takes at
    // most COMPACT_MAX_SEQ sequences, so that a server's many slots do not multiply these buffers (at 256 slots they
    // would be several hundred MiB); LOCRET_DEBUG_COMPACT_SEQ=N takes fewer (tests: turns with a few sequences).
    turn_seq = std::min<uint32_t>((uint32_t) mem.streams.size(), COMPACT_MAX_SEQ);
    if (const char * e = getenv("LOCRET_DEBUG_COMPACT_SEQ")) {
        turn_seq = std::max<uint32_t>(1, std::min<uint32_t>(turn_seq, (uint32_t) atoi(e)));
    }
    std::vector<size_t> cap(mem.layers.size());
    size_t n_rows = 0;
    for (size_t i = 0; i < mem.layers.size(); ++i) {
        cap[i] = (size_t) turn_seq * mem.cfg.budget * mem.layers[i].n_head_kv;
        n_rows += mem.layers[i].n_head_kv;
    }
    try {
        // layer groups: K/V rows of caches of their own sizes, in tables of their own, moved layer by layer
        moves.allocate(cap, ggml_backend_buffer_get_type(mem.layers[0].k->buffer), mem.grp.size() > 1);
        if (mem.cfg.rotate_in_place) {
            moves.allocate_in_place();
        }
        if (mem.grp.size() == 1) {
            moves.make_stack(mem.layers, mem.v_trans, mem.kv->get_size(), mem.kv->get_n_stream());
        }
        // the copies into the tables join the queue of the backend that holds them (a GPU, an RPC server);
        // LOCRET_DEBUG_WAITED_UPLOADS=1 waits for each copy instead (the earlier form: tests and benchmarks compare)
        const char * waited = getenv("LOCRET_DEBUG_WAITED_UPLOADS");
        moves.queue = waited != nullptr && atoi(waited) != 0 ? nullptr : locret_backend_holding(ctx_sched, moves.t_src);
    } catch (const std::exception & e) {
        locret_set_error(e.what());
        return false;
    }
    locret_fill_moves_for_reserve(moves);
    select_idx_cap = mem.select_graph ? n_rows * mem.cfg.budget : 0;
    select_idx = (int32_t *) select_idx_block.reserve(locret_host_buft_for(mem.layers[0].k), select_idx_cap * sizeof(int32_t));
    return true;
}

bool locret_evictor::reserve_slot(graph_kind kind,
        const std::function<ggml_cgraph *(llm_graph_result *)> & build) {
    graph_slot & g = graphs[kind];
    g.res->reset();
    const bool ok = ggml_backend_sched_reserve(g.sched.get(), build(g.res.get()));
    g.res->reset();
    ggml_backend_sched_reset(g.sched.get());
    return ok;
}

bool locret_evictor::reserve_graphs() {
    // each kind reserved for its worst case, so that no eviction's graph outgrows its reservation: the compaction
    // that re-rotates keys (compact positions, and kept positions at their limit), the one that only copies rows (kept
    // positions), the selection from a full cache, the policy's largest scoring graph
    const auto compact_graph = [&](llm_graph_result * res) {
        moves.prepare(mem.layers); // the form the evictions will use (every layer at its room: no padding)
        return locret_build_compact_graph(res, mem.kv, mem.v_trans, mem.layers, moves);
    };
    moves.rotate = true;
    bool ok = reserve_slot(GRAPH_COMPACT_ROTATE, compact_graph);
    // (a model without RoPE never re-rotates: its compactions are all copies)
    const bool copies = mem.cfg.holes_filled() || std::any_of(mem.layers.begin(), mem.layers.end(),
            [](const locret_kv_layer & L) { return !L.rot.rope; });
    if (ok && copies) {
        moves.rotate = false;
        ok = reserve_slot(GRAPH_COMPACT_COPY, compact_graph);
    }
    if (ok && mem.select_graph && mem.cfg.budget < mem.cfg.capacity) {
        ok = reserve_slot(GRAPH_SELECT, [&](llm_graph_result * res) {
            ggml_cgraph * gf = res->get_gf();
            if (!mem.cfg.has_schedule()) {
                ggml_build_forward_expand(gf, locret_build_select(res->get_ctx(), mem.scores.all(), 0, mem.cfg.n_cells, 0, mem.cfg.capacity, mem.cfg.budget));
                return gf;
            }
            // a schedule: every layer choosing its budget from a full cache, its candidates in two runs
            const uint32_t n0 = mem.cfg.capacity / 2;
            for (size_t i = 0; i < mem.layers.size(); ++i) {
                ggml_build_forward_expand(gf, locret_build_select_runs(res->get_ctx(), mem.scores.layer(i), 0,
                        mem.cfg.n_cells, 0, n0, n0, mem.cfg.capacity - n0, std::min(mem.cfg.budget_of(i), mem.cfg.capacity - 1)));
            }
            return gf;
        });
    }
    if (ok && mem.policy->score_graph_nodes(mem.layers.size()) > 0) {
        ok = reserve_slot(GRAPH_SCORE, [&](llm_graph_result * res) {
            ggml_cgraph * gf = res->get_gf();
            mem.policy->build_worst_score_graph(policy_env(), res->get_ctx(), gf);
            return gf;
        });
    }
    return ok;
}

bool locret_evictor::reserve(llama_context * lctx) {
    make_scheds(lctx);
    if (!reserve_tables(lctx->get_sched())) {
        return false;
    }
    const bool ok = reserve_graphs();
    moves.clear();
    if (!ok) {
        locret_set_error("failed to allocate the compute buffers of the Locret eviction graphs");
        return false;
    }
    const double MiB = 1024.0 * 1024.0;
    LLAMA_LOG_INFO("%s: Locret eviction graphs: compute buffers %.2f MiB (scoring %.2f, selection %.2f, compaction "
            "%.2f copying, %.2f re-rotating), move tables %.2f MiB, score store %.2f MiB, up to %u sequences per "
            "compaction\n", __func__, buffer_size() / MiB, slot_buffer_size(GRAPH_SCORE) / MiB,
            slot_buffer_size(GRAPH_SELECT) / MiB, slot_buffer_size(GRAPH_COMPACT_COPY) / MiB,
            slot_buffer_size(GRAPH_COMPACT_ROTATE) / MiB, move_tables_size() / MiB, mem.scores.bytes() / MiB,
            compact_seq());
    return true;
}

unsigned locret_evictor::host_threads(llama_context * lctx, size_t n_work) {
    // LOCRET_DEBUG_HOST_THREADS=N: N threads whatever the work (tests run small caches on several threads)
    if (const char * e = getenv("LOCRET_DEBUG_HOST_THREADS")) {
        return (unsigned) std::max(1, atoi(e));
    }
    // the context's batch threads where the work outweighs waking them (about 30K units): a CPU backend has finished
    // its graph by now, and a GPU waits for this
    return n_work < (1u << 15) ? 1 : (unsigned) std::max(1, llama_n_threads_batch(lctx));
}

bool locret_evictor::run_selection(
        const std::function<void(ggml_context *, std::vector<std::pair<ggml_tensor *, size_t>> &)> & build) {
    const int64_t p0 = ggml_time_us();
    graph_slot & g = graphs[GRAPH_SELECT];
    ggml_backend_sched_t sched = g.sched.get();
    ggml_backend_sched_reset(sched);
    g.res->reset();
    ggml_cgraph * gf = g.res->get_gf();
    std::vector<std::pair<ggml_tensor *, size_t>> outs; // each output and where its result goes in select_idx
    build(g.res->get_ctx(), outs);
    for (const auto & [top, off] : outs) {
        GGML_ASSERT(off + (size_t) ggml_nelements(top) <= select_idx_cap);
        ggml_build_forward_expand(gf, top);
    }
    const int64_t p1 = ggml_time_us();
    if (!ggml_backend_sched_alloc_graph(sched, gf)) {
        LLAMA_LOG_ERROR("%s: Locret: the selection graph failed\n", __func__);
        return false;
    }
    const int64_t p2 = ggml_time_us();
    if (ggml_backend_sched_graph_compute_async(sched, gf) != GGML_STATUS_SUCCESS) {
        LLAMA_LOG_ERROR("%s: Locret: the selection graph failed\n", __func__);
        return false;
    }
    // the one read-back of an eviction: the kept cells of every (layer, KV head), queued on the backend that computed
    // them (ordered after the graph, as llama.cpp reads its logits) and waited for once
    for (const auto & [top, off] : outs) {
        ggml_backend_tensor_get_async(ggml_backend_sched_get_tensor_backend(sched, top), top, select_idx + off, 0,
                ggml_nbytes(top));
    }
    wait_ubatch_end();
    const int64_t t0_us = ggml_time_us();
    ggml_backend_sched_synchronize(sched);
    t.n_host_syncs += 1;
    waited = true; // every backend of the context has run what was queued before
    t.readback_us += ggml_time_us() - t0_us;
    if (locret_profile()) {
        // (scripts/bench_eviction.py reads this line)
        fprintf(stderr, "locret-profile: select build %.2f alloc %.2f compute and read-back %.2f ms (splits %d, %zu outputs)\n",
                (p1 - p0) / 1e3, (p2 - p1) / 1e3, (ggml_time_us() - p2) / 1e3, ggml_backend_sched_get_n_splits(sched),
                outs.size());
    }
    return true;
}

bool locret_evictor::select_on_device(uint32_t strm, uint32_t cell0, uint32_t n_cand, uint32_t n_top) {
    return run_selection([&](ggml_context * ctx, std::vector<std::pair<ggml_tensor *, size_t>> & outs) {
        outs.emplace_back(locret_build_select(ctx, mem.scores.all(), strm, mem.cfg.n_cells, cell0, n_cand, n_top), 0);
    });
}

locret_policy_env locret_evictor::policy_env() {
    return { mem.cfg, mem.layers, mem.v_trans, mem.queries.tensors(), mem.queries.scales(),
        [this](const char * title, const std::string & what, const std::function<void(ggml_context *, ggml_cgraph *)> & build,
                const std::function<void()> & set_inputs) {
            return run_score_graph(title, what, build, set_inputs);
        } };
}

bool locret_evictor::run_score_graph(const char * policy_name, const std::string & what,
        const std::function<void(ggml_context *, ggml_cgraph *)> & build, const std::function<void()> & set_inputs) {
    const int64_t p0 = ggml_time_us();
    graph_slot & g = graphs[GRAPH_SCORE];
    ggml_backend_sched_t sched = g.sched.get();
    ggml_backend_sched_reset(sched);
    g.res->reset();
    ggml_cgraph * gf = g.res->get_gf();
    build(g.res->get_ctx(), gf);
    // queued, not waited for: it writes the score store, which the selection reads after it (the device's graph
    // queued behind it, or the host after the eviction's one wait)
    bool ok = ggml_backend_sched_alloc_graph(sched, gf);
    if (ok && set_inputs) {
        set_inputs();
    }
    if (!ok || ggml_backend_sched_graph_compute_async(sched, gf) != GGML_STATUS_SUCCESS) {
        locret_set_error(format("the %s scoring graph could not run; the cache is unchanged", policy_name));
        LLAMA_LOG_ERROR("%s: Locret: the %s scoring graph failed\n", __func__, policy_name);
        return false;
    }
    if (locret_profile()) {
        fprintf(stderr, "locret-profile: %s scores of %s %.2f ms (splits %d)\n", policy_name, what.c_str(),
                (ggml_time_us() - p0) / 1e3, ggml_backend_sched_get_n_splits(sched));
    }
    return true;
}

void locret_evictor::select_layer(size_t i, size_t row0, uint32_t n_used, uint32_t n_keep, uint32_t n_pin, uint32_t n_stab, bool from_idx, const float * block, const locret_cells & s, uint32_t * keep) const {
    const uint32_t n_head_kv = mem.layers[i].n_head_kv;
    const uint32_t n_top     = n_keep - n_pin - n_stab;
    std::vector<uint8_t>  mark;
    std::vector<float>    row;
    std::vector<uint32_t> kept;
    for (uint32_t h = 0; h < n_head_kv; ++h) {
        uint32_t * out = keep + (row0 + h) * n_keep;
        if (from_idx) {
            locret_keep_from_top(select_idx + (row0 + h) * n_top, n_top, n_used, n_pin, n_stab, out, mark);
            continue;
        }
        row.resize(n_used);
        if (block != nullptr) {
            for (uint32_t c = 0; c < n_used; ++c) {
                row[c] = block[(size_t) c * n_head_kv + h];
            }
        } else {
            mem.policy->score({ mem.layers[i].il, h, s.pos[i].data() + (size_t) h * mem.cfg.n_cells, row.data(), n_used, s.logical_next });
        }
        locret_select(row.data(), n_used, n_keep, n_pin, n_stab, kept);
        std::copy(kept.begin(), kept.end(), out);
    }
}

void locret_evictor::select_layer_masked(size_t i, size_t row0, const locret_layer_cut & c, uint32_t n_used,
        uint32_t n_keep, uint32_t n_pin, const float * block, const locret_cells & s, uint32_t * keep,
        const int32_t * top) const {
    // Algorithm 1 over the cells the layer reads, [0, m0) and [m0 + gap, n_used), as if they were consecutive: the
    // pinned ones first, its last stabilizers, the best of the rest
    const uint32_t n_head_kv = mem.layers[i].n_head_kv;
    // no choice by score: every unit stays, or only the pinned ones and the stabilizers (scores do not matter)
    const bool     no_choice = c.n_top == 0 || c.n_top == c.n_cand;
    std::vector<float>    row(n_used, 0.0f);
    std::vector<float>    held(c.n_held, 0.0f);
    std::vector<uint32_t> kept(c.n_live);
    std::vector<uint8_t>  mark;
    for (uint32_t h = 0; h < n_head_kv; ++h) {
        if (top != nullptr) {
            locret_keep_from_top(top + (size_t) h * c.n_top, c.n_top, c.n_held, n_pin, c.stab, kept.data(), mark);
        } else {
            if (!no_choice && block != nullptr) {
                for (uint32_t k = 0; k < n_used; ++k) {
                    row[k] = block[(size_t) k * n_head_kv + h];
                }
            } else if (!no_choice) {
                mem.policy->score({ mem.layers[i].il, h, s.pos[i].data() + (size_t) h * mem.cfg.n_cells, row.data(), n_used, s.logical_next });
            }
            for (uint32_t j = 0; j < c.n_held; ++j) {
                held[j] = row[j < c.m0 ? j : j + c.gap];
            }
            locret_select(held.data(), c.n_held, c.n_live, n_pin, c.stab, kept);
        }
        uint32_t * out = keep + (row0 + h) * n_keep;
        for (uint32_t k = 0; k < c.n_live; ++k) {
            out[k] = kept[k] < c.m0 ? kept[k] : kept[k] + c.gap;
        }
    }
}

bool locret_evictor::select_layers_on_device(uint32_t strm, std::vector<locret_layer_cut> & cuts) {
    size_t off = 0;
    for (size_t i = 0; i < mem.layers.size(); ++i) {
        locret_layer_cut & c = cuts[i];
        c.off = SIZE_MAX;
        if (c.on_device()) {
            c.off = off;
            off += (size_t) c.n_top * mem.layers[i].n_head_kv;
        }
    }
    if (off == 0) {
        return true; // no layer chooses by score: nothing to select, nothing read back
    }
    return run_selection([&](ggml_context * ctx, std::vector<std::pair<ggml_tensor *, size_t>> & outs) {
        for (size_t i = 0; i < mem.layers.size(); ++i) {
            const locret_layer_cut & c = cuts[i];
            if (c.off != SIZE_MAX) {
                outs.emplace_back(locret_build_select_runs(ctx, mem.scores.layer(i), strm, mem.cfg.n_cells, c.c0, c.n0,
                        c.c1, c.n1, c.n_top), c.off);
            }
        }
    });
}

int locret_evictor::evict(llama_context * lctx, const locret_ubatch_plan & plan) {
    if (moves.layer.size() != mem.layers.size()) {
        // the room for the moves is made when the context reserves its graphs
        locret_set_error("the Locret eviction graphs were not reserved; the cache is unchanged");
        return -1;
    }
    // the move tables hold one turn's sequences: more are evicted in turns, each selected, compacted and recorded
    // before the next (a batch of one token per sequence, generation on a busy server, can bring every stream at once).
    // Only the steps that evict count towards a turn, so that sequences evicting in the same ubatch share a compaction
    // however many others the ubatch holds.
    std::vector<locret_step> & evicting = steps_evicting;
    evicting.clear();
    for (const locret_step & st : plan.steps) {
        if (st.evict || st.reposition) {
            evicting.push_back(st);
        }
    }
    if (evicting.empty()) {
        return 0; // a ubatch that evicts nothing does not wait for the backend
    }
    int ret = 0;
    for (size_t first = 0; first < evicting.size(); first += turn_seq) {
        const int rc = evict_turn(lctx, evicting.data() + first, std::min<size_t>(turn_seq, evicting.size() - first));
        if (rc < 0) {
            if (first > 0) {
                locret_set_error(format("%s (the sequences of the eviction's %zu earlier turn(s) were evicted)",
                        llama_locret_last_error(), first / turn_seq));
            }
            return -1;
        }
        ret = std::max(ret, rc);
    }
    return ret;
}

void locret_evictor::mark_ubatch_end() {
    for (auto & [backend, ev] : ubatch_end_events) {
        ggml_backend_event_record(ev.get(), backend);
    }
    ubatch_end_marked = !ubatch_end_events.empty();
}

void locret_evictor::wait_ubatch_end() {
    if (!ubatch_end_marked) {
        return;
    }
    // the ubatch's own compute: timed apart, the eviction's timers leave it out
    const int64_t t0_us = ggml_time_us();
    for (auto & [backend, ev] : ubatch_end_events) {
        ggml_backend_event_synchronize(ev.get());
    }
    ubatch_end_marked = false;
    ubatch_wait_us += ggml_time_us() - t0_us;
}

void locret_evictor::wait_for_backend(llama_context * lctx) {
    if (waited) {
        return;
    }
    wait_ubatch_end();
    // (its time goes to the step that asked: the host's read of the scores, or the compaction)
    ggml_backend_sched_synchronize(lctx->get_sched());
    t.n_host_syncs += 1;
    waited = true;
}

void locret_evictor::read_scores(llama_context * lctx, uint32_t strm, uint32_t n_used,
        std::vector<const float *> & blocks) {
    size_t n_floats = 0;
    for (size_t i = 0; i < mem.layers.size(); ++i) {
        n_floats += (size_t) n_used * mem.layers[i].n_head_kv;
    }
    select_scores.resize(n_floats);
    const int64_t t0_us = ggml_time_us();
    // the blocks on a device are queued on the backend that holds them, after the ubatch that wrote them, and waited
    // for together; that wait (or the context's, when every block is in host memory) also covers the ones read in place
    ggml_backend_sched_t sched = any_sched();
    bool queued = false;
    size_t at = 0;
    for (size_t i = 0; i < mem.layers.size(); ++i) {
        const ggml_tensor * st_i = mem.scores.layer(i);
        if (ggml_backend_buffer_is_host(st_i->buffer)) {
            blocks[i] = (const float *) ((const char *) st_i->data + mem.scores.offset(i, strm));
            continue;
        }
        ggml_backend_t backend = locret_backend_holding(sched, st_i);
        GGML_ASSERT(backend != nullptr);
        const size_t n = (size_t) n_used * mem.layers[i].n_head_kv;
        ggml_backend_tensor_get_async(backend, st_i, select_scores.data() + at, mem.scores.offset(i, strm), n * sizeof(float));
        blocks[i] = select_scores.data() + at;
        at += n;
        queued = true;
    }
    const uint64_t ubatch_wait_before_us = ubatch_wait_us;
    if (queued) {
        wait_ubatch_end();
        ggml_backend_sched_synchronize(sched); // the same backends as the context's
        t.n_host_syncs += 1;
        waited = true;
    } else {
        wait_for_backend(lctx);
    }
    t.readback_us += (ggml_time_us() - t0_us) - (ubatch_wait_us - ubatch_wait_before_us);
}

// One turn of an eviction, in steps: for every step of the turn choose (the policy's scores, each layer's cut, the
// selection) and plan (each layer's keep lists, positions after the eviction and row moves, by the layout); then one
// compaction moves the rows of every sequence of the turn, and each sequence's bookkeeping is committed. Nothing
// changes before the compaction has run: a failure before it leaves the cache as it was.
int locret_evictor::evict_turn(llama_context * lctx, const locret_step * steps, size_t n_steps) {
    const int64_t t_start_us = ggml_time_us();
    const uint64_t readback_before_us = t.readback_us;
    waited = false;
    ubatch_wait_us = 0;
    mark_ubatch_end();

    turn_pending.clear();
    moves.clear();
    live_next.resize(std::max(live_next.size(), n_steps));
    turn_moved.assign(mem.layers.size(), 0);
    turn_rotated.assign(mem.layers.size(), 0);
    turn_kept = 0;
    turn_row0.assign(mem.layers.size() + 1, 0);
    for (size_t i = 0; i < mem.layers.size(); ++i) {
        turn_row0[i + 1] = turn_row0[i] + mem.layers[i].n_head_kv;
    }
    for (size_t k = 0; k < n_steps; ++k) {
        // kept positions: a part that would pass the position limit compacts positions, evicting or not; with a
        // budget schedule the smaller layers may evict while the largest keeps every unit (n_keep == n_used)
        if (!steps[k].evict && !steps[k].reposition) {
            continue;
        }
        turn_choice ch;
        if (!choose_step(lctx, steps[k], ch)) {
            return -1;
        }
        plan_step(lctx, steps[k], ch);
        if (locret_profile()) {
            const int64_t now = ggml_time_us();
            fprintf(stderr, "locret-profile: selected by %s, %.2f ms since the start (policy %.2f, choice %.2f, "
                    "keep lists and moves %.2f ms)\n", ch.on_device ? "device" : "host", (now - t_start_us) / 1e3,
                    (ch.t_prepared_us - t_start_us) / 1e3, (ch.t_chosen_us - ch.t_prepared_us) / 1e3,
                    (now - ch.t_chosen_us) / 1e3);
        }
    }
    if (turn_pending.empty()) {
        return 0;
    }
    const int64_t t_selected_us = ggml_time_us();
    // the device selection accounted for its own time; the host's (and the bookkeeping) is the rest
    t.select_us += (uint64_t) (t_selected_us - t_start_us) - (t.readback_us - readback_before_us) - ubatch_wait_us;
    const uint64_t ubatch_wait_selected_us = ubatch_wait_us;

    const locret_compact_status status = compact_turn(lctx, t_selected_us);
    if (status == LOCRET_COMPACT_NOT_RUN) {
        locret_set_error("the Locret compaction graph could not run; the cache is unchanged");
        return -1;
    }
    bool ok = status == LOCRET_COMPACT_OK;
    const int64_t t_queued_us = ggml_time_us();
    bool shifted = false;
    for (size_t p = 0; p < turn_pending.size() && ok; ++p) {
        ok = commit_step(lctx, p, shifted);
    }
    if (!ok) {
        abandon_turn();
        return -1;
    }
    if (locret_profile()) {
        fprintf(stderr, "locret-profile: bookkeeping after the compaction %.2f ms\n", (ggml_time_us() - t_queued_us) / 1e3);
    }
    t.compact_us += (ggml_time_us() - t_selected_us) - (ubatch_wait_us - ubatch_wait_selected_us);
    for (size_t i = 0; i < mem.layers.size(); ++i) {
        t.n_rows_moved   += turn_moved[i];
        t.n_rows_rotated += turn_rotated[i];
    }
    t.n_rows_kept += turn_kept;
    // the eviction graphs have their own scheduler: the context's last graph stays reusable, unless the window cache
    // was shifted (llama.cpp's K-shift runs on the context's scheduler)
    return shifted ? 1 : 0;
}

// Step 1, choose: the policy computes the scores it needs now and may protect more (sinks, units waiting for a score,
// a chosen set); a pinned query (Locret-Q) stays like the stabilizers; each layer's cut; the selection on the device,
// or the scores the host selects from read into ch.blocks. The step joins turn_pending.
bool locret_evictor::choose_step(llama_context * lctx, const locret_step & st, turn_choice & ch) {
    const locret_cells & s = mem.streams[st.strm];
    const bool evicts = st.evict;
    const locret_evict_args args = { st.strm, s.n_used, st.n_keep, s.pinned_cells(), st.n_stab };
    locret_protect prot;
    if (evicts && !mem.policy->prepare(policy_env(), args, mem.streams[st.strm].policy_state, prot)) {
        return false;
    }
    ch.t_prepared_us = ggml_time_us();
    ch.n_pin = prot.n_pin;
    // kept positions fill holes with the chunk's units, so that cells are in position order only from the chunk
    // on: the stabilizers are the chunk's last n_s units (all of a shorter chunk), as the paper words it
    ch.n_stab = mem.cfg.holes_filled() ? std::min(prot.n_stab, s.n_used - s.uniform_from) : prot.n_stab;
    if (ch.n_pin + ch.n_stab > st.n_keep) {
        // only a state loaded from elsewhere could bring this: the settings checks keep room for both
        locret_set_error(format("Locret: sequence %u keeps %u leading and %u trailing units, more than the %u it may "
                "keep; the cache is unchanged", st.strm, ch.n_pin, ch.n_stab, st.n_keep));
        return false;
    }
    const uint32_t n_cand = s.n_used - ch.n_stab - ch.n_pin;
    const uint32_t n_top  = st.n_keep - ch.n_stab - ch.n_pin;
    // where the scores are: the device selects, or the host reads the store (in place when it is host memory);
    // nothing chosen by score (SAGE-KV after its selection): no score is read
    ch.ends_only = n_top == 0 || !evicts;
    // a budget schedule selects per layer (its own count, around its masked cells): on the device for the layers
    // that choose by score, the others keep all they hold or only their ends, which needs no score
    ch.sched = mem.cfg.has_schedule();
    ch.on_device = evicts && !mem.scores.empty() && mem.select_graph && (ch.sched || (n_top > 0 && n_top < n_cand));
    cuts.resize(mem.layers.size());
    for (size_t i = 0; i < mem.layers.size(); ++i) {
        cuts[i] = locret_cut_layer(s.live_end[i], s.dead_end, s.n_used, mem.cfg.budget_of(i), st.n_keep, ch.n_pin, ch.n_stab);
    }
    const bool selected = !ch.on_device ||
        (ch.sched ? select_layers_on_device(st.strm, cuts) : select_on_device(st.strm, ch.n_pin, n_cand, n_top));
    if (!selected) {
        locret_set_error("the Locret selection graph could not run; the cache is unchanged");
        return false;
    }
    ch.blocks.assign(mem.layers.size(), nullptr);
    if (!ch.on_device && !ch.ends_only && !mem.scores.empty()) {
        read_scores(lctx, st.strm, s.n_used, ch.blocks);
    }
    ch.t_chosen_us = ggml_time_us();
    turn_pending.push_back({ args, prot, st.reposition, evicts });
    return true;
}

// Step 2, plan: the positions after the eviction (into pos_next, rope_pos_next and live_next at the step's index in
// turn_pending) and the row moves, every layer on the eviction's host threads
void locret_evictor::plan_step(llama_context * lctx, const locret_step & st, const turn_choice & ch) {
    const size_t p = turn_pending.size() - 1;
    const locret_cells & s = mem.streams[st.strm];
    if (pos_next.size() <= p) {
        pos_next.resize(p + 1);
        rope_pos_next.resize(p + 1);
    }
    pos_next[p].resize(mem.layers.size());
    rope_pos_next[p].resize(s.rope.size());
    keep_cells.resize(turn_row0.back() * st.n_keep);
    live_next[p].assign(mem.layers.size(), st.n_keep);
    if (moves.uploads_queued()) {
        // the last compaction's copies into the tables were queued, not waited for, and read these arrays when the
        // backend gets to them: nothing is written before a wait (a selection that read something has waited)
        wait_for_backend(lctx);
    }
    const size_t n_work = turn_row0.back() * (size_t) s.n_used;
    workers.parallel_for(mem.layers.size(), host_threads(lctx, n_work), [&](size_t i) {
        plan_layer(i, st, ch, p);
    });
    for (size_t i = 0; i < mem.layers.size(); ++i) {
        turn_kept += (uint64_t) mem.layers[i].n_head_kv * live_next[p][i];
    }
}

// the kept cells of layer i's KV heads, in cell order, into keep_cells (every unit the layer holds when the step only
// compacts positions)
void locret_evictor::keep_layer(size_t i, const locret_step & st, const turn_choice & ch) {
    const locret_cells & s = mem.streams[st.strm];
    const locret_layer_cut & cut = cuts[i];
    uint32_t * keep = keep_cells.data();
    if (!st.evict) {
        for (uint32_t h = 0; h < mem.layers[i].n_head_kv; ++h) {
            uint32_t * out = keep + (turn_row0[i] + h) * st.n_keep;
            uint32_t k = 0;
            for (uint32_t c = 0; c < s.n_used; ++c) {
                if (c < s.live_end[i] || c >= s.dead_end) {
                    out[k++] = c;
                }
            }
            GGML_ASSERT(k == cut.n_live);
        }
    } else if (cut.gap == 0 && cut.n_live == st.n_keep && !(ch.on_device && ch.sched)) {
        select_layer(i, turn_row0[i], s.n_used, st.n_keep, ch.n_pin, ch.n_stab, ch.on_device || ch.ends_only,
                ch.blocks[i], s, keep);
    } else {
        select_layer_masked(i, turn_row0[i], cut, s.n_used, st.n_keep, ch.n_pin, ch.blocks[i], s, keep,
                cut.off != SIZE_MAX ? select_idx + cut.off : nullptr);
    }
}

// layer i of pending step p: its kept cells, then the layout turns each KV head's into positions and row moves
void locret_evictor::plan_layer(size_t i, const locret_step & st, const turn_choice & ch, size_t p) {
    const locret_cells & s = mem.streams[st.strm];
    const locret_layer_cut & cut = cuts[i];
    const uint32_t n_live = cut.n_live; // its budget (a schedule's), at most the units it holds outside its masked cells
    live_next[p][i] = n_live;
    keep_layer(i, st, ch);
    const uint32_t n_head_kv = mem.layers[i].n_head_kv;
    auto & next  = pos_next[p][i];
    next.resize(s.pos[i].size());
    if (!s.rope.empty()) {
        rope_pos_next[p][i].resize(s.rope[i].size());
    }
    // the layer's moves are written through local pointers and counted once at the end: the layers' headers sit side
    // by side, and a count updated per move from several threads would share their cache lines
    auto & m = moves.layer[i];
    locret_moves::in_place_rows * rot = moves.in_place.empty() ? nullptr : &moves.in_place[i];
    GGML_ASSERT(m.n + (rot != nullptr ? rot->n : 0) + (size_t) n_head_kv * st.n_keep <= m.cap);
    locret_row_moves mv = { m.src + m.n, m.dst + m.n, m.delta + m.n, 0, (int64_t) st.strm * mem.cfg.n_cells, n_head_kv,
                            0, 0, 0 };
    if (m.kv_src != nullptr) {
        mv.kv_src  = m.kv_src + m.n;
        mv.kv_dst  = m.kv_dst + m.n;
        mv.kv_base = (int64_t) st.strm * mem.layers[i].kv_size;
        mv.live    = mem.grp.live_end(mem.layers[i].group, s);
        mv.gap     = s.dead_end - mv.live;
    }
    const locret_layout & layout = locret_layout_get(locret_layout_of(mem.cfg.keep_positions, mem.cfg.rotate_in_place,
                                                                      st.reposition));
    locret_layout_scratch scratch;
    for (uint32_t h = 0; h < n_head_kv; ++h) {
        // rows [0, live_end) moved with the last eviction sit at positions offset by the masked cells after them
        const locret_layout_head hd = {
            keep_cells.data() + (turn_row0[i] + h) * st.n_keep, n_live, s.pos_row(i, h),
            s.rope.empty() ? nullptr : s.rope_row(i, h), next.data() + (size_t) h * mem.cfg.n_cells,
            s.rope.empty() ? nullptr : rope_pos_next[p][i].data() + (size_t) h * mem.cfg.n_cells,
            s.live_end[i], (int32_t) cut.gap, (int32_t) (st.n_keep - n_live),
        };
        mv.h = h;
        layout.place(hd, scratch, mv, rot);
        std::fill(hd.pos_new + n_live, hd.pos_new + st.n_keep, -1); // masked in this layer until the next eviction
        if (hd.rope_new != nullptr) {
            std::fill(hd.rope_new + n_live, hd.rope_new + st.n_keep, -1);
        }
    }
    m.n += mv.n;
    turn_moved[i]   += mv.moved;
    turn_rotated[i] += mv.rotated;
}

// Step 3, compact: the turn's row moves of every sequence in one compaction graph (not waited for)
locret_compact_status locret_evictor::compact_turn(llama_context * lctx, int64_t t_selected_us) {
    moves.finish(); // the in-place rotations after the moves of every sequence of the turn
    moves.rotate = false;
    for (size_t i = 0; i < mem.layers.size(); ++i) {
        moves.rotate = moves.rotate || turn_rotated[i] > 0;
    }
    if (!moves.empty()) {
        // a turn that read nothing (scores computed on the host) waits here: the move tables and the compaction's
        // inputs are written now, and the last compaction, never waited for, may still read them
        wait_for_backend(lctx);
    }
    graph_slot & compact_slot = graphs[moves.rotate ? GRAPH_COMPACT_ROTATE : GRAPH_COMPACT_COPY];
    const locret_compact_status status = moves.empty() ? LOCRET_COMPACT_OK :
        locret_compact(compact_slot.sched.get(), compact_slot.res.get(), mem.kv, mem.v_trans, mem.layers, moves,
                mem.faults.take(LOCRET_FAULT_EVICT_ALLOC), mem.faults.take(LOCRET_FAULT_EVICT_COMPUTE));
    t.n_compactions += !moves.empty() && status != LOCRET_COMPACT_NOT_RUN;
    if (locret_profile() && status != LOCRET_COMPACT_NOT_RUN) {
        fprintf(stderr, "locret-profile: compaction of %zu rows %.2f ms\n", moves.count(),
                (ggml_time_us() - t_selected_us) / 1e3);
    }
    return status;
}

// Step 4, commit: pending step p's sequence takes its positions after the eviction, frees the cells past them, and the
// window cache (iSWA) follows the new RoPE frame; false when the window cache could not
bool locret_evictor::commit_step(llama_context * lctx, size_t p, bool & shifted) {
    const turn_step & ts = turn_pending[p];
    locret_cells & s = mem.streams[ts.args.strm];
    const uint32_t n_used = s.n_used;
    const uint32_t rope_before = s.rope_next;
    if (ts.args.n_keep < n_used) {
        // group 0 (every layer without groups): the cells past the kept ones, by position (free_cells)
        mem.kv->seq_rm((llama_seq_id) ts.args.strm, (llama_pos) ts.args.n_keep, -1);
    }
    // the next part's RoPE position: on from the last with kept positions, else after the kept units
    const bool restart_rope = !mem.cfg.keep_positions || ts.reposition;
    t.n_repositions += mem.cfg.keep_positions && ts.reposition;
    const uint64_t n_evicted = s.commit_eviction(ts.args.n_keep, live_next[p], pos_next[p], rope_pos_next[p],
                                                 restart_rope, ts.evicts);
    mem.grp.free_tails(ts.args.strm, s);
    mem.policy->compacted(mem.cfg, ts.args, ts.prot, s.policy_state);
    locret_cells_assert(s);
    t.n_evictions     += ts.evicts; // compacting kept positions alone evicts nothing
    t.n_units_evicted += n_evicted;
    shifted = shifted || (mem.kv_swa != nullptr && s.rope_next != rope_before);
    LLAMA_LOG_DEBUG("%s: Locret eviction %llu of sequence %u: %u -> %u units per head (%u stabilizers), logical position %d\n",
            __func__, (unsigned long long) s.n_evictions, ts.args.strm, n_used, ts.args.n_keep, ts.prot.n_stab,
            s.logical_next);
    if (!shift_window(lctx, ts.args.strm, (llama_pos) s.rope_next - (llama_pos) rope_before)) {
        LLAMA_LOG_ERROR("%s: Locret: the window cache could not follow the compaction\n", __func__);
        return false;
    }
    return true;
}

// the compaction failed part-way: the cache may be half moved, so the sequences of the turn are emptied (nothing
// inconsistent is ever read)
void locret_evictor::abandon_turn() {
    for (const auto & ts : turn_pending) {
        mem.drop_sequence((llama_seq_id) ts.args.strm);
    }
    locret_set_error("the Locret compaction failed part-way; the sequences it touched were emptied");
}
