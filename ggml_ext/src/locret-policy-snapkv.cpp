// SnapKV applied per chunk (Li et al., 2024; as kvpress's SnapKVPress scores a prompt after its prefill, here at every
// eviction of a chunked prefill and of generation). Training-free and query-aware: the attention layers hand the
// post-RoPE queries of the last part's last w tokens (snapkv:window, default 32) of each sequence to the query store
// (the graph hook SAGE-KV uses, locret-graph.cpp); at an eviction a graph scores every cached unit j of the sequence:
//     p_{t,h}(j) = softmax over units i <= cell(t) of (scale * q_{t,h} . k_i)    window query t, query head h (causal)
//     s(j, KV head) = mean over the window's queries t and over the query heads h of the KV head's group of p_{t,h}(j)
//     score = s averaged over the `pool` units centred on j (within the sequence's cells; snapkv:pool or --locret-pool,
//             default 5)
// into the memory's score store, and the top-b selection keeps the best units beside the window itself (kept like
// stabilizers: it is the observation). The window is the last part's: a prefill ubatch's last w tokens, or during
// generation (parts of one token) the newest token alone.
//
// With a pinned query (Locret-Q: the question placed at the start and pinned), the question is the observation
// window instead, as SnapKV reads a prompt whose question is at its end: the graph captures the queries of the last
// q = min(Q, n_pinned) pinned positions (Q = snapkv:question, default 64, the store's leading rows) when they are
// read, and every eviction scores all cached units by them, re-rotated (exactly, as compaction re-rotates keys) from
// their positions n_pinned - q + t to the positions right after the cache, n_used + t, so that they read the units
// as a question after the document would; no causal mask (every unit precedes them), and nothing kept for a window
// besides the pinned units and the plan's stabilizers. A quantized K cache (its keys and the captured queries in
// llama.cpp's Hadamard basis) keeps the last part's window.
// Its per-sequence state (below): window_rows, the last part's captured window queries (min(w, tokens of the last
// part); 0 after a cut, when the newest units are kept by recency instead); question_of, the pinned count whose
// question rows were captured (0: none).
// tests/py/test_snapkv.py checks the scores and the kept sets against numpy, with and without a pinned question.

#include "locret-policy.h"
#include "locret-compact.h"
#include "locret-heads.h"
#include "locret-settings.h"

#include "ggml.h"
#include "llama-impl.h"

#include <algorithm>
#include <cmath>

namespace {

// SnapKV's per-sequence state in the policy's words (locret_policy_state, saved in state files)
uint32_t & window_rows(locret_policy_state & st) { return st.word[0]; }
uint32_t   window_rows(const locret_policy_state & st) { return st.word[0]; }
uint32_t & question_of(locret_policy_state & st) { return st.word[1]; }
uint32_t   question_of(const locret_policy_state & st) { return st.word[1]; }

// its settings: snapkv:window=W,question=Q,pool=P
enum { WINDOW = 0, QUESTION = 1, POOL = 2 };
const locret_policy_knob KNOBS[] = {
    { "window",   "the observation window: queries of a part's last tokens", 32, 1, 4096 },
    { "question", "with a pinned question, its last tokens' queries",       64, 1, 4096 },
    { "pool",     "score pooling over neighbouring units (odd; kvpress's kernel_size; --locret-pool sets it too)", 5, 0, 1023 },
};

// the window w (fewer in a shorter part), the question's rows q, and the query store's rows per stream: [0, q) the
// pinned question's, [q, q + w) the last part's
uint32_t W(const locret_config & cfg) { return (uint32_t) cfg.policy_values.value[WINDOW]; }
uint32_t Q(const locret_config & cfg) { return (uint32_t) cfg.policy_values.value[QUESTION]; }
uint32_t R(const locret_config & cfg) { return Q(cfg) + W(cfg); }

// the question window's input: the re-rotation of its queries (one delta per query; each layer's frequency factors
// are resident, locret_rerotation::factors)
struct snapkv_question_inputs {
    ggml_tensor * delta = nullptr;       // I32 [nw]
};

// Build into gf, for every layer, the scores of cells [0, n) of stream strm from nw queries of its query store
// rows, written into the layer's score store (rows strm*kv_size + cell): the last part's window (the block's last nw
// rows, query t in cell n - nw + t, causal), or with `question` the pinned question's (the first block rows
// [Q - nw, Q)), re-rotated by question->delta, reading every cell.
void snapkv_build(ggml_context * ctx, ggml_cgraph * gf, const locret_policy_env & env, uint32_t strm, uint32_t n,
                  uint32_t nw, const std::vector<float> & kq_scale, snapkv_question_inputs * question) {
    if (question != nullptr) {
        question->delta = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, nw);
        ggml_set_input(question->delta);
    }
    for (size_t i = 0; i < env.layers.size(); ++i) {
        const locret_kv_layer & L = env.layers[i];
        ggml_tensor * store = env.queries[i]; // F32 [d*nq, (q + w)*n_stream]
        const int64_t d  = L.d_k;
        const int64_t H  = L.n_head_kv;
        const int64_t nq = store->ne[0] / d;  // query heads
        const int64_t G  = nq / H;            // query heads per KV head; query head h reads KV head h / G

        // the cached keys as they are stored (after RoPE): [d, n, H]
        ggml_tensor * k = ggml_view_3d(ctx, L.k, d, H, n, ggml_row_size(L.k->type, d), L.k->nb[1],
                (size_t) strm * L.k->nb[2]);
        k = ggml_permute(ctx, k, 0, 2, 1, 3);
        // the window's queries, oldest first: [d*nq, nw] -> [d, nq, nw]
        const size_t row0 = (size_t) strm * R(env.cfg) + (question != nullptr ? Q(env.cfg) - nw : R(env.cfg) - nw);
        ggml_tensor * q = ggml_view_2d(ctx, store, store->ne[0], nw, store->nb[1], row0 * store->nb[1]);
        q = ggml_reshape_3d(ctx, ggml_cont(ctx, q), d, nq, nw);
        if (question != nullptr && L.rot.rope) {
            // rotated at the question's positions: rotating by the difference moves them after the cache
            q = ggml_rope_ext(ctx, q, question->delta, L.rot.factors, L.rot.n_rot, L.rot.mode,
                    L.rot.n_ctx_orig, L.rot.freq_base, L.rot.freq_scale, L.rot.ext_factor, L.rot.attn_factor,
                    L.rot.beta_fast, L.rot.beta_slow);
        }
        // [d, nq, nw] -> [d, nw, nq]
        q = ggml_cont(ctx, ggml_permute(ctx, q, 0, 2, 1, 3));

        // each query's attention over the units it reads: [n, nw, nq] (a window query t sits in cell n - nw + t and
        // sees the cells up to it; the question sees them all)
        ggml_tensor * p = ggml_mul_mat(ctx, k, q);
        if (question == nullptr) {
            p = ggml_diag_mask_inf(ctx, p, (int) (n - nw));
        }
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

    std::vector<locret_policy_knob> knobs() const override { return { std::begin(KNOBS), std::end(KNOBS) }; }
    std::string params_problem(const llama_locret_params & p, const locret_policy_values & v) const override {
        if ((v.given & (1u << POOL)) && p.pool != -1) {
            return "snapkv:pool and --locret-pool both set SnapKV's pooling; give one";
        }
        if (v.value[POOL] > 1 && v.value[POOL] % 2 == 0) {
            return format("snapkv:pool must be odd, a window centred on each unit (got %d)", v.value[POOL]);
        }
        return "";
    }

    void configure(const llama_locret_params & p, uint32_t, locret_config & cfg, std::string & err) const override {
        if (p.pool == -1) {
            cfg.pool = (uint32_t) cfg.policy_values.value[POOL];
        }
        if (cfg.budget <= std::max(cfg.stabilizers, W(cfg))) {
            err = format("with SnapKV the budget (%u) must be larger than its observation window (%u units), which it "
                    "keeps, and the stabilizers (%u)", cfg.budget, W(cfg), cfg.stabilizers);
        }
    }
    uint64_t unscored_units(const locret_config & cfg) const override {
        return W(cfg) > cfg.stabilizers ? W(cfg) - cfg.stabilizers : 0; // the window beyond the stabilizers
    }
    std::string unscored_what(const locret_config & cfg) const override {
        return format("SnapKV's observation window of %u", W(cfg));
    }
    std::string describe(const locret_config & cfg) const override {
        return format(", observation window %u", W(cfg));
    }

    uint32_t query_rows(const locret_config & cfg) const override { return R(cfg); }
    uint32_t query_pin_rows(const locret_config & cfg) const override { return Q(cfg); }
    size_t score_graph_nodes(size_t n_layers) const override { return 56 * n_layers + 16; }
    void build_worst_score_graph(const locret_policy_env & env, ggml_context * ctx, ggml_cgraph * gf) const override {
        // the question's graph is the larger (a rope per layer; the same matrices as the window's when Q >= W)
        snapkv_question_inputs question;
        snapkv_build(ctx, gf, env, 0, env.cfg.capacity, std::max(Q(env.cfg), W(env.cfg)), std::vector<float>(env.layers.size(), 1.0f),
                &question);
    }

    void placed(const locret_config & cfg, locret_policy_state & st, uint32_t n_used, uint32_t n_tokens,
                uint32_t n_pinned, bool) const override {
        window_rows(st) = std::min(W(cfg), n_tokens);
        if (n_pinned > 0 && n_used - n_tokens < n_pinned && n_pinned <= n_used) {
            question_of(st) = n_pinned; // the part held the last pinned position: the question's rows are captured
        }
    }
    bool prepare(const locret_policy_env & env, const locret_evict_args & a, locret_policy_state & st,
                 locret_protect & out) const override {
        out.n_pin = a.n_pinned;
        const bool quantized_k = !env.layers.empty() && ggml_is_quantized(env.layers[0].k->type);
        if (a.n_pinned > 0 && question_of(st) == a.n_pinned && !quantized_k) {
            const uint32_t nq = std::min(Q(env.cfg), a.n_pinned);
            out.n_stab = a.n_stab;
            if (!locret_queries_captured(env, "SnapKV")) {
                return false;
            }
            snapkv_question_inputs question;
            // the question's queries were rotated at positions n_pinned - nq + t; read after the cache: n_used + t
            const int32_t delta = (int32_t) a.n_used - (int32_t) (a.n_pinned - nq);
            return env.run("SnapKV", format("%u units by the pinned question's %u queries", a.n_used, nq),
                [&](ggml_context * ctx, ggml_cgraph * gf) {
                    snapkv_build(ctx, gf, env, a.strm, a.n_used, nq, env.query_scale, &question);
                },
                [&]() {
                    // (an input no layer reads, as in a model without RoPE, is left unallocated)
                    if (question.delta->buffer != nullptr) {
                        const std::vector<int32_t> d(nq, delta);
                        ggml_backend_tensor_set(question.delta, d.data(), 0, ggml_nbytes(question.delta));
                    }
                });
        }
        const uint32_t nw = std::min(window_rows(st), a.n_used);
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
            snapkv_build(ctx, gf, env, a.strm, a.n_used, nw, env.query_scale, nullptr);
        }, nullptr);
    }
    void truncated(const locret_config &, locret_policy_state & st, uint32_t n_used) const override {
        window_rows(st) = 0; // the window's tokens may be gone
        if (n_used < question_of(st)) {
            question_of(st) = 0; // and the question's
        }
    }
    bool state_ok(const locret_config & cfg, const locret_policy_state & st, uint32_t n_used) const override {
        return window_rows(st) <= std::min(W(cfg), n_used) && question_of(st) <= n_used;
    }
};

} // namespace

std::unique_ptr<locret_policy> locret_policy_make_snapkv() {
    return std::make_unique<locret_policy_snapkv>();
}
