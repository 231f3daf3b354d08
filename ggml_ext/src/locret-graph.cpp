// Causal importance scores (CIS) in llama.cpp's graph, from existing ggml ops only, so that every
// backend (CPU, CUDA on the RTX 4090 and Jetson Orin) runs the same graph.

#include "locret-heads.h"
#include "locret-hooks.h"

#include "llama-graph.h"
#include "llama-impl.h"

// [d, n_heads, n_tokens] or [d*n_heads, n_tokens] -> [d*n_heads, n_tokens], without a copy when
// each token's heads are packed (true for separate and fused QKV projections alike). n_tokens is
// passed in because a single-token ubatch makes the two layouts indistinguishable by shape.
static ggml_tensor * locret_flatten_heads(ggml_context * ctx, ggml_tensor * t, int64_t n_tokens) {
    const int64_t width = ggml_nelements(t) / n_tokens;
    if (ggml_is_contiguous(t)) {
        return ggml_reshape_2d(ctx, t, width, n_tokens);
    }
    const bool is_3d  = t->ne[2] == n_tokens && t->ne[3] == 1;
    const bool packed = is_3d ? t->nb[1] == ggml_row_size(t->type, t->ne[0])
                              : t->ne[1] == n_tokens && t->ne[2] == 1 && t->ne[3] == 1;
    if (packed) {
        return ggml_view_2d(ctx, t, width, n_tokens, is_3d ? t->nb[2] : t->nb[1], 0);
    }
    return ggml_reshape_2d(ctx, ggml_cont(ctx, t), width, n_tokens);
}

static ggml_tensor * locret_build_cis(ggml_context * ctx, const llama_locret_heads & heads, int il,
        ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, int64_t n_tokens) {
    const locret_head_layer & layer = heads.layers.at(il);

    // h: [d_R, n_tokens] = fc1 · concat(Q, K, V) + fc1_b, as three matmuls over the projections
    // themselves (fc1 is stored split by input column), so no copy of Q, K, V is made
    ggml_tensor * h = ggml_mul_mat(ctx, layer.fc1_q, locret_flatten_heads(ctx, q, n_tokens));
    h = ggml_add(ctx, h, ggml_mul_mat(ctx, layer.fc1_k, locret_flatten_heads(ctx, k, n_tokens)));
    h = ggml_add(ctx, h, ggml_mul_mat(ctx, layer.fc1_v, locret_flatten_heads(ctx, v, n_tokens)));
    if (layer.fc1_b) {
        h = ggml_add(ctx, h, layer.fc1_b);
    }
    switch (heads.activation) {
        case LOCRET_ACT_SILU: h = ggml_silu(ctx, h); break;
        case LOCRET_ACT_GELU: h = ggml_gelu(ctx, h); break;
        case LOCRET_ACT_RELU: h = ggml_relu(ctx, h); break;
    }

    // s: [n_head_kv, n_tokens], one score per token and KV head
    ggml_tensor * s = ggml_mul_mat(ctx, layer.fc2_w, h);
    if (layer.fc2_b) {
        s = ggml_add(ctx, s, layer.fc2_b);
    }
    return s;
}

uint32_t llama_locret_graph_n_nodes(uint32_t n_layer) {
    // per layer: up to 6 flattening nodes (view, or cont + reshape), 4 mul_mat, 4 add and the
    // activation, with room to spare
    return 24 * n_layer;
}

void llama_locret_graph_add_cis(ggml_context * ctx, ggml_cgraph * gf, llm_graph_result * res,
        const llama_locret_heads * heads, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, int64_t n_tokens, int il) {
    if (heads == nullptr || il < 0 || il >= (int) heads->layers.size()) {
        return;
    }
    ggml_tensor * cis = locret_build_cis(ctx, *heads, il, q, k, v, n_tokens);
    ggml_format_name(cis, "locret_cis-%d", il);
    // an output: the allocator must not reuse its memory before the scores are read (or stored)
    ggml_set_output(cis);
    ggml_build_forward_expand(gf, cis);

    if (res->t_locret_cis.size() < heads->layers.size()) {
        res->t_locret_cis.resize(heads->layers.size(), nullptr);
    }
    res->t_locret_cis[il] = cis;
}
