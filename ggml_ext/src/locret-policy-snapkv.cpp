// SnapKV applied per chunk (Li et al., 2024; as kvpress's SnapKVPress scores a prompt after its prefill, here at every
// eviction of a chunked prefill and of generation). Training-free and query-aware: the attention layers hand the
// post-RoPE queries of the last part's last w = LLAMA_LOCRET_SNAPKV_WINDOW tokens of each sequence to the query store
// (the graph hook SAGE-KV uses, locret-graph.cpp); at an eviction a graph scores every cached unit j of the sequence:
//     p_{t,h}(j) = softmax over units i <= cell(t) of (scale * q_{t,h} . k_i)    window query t, query head h (causal)
//     s(j, KV head) = mean over the window's queries t and over the query heads h of the KV head's group of p_{t,h}(j)
//     score = s averaged over the `pool` units centred on j (within the sequence's cells; --locret-pool, default 5)
// into the memory's score store, and the top-b selection keeps the best units beside the window itself (kept like
// stabilizers: it is the observation). The window is the last part's: a prefill ubatch's last w tokens, or during
// generation (parts of one token) the newest token alone. Its state: state.word[0] = the window's captured queries
// (min(w, tokens of the last part); 0 after a cut, when the newest units are kept by recency instead).
// tests/py/test_snapkv.py checks the scores and the kept sets against numpy.

#include "locret-policy.h"
#include "locret-compact.h"
#include "locret-heads.h"
#include "locret-settings.h"

#include "ggml.h"
#include "llama-impl.h"

#include <algorithm>
#include <cmath>

namespace {

constexpr uint32_t W = LLAMA_LOCRET_SNAPKV_WINDOW;

// Build into gf, for every layer, the scores of cells [0, n) of stream strm from the last nw queries of its query
// store rows, written into the layer's score store (rows strm*kv_size + cell).
void snapkv_build(ggml_context * ctx, ggml_cgraph * gf, const locret_policy_env & env, uint32_t strm, uint32_t n,
                  uint32_t nw, const std::vector<float> & kq_scale) {
    for (size_t i = 0; i < env.layers.size(); ++i) {
        const locret_kv_layer & L = env.layers[i];
        ggml_tensor * store = env.queries[i]; // F32 [d*nq, W*n_stream]
        const int64_t d  = L.d_k;
        const int64_t H  = L.n_head_kv;
        const int64_t nq = store->ne[0] / d;  // query heads
        const int64_t G  = nq / H;            // query heads per KV head; query head h reads KV head h / G

        // the cached keys as they are stored (after RoPE): [d, n, H]
        ggml_tensor * k = ggml_view_3d(ctx, L.k, d, H, n, ggml_row_size(L.k->type, d), L.k->nb[1],
                (size_t) strm * L.k->nb[2]);
        k = ggml_permute(ctx, k, 0, 2, 1, 3);
        // the window's queries, oldest first: [d*nq, nw] -> [d, nw, nq]
        ggml_tensor * q = ggml_view_2d(ctx, store, store->ne[0], nw, store->nb[1],
                ((size_t) strm * W + W - nw) * store->nb[1]);
        q = ggml_reshape_3d(ctx, ggml_cont(ctx, q), d, nq, nw);
        q = ggml_cont(ctx, ggml_permute(ctx, q, 0, 2, 1, 3));

        // each window query's attention over the units it saw (query t sits in cell n - nw + t): [n, nw, nq]
        ggml_tensor * p = ggml_mul_mat(ctx, k, q);
        p = ggml_diag_mask_inf(ctx, p, (int) (n - nw));
        p = ggml_soft_max_ext(ctx, p, nullptr, kq_scale[i], 0.0f);

        // the mean over the window and the KV head's group: [n, nw, G, H] -> [nw*G, n*H] -> [n, H]
        p = ggml_reshape_4d(ctx, p, n, nw, G, H);
        p = ggml_cont(ctx, ggml_permute(ctx, p, 2, 0, 1, 3));
        p = ggml_sum_rows(ctx, ggml_reshape_2d(ctx, p, nw * G, (int64_t) n * H));
        p = ggml_scale(ctx, ggml_reshape_2d(ctx, p, n, H), 1.0f / (float) (nw * G));

        // pooled over neighbouring units: stride 1, padding pool/2 (the op averages over the cells inside the row)
        const uint32_t pool = env.cfg.pool;
        if (pool > 1 && n > 1) {
            p = ggml_pool_1d(ctx, p, GGML_OP_POOL_AVG, (int) pool, 1, (int) pool / 2);
        }

        // the store's layout: [H, cells]
        ggml_tensor * s   = ggml_cont(ctx, ggml_transpose(ctx, p));
        ggml_tensor * dst = ggml_view_2d(ctx, L.score, H, n, L.score->nb[1], (size_t) strm * env.cfg.n_cells * L.score->nb[1]);
        ggml_build_forward_expand(gf, ggml_cpy(ctx, s, dst));
    }
}

struct locret_policy_snapkv : locret_policy {
    llama_locret_policy id() const override { return LLAMA_LOCRET_POLICY_SNAPKV; }
    bool reads_cells_in_order() const override { return true; }
    bool stores_scores() const override { return true; }
    bool pools_scores() const override { return true; }

    void configure(const llama_locret_params & p, uint32_t, locret_config & cfg, std::string & err) const override {
        if (p.pool == -1) {
            cfg.pool = LLAMA_LOCRET_SNAPKV_POOL;
        }
        if (cfg.budget <= std::max(cfg.stabilizers, W)) {
            err = format("with SnapKV the budget (%u) must be larger than its observation window (%u units), which it "
                    "keeps, and the stabilizers (%u)", cfg.budget, W, cfg.stabilizers);
        }
    }
    uint64_t unscored_units(const locret_config & cfg) const override {
        return W > cfg.stabilizers ? W - cfg.stabilizers : 0; // the window beyond the stabilizers
    }
    std::string describe(const locret_config &) const override {
        return format(", observation window %u", W);
    }

    uint32_t query_rows(const locret_config &) const override { return W; }
    size_t score_graph_nodes(size_t n_layers) const override { return 48 * n_layers + 16; }
    void build_worst_score_graph(const locret_policy_env & env, ggml_context * ctx, ggml_cgraph * gf) const override {
        snapkv_build(ctx, gf, env, 0, env.cfg.capacity, W, std::vector<float>(env.layers.size(), 1.0f));
    }

    void placed(const locret_config &, locret_policy_state & st, uint32_t, uint32_t n_tokens, bool) const override {
        st.word[0] = std::min(W, n_tokens);
    }
    bool prepare(const locret_policy_env & env, const locret_evict_args & a, locret_policy_state & st,
                 locret_protect & out) const override {
        const uint32_t nw = std::min(st.word[0], a.n_used);
        out.n_pin = a.n_pinned;
        if (nw == 0) {
            // no window since a cut: the newest units stay, as StreamingLLM would keep them
            out.n_stab = a.n_keep - a.n_pinned;
            return true;
        }
        out.n_stab = std::max(a.n_stab, nw);
        if (!locret_queries_captured(env, "SnapKV")) {
            return false;
        }
        return env.run("SnapKV", format("%u units by %u queries", a.n_used, nw), [&](ggml_context * ctx, ggml_cgraph * gf) {
            snapkv_build(ctx, gf, env, a.strm, a.n_used, nw, env.query_scale);
        });
    }
    void truncated(const locret_config &, locret_policy_state & st, uint32_t) const override {
        st.word[0] = 0; // the window's tokens may be gone
    }
    bool state_ok(const locret_config &, const locret_policy_state & st, uint32_t n_used) const override {
        return st.word[0] <= std::min(W, n_used) && st.word[1] == 0;
    }
};

} // namespace

std::unique_ptr<locret_policy> locret_policy_make_snapkv() {
    return std::make_unique<locret_policy_snapkv>();
}
