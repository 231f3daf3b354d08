// SAGE-KV's eviction-time scores in a ggml graph (locret-sage.h), from existing ops only so that every backend runs
// them. The query capture in the model's graph is a graph hook (locret-graph.cpp).

#include "locret-sage.h"

#include "ggml.h"

#include <vector>

void locret_build_sage(ggml_context * ctx, ggml_cgraph * gf, const std::vector<locret_kv_layer> & layers,
        const std::vector<ggml_tensor *> & queries, const std::vector<float> & kq_scale, uint32_t kv_size,
        uint32_t strm, uint32_t n) {
    for (size_t i = 0; i < layers.size(); ++i) {
        const locret_kv_layer & L = layers[i];
        const int64_t d  = L.d_k;
        const int64_t H  = L.n_head_kv;
        const int64_t nq = queries[i]->ne[0] / d; // query heads
        const int64_t G  = nq / H;                // query heads per KV head; head h reads KV head h / G

        // the cached keys as they are stored (after RoPE, any type mul_mat reads): [d, n, H]
        ggml_tensor * k = ggml_view_3d(ctx, L.k, d, H, n, ggml_row_size(L.k->type, d), L.k->nb[1],
                (size_t) strm * L.k->nb[2]);
        k = ggml_permute(ctx, k, 0, 2, 1, 3);
        // the sequence's captured query: [d, 1, nq]
        ggml_tensor * q = ggml_view_1d(ctx, queries[i], queries[i]->ne[0], (size_t) strm * queries[i]->nb[1]);
        q = ggml_reshape_3d(ctx, ggml_cont(ctx, q), d, 1, nq);

        // each query head's attention over the units: [n, 1, nq]
        ggml_tensor * p = ggml_soft_max_ext(ctx, ggml_mul_mat(ctx, k, q), nullptr, kq_scale[i], 0.0f);

        // the largest over each KV head's group of query heads: [n, H]
        if (G > 1) {
            p = ggml_cont(ctx, ggml_permute(ctx, ggml_reshape_3d(ctx, p, n, G, H), 1, 0, 2, 3)); // [G, n, H]
            p = ggml_pool_1d(ctx, ggml_reshape_2d(ctx, p, G, n * H), GGML_OP_POOL_MAX, (int) G, (int) G, 0);
        }
        p = ggml_reshape_2d(ctx, p, n, H);

        // the store's layout: [H, cells]
        ggml_tensor * s = ggml_cont(ctx, ggml_transpose(ctx, p));
        ggml_tensor * dst = ggml_view_2d(ctx, L.score, H, n, L.score->nb[1], (size_t) strm * kv_size * L.score->nb[1]);
        ggml_build_forward_expand(gf, ggml_cpy(ctx, s, dst));
    }
}

size_t locret_sage_n_nodes(size_t n_layers) {
    // per layer: about 16 nodes (views, mul_mat, softmax, pooling, transposes, store), with room to spare
    return 32 * n_layers + 16;
}
