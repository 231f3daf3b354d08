// LagKV scores in a ggml graph over the cache (locret-lagkv.h), from existing ops only so that every backend runs it.

#include "locret-lagkv.h"

#include "ggml.h"

namespace {

// one of K or V of a layer's cells [c0, c0 + n), as F32 in both layouts the scoring needs
struct lagkv_block {
    ggml_tensor * by_cell;    // F32 [d*H, n]: a cell's channels contiguous
    ggml_tensor * by_channel; // F32 [n, d*H]: a channel's cells contiguous
};

lagkv_block lagkv_read(ggml_context * ctx, ggml_tensor * storage, bool transposed, uint32_t kv_size, uint32_t strm,
        uint32_t c0, int64_t n) {
    const int64_t width = storage->ne[0]; // d*H
    const size_t  strm_offset = (size_t) strm * storage->nb[2];
    lagkv_block b;
    if (!transposed) {
        ggml_tensor * rows = ggml_view_2d(ctx, storage, width, n, storage->nb[1], strm_offset + (size_t) c0 * storage->nb[1]);
        b.by_cell    = ggml_cast(ctx, rows, GGML_TYPE_F32);
        b.by_channel = ggml_cont(ctx, ggml_transpose(ctx, b.by_cell));
    } else {
        // a transposed V holds each channel of a stream as a row of kv_size cells
        const size_t esize = ggml_type_size(storage->type);
        ggml_tensor * rows = ggml_view_2d(ctx, storage, n, width, esize * kv_size, strm_offset + (size_t) c0 * esize);
        b.by_channel = ggml_cast(ctx, rows, GGML_TYPE_F32);
        b.by_cell    = ggml_cont(ctx, ggml_transpose(ctx, b.by_channel));
    }
    return b;
}

// the partitions' per-channel extreme of the reference (next) partition, as [d, H, 1, n_part]; `stat` is
// [n_part + 1, d*H], one column per partition
ggml_tensor * lagkv_reference(ggml_context * ctx, ggml_tensor * stat, int64_t d, int64_t n_head, int64_t n_part) {
    ggml_tensor * next = ggml_view_2d(ctx, stat, n_part, stat->ne[1], stat->nb[1], stat->nb[0]); // columns 1..n_part
    return ggml_reshape_4d(ctx, ggml_cont(ctx, ggml_transpose(ctx, next)), d, n_head, 1, n_part);
}

// softmax over each partition of the channel-wise standard deviation of the normalized block: F32 [lag, H, n_part]
ggml_tensor * lagkv_component(ggml_context * ctx, const lagkv_block & b, int64_t d, int64_t n_head, int64_t lag,
        int64_t n_part) {
    // per channel, the maximum and minimum of every partition: [n_part + 1, d*H]
    ggml_tensor * hi = ggml_pool_1d(ctx, b.by_channel, GGML_OP_POOL_MAX, (int) lag, (int) lag, 0);
    ggml_tensor * lo = ggml_neg(ctx, ggml_pool_1d(ctx, ggml_neg(ctx, b.by_channel), GGML_OP_POOL_MAX, (int) lag, (int) lag, 0));
    ggml_tensor * ref_lo = lagkv_reference(ctx, lo, d, n_head, n_part);
    ggml_tensor * ref_hi = lagkv_reference(ctx, hi, d, n_head, n_part);
    ggml_tensor * range  = ggml_scale_bias(ctx, ggml_sub(ctx, ref_hi, ref_lo), 1.0f, LOCRET_LAGKV_EPS);

    // the scored partitions' units [d, H, lag, n_part], normalized by their reference (broadcast over the lag units)
    ggml_tensor * x = ggml_view_2d(ctx, b.by_cell, d * n_head, lag * n_part, b.by_cell->nb[1], 0);
    x = ggml_reshape_4d(ctx, x, d, n_head, lag, n_part);
    ggml_tensor * z = ggml_div(ctx, ggml_sub(ctx, x, ref_lo), range);

    // sample standard deviation over the head's channels: [1, H*lag*n_part]
    z = ggml_reshape_2d(ctx, z, d, n_head * lag * n_part);
    ggml_tensor * centred = ggml_sub(ctx, z, ggml_mean(ctx, z));
    ggml_tensor * sd = ggml_sqrt(ctx, ggml_scale(ctx, ggml_sum_rows(ctx, ggml_sqr(ctx, centred)), 1.0f / (float) (d - 1)));

    // [H, lag, n_part] -> [lag, H, n_part]: softmax over the units of each (head, partition)
    sd = ggml_reshape_3d(ctx, sd, n_head, lag, n_part);
    sd = ggml_cont(ctx, ggml_permute(ctx, sd, 1, 0, 2, 3));
    return ggml_soft_max(ctx, sd);
}

} // namespace

void locret_build_lagkv(ggml_context * ctx, ggml_cgraph * gf, const std::vector<locret_kv_layer> & layers, bool v_trans,
        uint32_t kv_size, uint32_t strm, uint32_t c0, uint32_t n_part, uint32_t lag) {
    const int64_t n = (int64_t) (n_part + 1) * lag; // the scored partitions and the last one's reference
    for (const locret_kv_layer & L : layers) {
        const int64_t H = L.n_head_kv;
        const lagkv_block k = lagkv_read(ctx, L.k, false, kv_size, strm, c0, n);
        const lagkv_block v = lagkv_read(ctx, L.v, v_trans, kv_size, strm, c0, n);
        ggml_tensor * s = ggml_add(ctx, lagkv_component(ctx, k, L.d_k, H, lag, n_part),
                                        lagkv_component(ctx, v, L.d_v, H, lag, n_part)); // [lag, H, n_part]
        // the store's layout: [H, cells]
        s = ggml_cont(ctx, ggml_permute(ctx, s, 1, 0, 2, 3));
        s = ggml_reshape_2d(ctx, s, H, (int64_t) lag * n_part);
        ggml_tensor * dst = ggml_view_2d(ctx, L.score, H, (int64_t) lag * n_part, L.score->nb[1],
                ((size_t) strm * kv_size + c0) * L.score->nb[1]);
        ggml_build_forward_expand(gf, ggml_cpy(ctx, s, dst));
    }
}

size_t locret_lagkv_n_nodes(size_t n_layers) {
    // per layer: about 30 nodes for each of K and V, 6 to combine and store, with room to spare
    return 96 * n_layers + 16;
}
