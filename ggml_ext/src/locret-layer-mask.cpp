// Budget schedules in the model's graph. With layer groups (locret_layer_groups: one cache per distinct budget) each
// evicting layer attends through its group's cache: llama.cpp's own cell indices for that cache, and a mask read out of
// one input the groups share. A group's mask is the first group's shifted: its cells are the first group's with the
// cells between its live end and the dead end left out (every cell below the dead end holds a kept unit every new token
// sees, so only the cells from the dead end on, where the ubatch goes, differ, and they differ by the gap). One wide
// input holds the first group's mask extended by blocked cells; each run of consecutive layers of a group copies its
// window out of it (a copy ggml frees after the run), so the masks cost about two of llama.cpp's, not one per group.
// Without groups (one cache for every layer: an iSWA or ALiBi model, or LOCRET_DEBUG_ALLOC=masked) a layer below the
// largest budget has the cells it no longer reads (locret_cells::live_end .. dead_end) blocked, from one bias input
// shared by the layers of equal budget.

#include "locret-hooks.h"
#include "locret-memory.h"

#include "llama-batch.h"
#include "llama-graph.h"

#include "ggml.h"

#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

namespace {

// layer group g's attention input for a run of consecutive layers: llama.cpp's own cell indices for the group's cache
// (the group's first run makes them, later runs share its tensors) and the run's copy of the group's mask, which is a
// graph tensor, not an input. llama.cpp's can_reuse binds the context it is given (the Locret context, which is the
// first group's); this one takes its group's out of it.
class locret_group_attn_input : public llm_graph_input_attn_kv {
public:
    locret_group_attn_input(const llama_hparams & hparams, const llama_cparams & cparams,
                            const llama_kv_cache_context * gctx, size_t group, bool primary)
        : llm_graph_input_attn_kv(hparams, cparams, gctx), group(group), primary(primary) {}

    void set_input(const llama_ubatch * ubatch) override {
        if (!primary) {
            return; // the group's first run sets the indices it shares
        }
        mctx->set_input_k_idxs(self_k_idxs, ubatch);
        mctx->set_input_v_idxs(self_v_idxs, ubatch);
        if (self_k_rot && self_k_rot->buffer) {
            mctx->set_input_k_rot(self_k_rot);
        }
        if (self_v_rot && self_v_rot->buffer) {
            mctx->set_input_v_rot(self_v_rot);
        }
    }

    bool can_reuse(const llm_graph_params & params) override {
        const llama_kv_cache_context * g = locret_group_context(params.mctx, group);
        if (g == nullptr) {
            return false;
        }
        mctx = g;
        const int64_t n_stream = params.cparams.kv_unified ? 1 : params.ubatch.n_seqs_unq;
        return self_k_idxs->ne[0] == params.ubatch.n_tokens && self_kq_mask->ne[0] == (int64_t) g->get_n_kv() &&
               self_kq_mask->ne[1] == params.ubatch.n_tokens / n_stream && self_kq_mask->ne[3] == n_stream;
    }

    const size_t group;
    const bool   primary;
};

// where each group's mask sits in the wide input
struct locret_wide_layout {
    bool                 shared = true; // one stream: every group reads the first group's mask at its gap
    int64_t              width  = 0;
    std::vector<int64_t> off;           // per group (0 for the first group: llama.cpp's own mask)
    std::vector<int64_t> n_kv;          // per group: the cells its view of the cache holds

    bool operator==(const locret_wide_layout & o) const {
        return shared == o.shared && width == o.width && off == o.off && n_kv == o.n_kv;
    }
};

// the layout for the ubatch the Locret context is at: one stream, the first group's mask extended at its end with
// blocked cells, read by group g from its gap on; several streams (generation, a token each), each group's mask side
// by side (each stream's gap differs)
static bool locret_wide_layout_make(const llama_locret_memory * mem, const llama_memory_context_i * mctx,
        const llama_ubatch & ubatch, int64_t n_stream, locret_wide_layout & out) {
    const size_t n_groups = mem->groups().size();
    out = {};
    out.off.assign(n_groups, 0);
    out.n_kv.assign(n_groups, 0);
    for (size_t g = 0; g < n_groups; ++g) {
        const llama_kv_cache_context * c = locret_group_context(mctx, g);
        if (c == nullptr) {
            return false;
        }
        out.n_kv[g] = c->get_n_kv();
    }
    out.shared = n_stream == 1;
    if (out.shared) {
        const locret_cells * s = mem->get_stream(ubatch.n_tokens > 0 ? ubatch.seq_id[0][0] : 0);
        if (s == nullptr) {
            return false;
        }
        out.width = out.n_kv[0];
        for (size_t g = 1; g < n_groups; ++g) {
            out.off[g] = mem->groups().gap(g, *s);
            out.width  = std::max(out.width, out.off[g] + out.n_kv[g]);
        }
    } else {
        for (size_t g = 1; g < n_groups; ++g) {
            out.off[g] = out.width;
            out.width += out.n_kv[g];
        }
    }
    return true;
}

// every layer group's graph state, one per graph: the wide mask input, and the input of each group's latest run
class locret_groups_input : public llm_graph_input_i {
public:
    locret_groups_input(const llama_locret_memory * mem, ggml_tensor * mask0, ggml_tensor * wide, locret_wide_layout layout)
        : mem(mem), mask0(mask0), wide(wide), layout(std::move(layout)) {
        first.assign(mem->groups().size(), nullptr);
    }

    void set_input(const llama_ubatch * ubatch) override {
        // the first group's mask, set by llama.cpp's input before this one (the graph made it first), on the host
        GGML_ASSERT(ubatch != nullptr && mask0->buffer != nullptr && ggml_backend_buffer_is_host(mask0->buffer));
        GGML_ASSERT(mask0->type == wide->type && mask0->ne[1] == wide->ne[1] && mask0->ne[3] == wide->ne[3]);
        const size_t  es       = ggml_type_size(wide->type);
        const int64_t n_kv0    = mask0->ne[0];
        const int64_t n_rows   = wide->ne[1];
        const int64_t n_stream = wide->ne[3];
        const int64_t W        = wide->ne[0];
        const uint16_t blocked16 = ggml_fp32_to_fp16(-INFINITY);
        const float    blocked32 = -INFINITY;
        const void *   blocked   = wide->type == GGML_TYPE_F16 ? (const void *) &blocked16 : (const void *) &blocked32;
        data.resize(ggml_nbytes(wide));
        const char * src = (const char *) mask0->data;
        auto src_row = [&](int64_t k, int64_t t) { return src + k * mask0->nb[3] + t * mask0->nb[1]; };
        auto dst_row = [&](int64_t k, int64_t t) { return data.data() + (k * n_rows + t) * W * es; };
        auto block = [&](char * p, int64_t n) {
            for (int64_t x = 0; x < n; ++x) {
                std::memcpy(p + x * es, blocked, es);
            }
        };
        if (layout.shared) {
            for (int64_t t = 0; t < n_rows; ++t) {
                std::memcpy(dst_row(0, t), src_row(0, t), n_kv0 * es);
                block(dst_row(0, t) + n_kv0 * es, W - n_kv0);
            }
        } else {
            const int32_t n_tps = ubatch->n_tokens / (int32_t) n_stream;
            for (int64_t k = 0; k < n_stream; ++k) {
                const locret_cells * s = mem->get_stream(ubatch->seq_id[k * n_tps][0]);
                GGML_ASSERT(s != nullptr);
                for (size_t g = 1; g < layout.off.size(); ++g) {
                    const int64_t gap = mem->groups().gap(g, *s);
                    const int64_t n   = std::max<int64_t>(0, std::min(layout.n_kv[g], n_kv0 - gap));
                    for (int64_t t = 0; t < n_rows; ++t) {
                        char * d = dst_row(k, t) + layout.off[g] * es;
                        std::memcpy(d, src_row(k, t) + gap * es, n * es);
                        block(d + n * es, layout.n_kv[g] - n);
                    }
                }
            }
        }
        ggml_backend_tensor_set(wide, data.data(), 0, data.size());
    }

    bool can_reuse(const llm_graph_params & params) override {
        const int64_t n_stream = params.cparams.kv_unified ? 1 : params.ubatch.n_seqs_unq;
        locret_wide_layout now;
        return locret_wide_layout_make(mem, params.mctx, params.ubatch, n_stream, now) && now == layout &&
               wide->ne[1] == params.ubatch.n_tokens / n_stream && wide->ne[3] == n_stream;
    }

    const llama_locret_memory * mem;
    ggml_tensor *               mask0;  // the first group's mask (llama.cpp's input): [n_kv0, n_tps, 1, n_stream]
    ggml_tensor *               wide;   // [width, n_tps, 1, n_stream], mask0's type
    locret_wide_layout          layout;
    std::vector<locret_group_attn_input *> first; // per group: its first run's input (the indices' owner)
    locret_group_attn_input *   run = nullptr;    // the input of the run the last layer belonged to (NULL: group 0)
    std::vector<char>           data;
};

// one cache's bias: F32 [n_kv, n_budgets, 1, n_stream]: 0 where the layers of a budget read a cell, -INF where they
// do not
class locret_layer_mask_input : public llm_graph_input_i {
public:
    locret_layer_mask_input(const llama_locret_memory * mem, ggml_tensor * bias, std::vector<size_t> first_layer)
        : mem(mem), bias(bias), first_layer(std::move(first_layer)) {}

    void set_input(const llama_ubatch * ubatch) override {
        const int64_t n_kv      = bias->ne[0];
        const int64_t n_budgets = bias->ne[1];
        const int64_t n_stream  = bias->ne[3];
        GGML_ASSERT(ubatch != nullptr && ubatch->n_tokens % n_stream == 0);
        const int64_t n_tps = ubatch->n_tokens / n_stream;
        data.assign((size_t) ggml_nelements(bias), 0.0f);
        for (int64_t k = 0; k < n_stream; ++k) {
            // the ubatch's tokens come stream by stream; a sequence's stream is its id
            const uint32_t strm = (uint32_t) ubatch->seq_id[k * n_tps][0];
            for (int64_t b = 0; b < n_budgets; ++b) {
                uint32_t c0 = 0;
                uint32_t c1 = 0;
                mem->get_stream((llama_seq_id) strm)->masked_cells(first_layer[b], &c0, &c1);
                float * row = data.data() + (k * n_budgets + b) * n_kv;
                for (int64_t c = c0; c < std::min<int64_t>(c1, n_kv); ++c) {
                    row[c] = -INFINITY;
                }
            }
        }
        ggml_backend_tensor_set(bias, data.data(), 0, ggml_nbytes(bias));
    }

    bool can_reuse(const llm_graph_params & params) override {
        // the mask this bias is added to decides on n_kv; the streams must match here
        const int64_t n_stream = params.cparams.kv_unified ? 1 : params.ubatch.n_seqs_unq;
        return bias->ne[3] == n_stream;
    }

    const llama_locret_memory * mem;
    ggml_tensor *               bias;
    std::vector<size_t>         first_layer; // per budget: a layer of it (they all mask the same cells)
    std::vector<float>          data;
};

} // namespace

llm_graph_input_attn_kv * llama_locret_graph_attn_input(ggml_context * ctx, llm_graph_result * res,
        const llama_memory_context_i * mctx, const llama_ubatch & ubatch, llm_graph_input_attn_kv * inp, int il) {
    const llama_locret_memory * mem = locret_memory_of_context(mctx);
    if (mem == nullptr || mem->groups().size() == 1 || il < 0 || inp == nullptr) {
        return inp;
    }
    const int32_t i = mem->layer_index((uint32_t) il);
    if (i < 0) {
        return inp;
    }
    const size_t g = mem->get_layers()[i].group;
    auto * st = static_cast<locret_groups_input *>(res->t_locret_groups);
    if (g == 0) {
        if (st != nullptr) {
            st->run = nullptr; // the first group's layers read llama.cpp's own input
        }
        return inp;
    }
    const llama_cparams & cparams = inp->cparams;
    const int64_t n_stream = cparams.kv_unified ? 1 : ubatch.n_seqs_unq;
    if (st == nullptr) {
        // the wide mask: [width, n_tokens/n_stream, 1, n_stream] in the type of llama.cpp's mask (F16 for flash attention)
        locret_wide_layout layout;
        GGML_ASSERT(locret_wide_layout_make(mem, mctx, ubatch, n_stream, layout));
        ggml_tensor * mask0 = inp->self_kq_mask;
        ggml_tensor * wide  = ggml_new_tensor_4d(ctx, mask0->type, layout.width, mask0->ne[1], 1, mask0->ne[3]);
        ggml_set_input(wide);
        ggml_set_name(wide, "locret_groups_kq_mask");
        auto owned = std::make_unique<locret_groups_input>(mem, mask0, wide, std::move(layout));
        st = owned.get();
        res->t_locret_groups = res->add_input(std::move(owned));
    }
    if (st->run != nullptr && st->run->group == g) {
        return st->run; // the same run of layers: the same mask copy
    }
    const llama_kv_cache_context * gctx = locret_group_context(mctx, g);
    GGML_ASSERT(gctx != nullptr && "Locret: a layer group has no context for this ubatch");
    locret_group_attn_input * first = st->first[g];
    auto gi = std::make_unique<locret_group_attn_input>(inp->hparams, cparams, gctx, g, first == nullptr);
    if (first == nullptr) {
        gi->self_k_idxs = gctx->build_input_k_idxs(ctx, ubatch);
        gi->self_v_idxs = gctx->build_input_v_idxs(ctx, ubatch);
        gi->self_k_rot  = gctx->build_input_k_rot(ctx);
        gi->self_v_rot  = gctx->build_input_v_rot(ctx);
    } else {
        gi->self_k_idxs = first->self_k_idxs;
        gi->self_v_idxs = first->self_v_idxs;
        gi->self_k_rot  = first->self_k_rot;
        gi->self_v_rot  = first->self_v_rot;
    }
    // the group's window of the wide mask: [n_kv, n_tokens/n_stream, 1, n_stream], copied contiguous (attention
    // needs it so); a graph tensor, freed after the run's last layer
    ggml_tensor * wide = st->wide;
    const int64_t n_kv = st->layout.n_kv[g];
    ggml_tensor * view = ggml_view_4d(ctx, wide, n_kv, wide->ne[1], 1, wide->ne[3], wide->nb[1], wide->nb[2], wide->nb[3],
            st->layout.off[g] * ggml_element_size(wide));
    gi->self_kq_mask     = ggml_cont(ctx, view);
    gi->self_kq_mask_cnv = gi->self_kq_mask;
    ggml_format_name(gi->self_kq_mask, "locret_group_kq_mask-%zu", g);
    auto * added = static_cast<locret_group_attn_input *>(res->add_input(std::move(gi)));
    if (first == nullptr) {
        st->first[g] = added;
    }
    st->run = added;
    return added;
}

ggml_tensor * llama_locret_graph_layer_mask(ggml_context * ctx, llm_graph_result * res,
        const llama_memory_context_i * mctx, ggml_tensor * kq_mask, int il) {
    llama_locret_memory * mem = locret_memory_of_context(mctx);
    if (mem == nullptr || !mem->config().has_schedule() || mem->groups().size() > 1 || il < 0 || kq_mask == nullptr) {
        return kq_mask; // (a cache per budget: a layer's cache holds nothing it does not read)
    }
    const int32_t i = mem->layer_index((uint32_t) il);
    if (i < 0) {
        return kq_mask; // a window layer of an iSWA model: its own cache, its own mask
    }
    // the budgets below the largest, in the order of their first layer (layers of equal budget mask the same cells;
    // the largest masks none)
    const uint32_t top = mem->config().budget;
    if (mem->config().budget_of(i) == top) {
        return kq_mask;
    }
    std::vector<size_t>   first_layer;
    std::vector<uint32_t> budgets;
    size_t row = 0;
    for (size_t j = 0; j < mem->get_layers().size(); ++j) {
        if (mem->config().budget_of(j) == top) {
            continue;
        }
        size_t b = 0;
        while (b < budgets.size() && budgets[b] != mem->config().budget_of(j)) {
            ++b;
        }
        if (b == budgets.size()) {
            budgets.push_back(mem->config().budget_of(j));
            first_layer.push_back(j);
        }
        if (j == (size_t) i) {
            row = b;
        }
    }
    if (res->t_locret_mask_bias == nullptr) {
        // kq_mask: [n_kv, n_tokens/n_stream, 1, n_stream]
        ggml_tensor * bias = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, kq_mask->ne[0], (int64_t) budgets.size(), 1,
                kq_mask->ne[3]);
        ggml_set_input(bias);
        ggml_set_name(bias, "locret_layer_mask_bias");
        res->add_input(std::make_unique<locret_layer_mask_input>(mem, bias, first_layer));
        res->t_locret_mask_bias = bias;
        res->t_locret_layer_masks.assign(budgets.size(), nullptr);
    }
    ggml_tensor * bias = res->t_locret_mask_bias;
    GGML_ASSERT(row < res->t_locret_layer_masks.size());
    if (res->t_locret_layer_masks[row] == nullptr) {
        // the budget's row of every stream, broadcast over the tokens: [n_kv, 1, 1, n_stream]
        ggml_tensor * brow = ggml_view_4d(ctx, bias, bias->ne[0], 1, 1, bias->ne[3], bias->nb[1], bias->nb[2],
                bias->nb[3], row * bias->nb[1]);
        ggml_tensor * mask = ggml_add(ctx, kq_mask, brow); // the mask's type (F16 for flash attention)
        ggml_format_name(mask, "locret_layer_mask-%zu", row);
        res->t_locret_layer_masks[row] = mask;
    }
    return res->t_locret_layer_masks[row];
}
