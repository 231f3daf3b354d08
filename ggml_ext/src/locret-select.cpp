// Top-b selection: on the host an O(n) partition per row, then the kept cells sorted back into cell order; on the
// device a graph of existing ops over every row at once (see locret-select.h), whose result the host puts in cell order.

#include "locret-select.h"

#include "ggml.h"

#include <algorithm>
#include <cmath>

void locret_select(const float * score, uint32_t n_used, uint32_t n_keep, uint32_t n_pin, uint32_t n_stab,
        std::vector<uint32_t> & keep) {
    GGML_ASSERT(n_pin + n_stab <= n_keep && n_keep <= n_used);
    const uint32_t n_cand = n_used - n_stab;      // candidates are cells [n_pin, n_cand)
    const uint32_t n_top  = n_keep - n_stab - n_pin;
    keep.resize(n_cand - n_pin);
    for (uint32_t c = n_pin; c < n_cand; ++c) {
        keep[c - n_pin] = c;
    }
    auto better = [score](uint32_t a, uint32_t b) {
        const float sa = std::isnan(score[a]) ? -INFINITY : score[a];
        const float sb = std::isnan(score[b]) ? -INFINITY : score[b];
        return sa > sb || (sa == sb && a < b);
    };
    if (n_top < n_cand - n_pin) {
        std::nth_element(keep.begin(), keep.begin() + n_top, keep.end(), better);
        keep.resize(n_top);
    }
    std::sort(keep.begin(), keep.end());
    keep.insert(keep.begin(), n_pin, 0);
    for (uint32_t c = 0; c < n_pin; ++c) {
        keep[c] = c;
    }
    for (uint32_t c = n_cand; c < n_used; ++c) {
        keep.push_back(c);
    }
}

// the n_top largest of each row of s (F32 [n_cand, n_rows]), ties to the earlier column: I32 [n_top, n_rows]
static ggml_tensor * locret_build_top(ggml_context * ctx, ggml_tensor * s, uint32_t n_top) {
    const int64_t n_cand = s->ne[0];
    const int64_t n_rows = s->ne[1];
    GGML_ASSERT(n_top > 0 && n_top < n_cand && n_cand < (1 << 24));

    // t: [1, n_rows], each row's n_top-th largest score
    ggml_tensor * order = ggml_argsort(ctx, s, GGML_SORT_ORDER_DESC); // I32 [n_cand, n_rows]
    ggml_tensor * nth   = ggml_cont(ctx, ggml_view_2d(ctx, order, 1, n_rows, order->nb[1], (size_t) (n_top - 1) * order->nb[0]));
    ggml_tensor * t     = ggml_get_rows(ctx, ggml_reshape_3d(ctx, s, 1, n_cand, n_rows), nth); // [1, 1, n_rows]
    t = ggml_reshape_2d(ctx, t, 1, n_rows);

    // key: [n_cand, n_rows]
    ggml_tensor * d     = ggml_sub(ctx, s, t);
    ggml_tensor * above = ggml_step(ctx, d);                    // 1 where score > t
    ggml_tensor * below = ggml_step(ctx, ggml_neg(ctx, d));     // 1 where score < t
    ggml_tensor * equal = ggml_scale_bias(ctx, ggml_add(ctx, above, below), -1.0f, 1.0f);
    ggml_tensor * later = ggml_scale_bias(ctx, ggml_arange(ctx, 0.0f, (float) n_cand, 1.0f), -1.0f, 16777216.0f); // 2^24 - cell
    ggml_tensor * key   = ggml_add(ctx, ggml_scale(ctx, above, 33554432.0f), ggml_mul(ctx, equal, later));

    ggml_tensor * top = ggml_top_k(ctx, key, n_top); // I32 [n_top, n_rows]
    ggml_set_output(top);
    return top;
}

ggml_tensor * locret_build_select(ggml_context * ctx, ggml_tensor * scores, uint32_t strm, uint32_t n_cells,
        uint32_t cell0, uint32_t n_cand, uint32_t n_top) {
    const int64_t n_head_kv = scores->ne[0];
    const int64_t n_layers  = scores->ne[2];
    const int64_t n_rows    = n_head_kv * n_layers;

    // s: [n_cand, n_rows], one row of candidate scores per (layer, KV head)
    ggml_tensor * s = ggml_view_3d(ctx, scores, n_head_kv, n_cand, n_layers, scores->nb[1], scores->nb[2],
            ((size_t) strm * n_cells + cell0) * scores->nb[1]);
    s = ggml_cont(ctx, ggml_permute(ctx, s, 1, 0, 2, 3));
    s = ggml_reshape_2d(ctx, s, n_cand, n_rows);

    ggml_tensor * top = locret_build_top(ctx, s, n_top);
    ggml_set_name(top, "locret_keep");
    return top;
}

ggml_tensor * locret_build_select_runs(ggml_context * ctx, ggml_tensor * scores, uint32_t strm, uint32_t n_cells,
        uint32_t c0, uint32_t n0, uint32_t c1, uint32_t n1, uint32_t n_top) {
    const int64_t n_head_kv = scores->ne[0];
    GGML_ASSERT(n0 > 0);
    // s: [n_head_kv, n0 + n1], the two runs side by side (each a contiguous block of rows of the store)
    const size_t base = (size_t) strm * n_cells;
    ggml_tensor * s = ggml_view_2d(ctx, scores, n_head_kv, n0, scores->nb[1], (base + c0) * scores->nb[1]);
    if (n1 > 0) {
        s = ggml_concat(ctx, s, ggml_view_2d(ctx, scores, n_head_kv, n1, scores->nb[1], (base + c1) * scores->nb[1]), 1);
    }
    s = ggml_cont(ctx, ggml_transpose(ctx, s)); // [n0 + n1, n_head_kv]

    ggml_tensor * top = locret_build_top(ctx, s, n_top);
    ggml_set_name(top, "locret_keep_layer");
    return top;
}

void locret_keep_from_top(const int32_t * top, uint32_t n_top, uint32_t n_used, uint32_t n_pin, uint32_t n_stab,
        uint32_t * keep, std::vector<uint8_t> & kept) {
    const uint32_t n_cand = n_used - n_stab - n_pin; // the device chose among cells [n_pin, n_pin + n_cand)
    kept.assign(n_cand, 0);
    for (uint32_t k = 0; k < n_top; ++k) {
        GGML_ASSERT(top[k] >= 0 && (uint32_t) top[k] < n_cand);
        kept[top[k]] = 1;
    }
    uint32_t n = 0;
    for (uint32_t c = 0; c < n_pin; ++c) {
        keep[n++] = c;
    }
    for (uint32_t c = 0; c < n_cand; ++c) {
        if (kept[c]) {
            keep[n++] = n_pin + c;
        }
    }
    GGML_ASSERT(n == n_pin + n_top && "Locret: the device selection returned a cell twice");
    for (uint32_t c = n_used - n_stab; c < n_used; ++c) {
        keep[n++] = c;
    }
}

locret_layer_cut locret_cut_layer(uint32_t live_end, uint32_t dead_end, uint32_t n_used, uint32_t layer_budget,
        uint32_t n_keep, uint32_t n_pin, uint32_t n_stab) {
    locret_layer_cut c;
    c.m0     = std::min(live_end, dead_end);
    c.gap    = dead_end - c.m0;
    c.n_held = n_used - c.gap;
    c.n_live = std::min({ n_keep, layer_budget, c.n_held });
    c.stab   = std::min(n_stab, c.n_held - n_pin);
    c.n_cand = c.n_held - n_pin - c.stab;
    c.n_top  = c.n_live - n_pin - c.stab;
    // the candidates, held [n_pin, n_pin + n_cand), in cells: those below m0 stay, the others sit gap cells further
    const uint32_t end = n_pin + c.n_cand;
    const uint32_t cut = c.gap == 0 ? end : std::max(n_pin, std::min(c.m0, end));
    c.c0 = n_pin;
    c.n0 = cut - n_pin;
    c.c1 = cut + c.gap;
    c.n1 = end - cut;
    if (c.n0 == 0) {
        c.c0 = c.c1;
        c.n0 = c.n1;
        c.n1 = 0;
    }
    return c;
}
