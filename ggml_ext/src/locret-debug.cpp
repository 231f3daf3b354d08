// Read-outs of an evicting context for users, tests, heatmaps and outside checks: statistics, the units each
// (layer, KV head) retains, the K/V cache itself, and fault injection.

#include "llama-locret-debug.h"
#include "locret-heads.h"
#include "locret-memory.h"
#include "locret-settings.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-kv-cache.h"

#include <cstdio>
#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

static const llama_locret_memory * locret_memory_of_ctx(const llama_context * ctx) {
    return locret_memory_of(llama_get_memory(ctx));
}

bool llama_locret_is_evicting(const llama_context * ctx) {
    return ctx != nullptr && locret_memory_of_ctx(ctx) != nullptr;
}

struct llama_locret_stats llama_locret_get_seq_stats(const struct llama_context * ctx, llama_seq_id seq_id) {
    llama_locret_stats st = {};
    const llama_locret_memory * mem = locret_memory_of_ctx(ctx);
    const locret_cells * s = mem ? mem->get_stream(seq_id) : nullptr;
    if (s == nullptr) {
        return st;
    }
    const locret_config & cfg = mem->config();
    st.enabled         = true;
    st.n_evictions     = s->n_evictions;
    st.n_units_evicted = s->n_units_evicted;
    st.n_cells_used    = s->n_used;
    st.n_cells         = cfg.n_cells;
    st.pos_logical     = s->logical_next;
    st.kv_bytes        = mem->kv_bytes();
    st.budget          = cfg.budget_mean; // a schedule's mean (its layers keep locret_layer_budget each)
    st.stabilizers     = cfg.stabilizers;
    st.local           = cfg.local;
    st.n_ubatch        = cfg.n_ubatch;
    st.policy          = cfg.policy;
    st.n_seq           = mem->n_streams();
    st.t_select_us     = mem->evictor().t.select_us;
    st.t_compact_us    = mem->evictor().t.compact_us;
    st.t_readback_us   = mem->evictor().t.readback_us;
    st.n_pinned        = s->n_pinned;
    st.pool            = locret_pool_of(*mem, seq_id); // pooling for long prompts: the sequence's decision
    st.pool_window     = cfg.pool;
    st.pool_from       = cfg.pool_from;
    {
        const std::string settings = locret_policy_settings_str(*locret_policy_find(cfg.policy), cfg.policy_values);
        snprintf(st.policy_settings, sizeof(st.policy_settings), "%s", settings.c_str());
    }
    st.n_compactions   = mem->evictor().t.n_compactions;
    st.n_rows_moved    = mem->evictor().t.n_rows_moved;
    st.n_rows_rotated  = mem->evictor().t.n_rows_rotated;
    st.n_rows_kept     = mem->evictor().t.n_rows_kept;
    st.n_host_syncs    = mem->evictor().t.n_host_syncs;
    st.positions       = cfg.keep_positions  ? LLAMA_LOCRET_POSITIONS_KEEP :
                         cfg.rotate_in_place ? LLAMA_LOCRET_POSITIONS_INPLACE : LLAMA_LOCRET_POSITIONS_COMPACT;
    st.position_limit  = cfg.keep_positions ? cfg.position_limit : 0;
    st.pos_rope_next   = s->rope_next;
    st.n_repositions   = mem->evictor().t.n_repositions;
    st.n_evictions_total     = mem->evictor().t.n_evictions;
    st.n_units_evicted_total = mem->evictor().t.n_units_evicted;
    return st;
}

struct llama_locret_stats llama_locret_get_stats(const struct llama_context * ctx) {
    return llama_locret_get_seq_stats(ctx, 0);
}

int32_t llama_locret_seq_room(const struct llama_context * ctx, llama_seq_id seq_id) {
    const llama_locret_memory * mem = locret_memory_of_ctx(ctx);
    const uint32_t room = mem != nullptr ? locret_generation_room(*mem, seq_id) : 0;
    return room > 0 ? (int32_t) room : -1;
}

int32_t llama_locret_retained_seq(const struct llama_context * ctx, llama_seq_id seq_id, int32_t il, int32_t ih,
        int32_t * logical_pos, int32_t n_max) {
    locret_set_error("");
    const llama_locret_memory * mem = locret_memory_of_ctx(ctx);
    if (mem == nullptr) {
        locret_set_error("llama_locret_retained: the context does not evict");
        return -1;
    }
    const locret_cells * s = mem->get_stream(seq_id);
    const int32_t i = il >= 0 ? mem->layer_index((uint32_t) il) : -1;
    if (s == nullptr || i < 0 || ih < 0 || (uint32_t) ih >= mem->get_layers()[i].n_head_kv) {
        locret_set_error(format("llama_locret_retained: no sequence %d / evicting layer %d / KV head %d", seq_id, il, ih));
        return -1;
    }
    // the units the layer holds: its cells in use, without the ones a budget schedule masks in it
    uint32_t m0 = 0;
    uint32_t m1 = 0;
    s->masked_cells((size_t) i, &m0, &m1);
    const uint32_t n_held = s->n_used - (m1 - m0);
    if (logical_pos != nullptr) {
        if (n_max < (int32_t) n_held) {
            locret_set_error(format("llama_locret_retained: %u units do not fit in %d", n_held, n_max));
            return -1;
        }
        const int32_t * pos = s->pos[i].data() + (size_t) ih * mem->config().n_cells;
        std::memcpy(logical_pos, pos, sizeof(int32_t) * m0);
        std::memcpy(logical_pos + m0, pos + m1, sizeof(int32_t) * (s->n_used - m1));
    }
    return (int32_t) n_held;
}

int32_t llama_locret_debug_rope_positions(const struct llama_context * ctx, llama_seq_id seq_id, int32_t il, int32_t ih,
        int32_t * rope_pos, int32_t n_max) {
    locret_set_error("");
    const int32_t n_held = llama_locret_retained_seq(ctx, seq_id, il, ih, nullptr, 0);
    if (n_held < 0) {
        return -1;
    }
    if (rope_pos == nullptr) {
        return n_held;
    }
    if (n_max < n_held) {
        locret_set_error(format("llama_locret_debug_rope_positions: %d units do not fit in %d", n_held, n_max));
        return -1;
    }
    const llama_locret_memory * mem = locret_memory_of_ctx(ctx);
    const locret_cells * s = mem->get_stream(seq_id);
    const int32_t i = mem->layer_index((uint32_t) il);
    uint32_t m0 = 0;
    uint32_t m1 = 0;
    s->masked_cells((size_t) i, &m0, &m1);
    int32_t n = 0;
    for (uint32_t c = 0; c < s->n_used; ++c) {
        if (c >= m0 && c < m1) {
            continue;
        }
        // kept positions: as recorded; compact: the cell, after the masked cells for the units before them
        rope_pos[n++] = !s->rope.empty() ? s->rope[i][(size_t) ih * mem->config().n_cells + c] :
                        (int32_t) (c < m0 ? c + (m1 - m0) : c);
    }
    return n;
}

int32_t llama_locret_layer_budget(const struct llama_context * ctx, int32_t il) {
    const llama_locret_memory * mem = locret_memory_of_ctx(ctx);
    const int32_t i = mem != nullptr && il >= 0 ? mem->layer_index((uint32_t) il) : -1;
    return i < 0 ? -1 : (int32_t) mem->config().budget_of((size_t) i);
}

int32_t llama_locret_layer_cells(const struct llama_context * ctx, int32_t il) {
    const llama_locret_memory * mem = locret_memory_of_ctx(ctx);
    const int32_t i = mem != nullptr && il >= 0 ? mem->layer_index((uint32_t) il) : -1;
    return i < 0 ? -1 : (int32_t) mem->get_layers()[(size_t) i].kv_size;
}

int32_t llama_locret_retained(const struct llama_context * ctx, int32_t il, int32_t ih, int32_t * logical_pos, int32_t n_max) {
    return llama_locret_retained_seq(ctx, 0, il, ih, logical_pos, n_max);
}

int32_t llama_locret_debug_read_kv_seq(struct llama_context * ctx, llama_seq_id seq_id, int32_t il, bool read_v,
        float * out, int32_t n_cells) {
    locret_set_error("");
    const llama_locret_memory * mem = locret_memory_of_ctx(ctx);
    if (mem == nullptr) {
        locret_set_error("llama_locret_debug_read_kv: the context does not evict");
        return -1;
    }
    const int32_t i = il >= 0 ? mem->layer_index((uint32_t) il) : -1;
    const int64_t kv_size = mem->config().n_cells;
    if (i < 0 || mem->get_stream(seq_id) == nullptr || n_cells < 0 || n_cells > kv_size) {
        locret_set_error(format("llama_locret_debug_read_kv: no evicting layer %d, no sequence %d or bad cell count %d",
                il, seq_id, n_cells));
        return -1;
    }
    llama_synchronize(ctx);
    const locret_kv_layer & L = mem->get_layers()[i];
    const locret_cells   & s = *mem->get_stream(seq_id);
    ggml_tensor * t = read_v ? L.v : L.k;
    const int64_t width = t->ne[0];
    // the layer's own cache (its group's): the bookkeeping's cell c at locret_group_caches::cell(); a cell it does not hold reads 0
    const int64_t own_size = L.kv_size;
    const size_t  stream_bytes = ggml_row_size(t->type, width * own_size);
    std::vector<uint8_t> raw(stream_bytes);
    ggml_backend_tensor_get(t, raw.data(), stream_bytes * seq_id, stream_bytes);
    const auto * traits = ggml_get_type_traits(t->type);
    auto to_float = [&](const void * src, float * dst, int64_t n) {
        if (t->type == GGML_TYPE_F32) {
            std::memcpy(dst, src, sizeof(float) * n);
        } else {
            traits->to_float(src, dst, n);
        }
    };
    if (read_v && mem->get_v_trans()) {
        // element (cell c, column r) lies at r*kv_size + c
        std::vector<float> row(own_size);
        for (int64_t r = 0; r < width; ++r) {
            to_float(raw.data() + ggml_row_size(t->type, own_size) * r, row.data(), own_size);
            for (int64_t c = 0; c < n_cells; ++c) {
                const int64_t o = mem->groups().cell(L.group, s, (uint32_t) c);
                out[c * width + r] = o >= 0 && o < own_size ? row[o] : 0.0f;
            }
        }
    } else {
        for (int64_t c = 0; c < n_cells; ++c) {
            const int64_t o = mem->groups().cell(L.group, s, (uint32_t) c);
            if (o >= 0 && o < own_size) {
                to_float(raw.data() + ggml_row_size(t->type, width) * o, out + c * width, width);
            } else {
                std::fill(out + c * width, out + (c + 1) * width, 0.0f);
            }
        }
    }
    return (int32_t) width;
}

int32_t llama_locret_debug_fill_masked(struct llama_context * ctx, llama_seq_id seq_id, float k_value, float v_value) {
    locret_set_error("");
    const llama_locret_memory * mem = locret_memory_of_ctx(ctx);
    if (mem == nullptr || mem->get_stream(seq_id) == nullptr) {
        locret_set_error(format("llama_locret_debug_fill_masked: the context does not evict, or has no sequence %d", seq_id));
        return -1;
    }
    llama_synchronize(ctx);
    int32_t n_written = 0;
    const locret_cells & s = *mem->get_stream(seq_id);
    for (size_t i = 0; i < mem->get_layers().size(); ++i) {
        // in the layer's own cache (its group's): the cells a schedule masks in it, and the cells past those in use
        uint32_t m0 = 0;
        uint32_t m1 = 0;
        const locret_kv_layer & L = mem->get_layers()[i];
        mem->groups().masked_cells(L.group, i, s, &m0, &m1);
        const int64_t kv_size = L.kv_size;
        const int64_t n_own   = (int64_t) s.n_used - mem->groups().gap(L.group, s);
        auto unread = [&](int64_t c) { return (c >= m0 && c < m1) || c >= n_own; };
        for (int pass = 0; pass < 2; ++pass) {
            ggml_tensor * t = pass == 0 ? L.k : L.v;
            if (t->type != GGML_TYPE_F16 && t->type != GGML_TYPE_F32) {
                locret_set_error("llama_locret_debug_fill_masked: only an F16 or F32 cache can be filled");
                return -1;
            }
            const float value = pass == 0 ? k_value : v_value;
            const int64_t width = t->ne[0];
            const size_t  esize = ggml_type_size(t->type);
            const size_t  stream_bytes = esize * width * kv_size;
            std::vector<uint8_t> raw(stream_bytes);
            ggml_backend_tensor_get(t, raw.data(), stream_bytes * seq_id, stream_bytes);
            const ggml_fp16_t h = ggml_fp32_to_fp16(value);
            auto put = [&](size_t elem) {
                if (t->type == GGML_TYPE_F32) {
                    std::memcpy(raw.data() + elem * esize, &value, esize);
                } else {
                    std::memcpy(raw.data() + elem * esize, &h, esize);
                }
            };
            const bool transposed = pass == 1 && mem->get_v_trans(); // element (cell c, column r) at r*kv_size + c
            for (int64_t c = 0; c < kv_size; ++c) {
                for (int64_t r = 0; r < width && unread(c); ++r) {
                    put(transposed ? (size_t) r * kv_size + c : (size_t) c * width + r);
                }
            }
            ggml_backend_tensor_set(t, raw.data(), stream_bytes * seq_id, stream_bytes);
        }
        for (int64_t c = 0; c < kv_size; ++c) {
            n_written += unread(c) ? 1 : 0;
        }
    }
    return n_written;
}

int32_t llama_locret_debug_read_scores(struct llama_context * ctx, llama_seq_id seq_id, int32_t il, float * out,
        int32_t n_cells) {
    locret_set_error("");
    const llama_locret_memory * mem = locret_memory_of_ctx(ctx);
    if (mem == nullptr || !mem->get_policy().stores_scores()) {
        locret_set_error("llama_locret_debug_read_scores: the context does not evict by stored scores (heads or lagkv)");
        return -1;
    }
    const int32_t i = il >= 0 ? mem->layer_index((uint32_t) il) : -1;
    if (i < 0 || mem->get_stream(seq_id) == nullptr || n_cells < 0 || n_cells > (int32_t) mem->config().n_cells) {
        locret_set_error(format("llama_locret_debug_read_scores: no evicting layer %d, no sequence %d or bad cell count %d",
                il, seq_id, n_cells));
        return -1;
    }
    llama_synchronize(ctx);
    const ggml_tensor * store = mem->score_store().layer(i);
    ggml_backend_tensor_get(store, out, (size_t) seq_id * mem->config().n_cells * store->nb[1],
            sizeof(float) * (size_t) n_cells * mem->get_layers()[i].n_head_kv);
    return (int32_t) mem->get_layers()[i].n_head_kv;
}

int32_t llama_locret_debug_read_query(struct llama_context * ctx, llama_seq_id seq_id, int32_t il, float * out,
        int32_t n_max, float * kq_scale) {
    locret_set_error("");
    const llama_locret_memory * mem = locret_memory_of_ctx(ctx);
    if (mem == nullptr || mem->query_store().rows() == 0) {
        locret_set_error("llama_locret_debug_read_query: the context does not evict with a policy that captures queries");
        return -1;
    }
    const int32_t i = il >= 0 ? mem->layer_index((uint32_t) il) : -1;
    if (i < 0 || mem->get_stream(seq_id) == nullptr) {
        locret_set_error(format("llama_locret_debug_read_query: no evicting layer %d or no sequence %d", il, seq_id));
        return -1;
    }
    llama_synchronize(ctx);
    const ggml_tensor * store = mem->query_store().layer(i);
    const int32_t width = (int32_t) (store->ne[0] * mem->query_store().rows()); // the sequence's rows, the newest last
    if (out != nullptr && n_max >= width) {
        ggml_backend_tensor_get(store, out, (size_t) seq_id * mem->query_store().block_bytes(store), sizeof(float) * width);
    }
    if (kq_scale != nullptr) {
        *kq_scale = mem->query_store().get_scale(i);
    }
    return width;
}

int32_t llama_locret_debug_read_kv(struct llama_context * ctx, int32_t il, bool read_v, float * out, int32_t n_cells) {
    return llama_locret_debug_read_kv_seq(ctx, 0, il, read_v, out, n_cells);
}

int32_t llama_locret_debug_window(const struct llama_context * ctx, llama_seq_id seq_id, int32_t * logical_pos,
        llama_token * tokens, int32_t n_max) {
    locret_set_error("");
    const llama_locret_memory * mem = locret_memory_of_ctx(ctx);
    const locret_cells * s = mem ? mem->get_stream(seq_id) : nullptr;
    if (s == nullptr || mem->get_kv_swa() == nullptr) {
        locret_set_error("llama_locret_debug_window: the context does not evict an iSWA model, or has no such sequence");
        return -1;
    }
    // the window cache's cells hold physical positions; the uniform part of the global cache gives the offset to the
    // client's positions (the window cache follows every compaction, so the same offset holds for all its cells)
    const llama_pos offset = s->logical_next - (llama_pos) s->rope_next;
    const llama_kv_cells & cells = mem->get_kv_swa()->get_cells(seq_id);
    int32_t n = 0;
    for (uint32_t c = 0; c < cells.size(); ++c) {
        if (cells.is_empty(c) || !cells.seq_has(c, seq_id)) {
            continue;
        }
        if (n < n_max) {
            if (logical_pos != nullptr) {
                logical_pos[n] = cells.pos_get(c) + offset;
            }
            if (tokens != nullptr) {
                tokens[n] = cells.ext_get(c).tok;
            }
        }
        ++n;
    }
    return n;
}

void llama_locret_debug_compute_buffers(struct llama_context * ctx, size_t * ctx_bytes, size_t * evict_bytes) {
    ggml_backend_sched_t sched = ctx->get_sched();
    size_t n = 0;
    for (int i = 0; i < ggml_backend_sched_get_n_backends(sched); ++i) {
        n += ggml_backend_sched_get_buffer_size(sched, ggml_backend_sched_get_backend(sched, i));
    }
    const llama_locret_memory * mem = locret_memory_of_ctx(ctx);
    if (ctx_bytes != nullptr) {
        *ctx_bytes = n;
    }
    if (evict_bytes != nullptr) {
        *evict_bytes = mem != nullptr ? mem->evictor().buffer_size() : 0;
    }
}

struct llama_locret_buffers llama_locret_debug_buffers(const struct llama_context * ctx) {
    llama_locret_buffers b = {};
    const llama_locret_memory * mem = ctx != nullptr ? locret_memory_of_ctx(ctx) : nullptr;
    if (mem != nullptr) {
        b.evict_compute = mem->evictor().buffer_size();
        b.move_tables   = mem->evictor().move_tables_size();
        b.score_store   = mem->score_store().bytes();
        b.compact_seq   = mem->evictor().compact_seq();
        b.query_store   = mem->query_store().bytes();
    }
    return b;
}

int32_t llama_locret_debug_compute_buffer(struct llama_context * ctx, int32_t i, char * name, size_t name_size,
        size_t * bytes) {
    // llama.cpp's own breakdown: the scheduler's buffers, or their expected sizes when the model was loaded with
    // no_alloc (a memory plan), the buffer types llama.cpp's creation log lists
    std::vector<std::pair<const char *, size_t>> compute;
    for (const auto & [buft, data] : ctx->memory_breakdown()) {
        if (data.compute > 1) {
            compute.emplace_back(ggml_backend_buft_name(buft), data.compute);
        }
    }
    if (i < 0 || i >= (int32_t) compute.size()) {
        return i == 0 && compute.empty() ? 0 : -1;
    }
    if (name != nullptr && name_size > 0) {
        snprintf(name, name_size, "%s", compute[i].first);
    }
    if (bytes != nullptr) {
        *bytes = compute[i].second;
    }
    return (int32_t) compute.size();
}

int32_t llama_locret_debug_inject_fault(struct llama_context * ctx, enum llama_locret_fault fault) {
    locret_set_error("");
    llama_locret_memory * mem = locret_memory_of(llama_get_memory(ctx));
    if (mem == nullptr) {
        locret_set_error("llama_locret_debug_inject_fault: the context does not evict");
        return -1;
    }
    if (fault < LLAMA_LOCRET_FAULT_NONE || fault > LLAMA_LOCRET_FAULT_STATE_READ) {
        locret_set_error(format("llama_locret_debug_inject_fault: unknown fault %d", (int) fault));
        return -1;
    }
    mem->faults.inject((locret_fault) fault);
    return 0;
}
