// SAGE-KV in ggml graphs (locret-sage.h): the query capture in the model's graph, and the eviction-time scores, from
// existing ops only so that every backend runs them.

#include "locret-sage.h"
#include "locret-hooks.h"
#include "locret-memory.h"

#include "llama-batch.h"
#include "llama-graph.h"

#include "ggml.h"

#include <cmath>
#include <memory>
#include <vector>

namespace {

// the ubatch's runs of one sequence (split_simple / split_seq: one run; split_equal: one per sequence)
uint32_t locret_count_runs(const llama_ubatch & ubatch) {
    if (ubatch.seq_id == nullptr || ubatch.n_tokens == 0) {
        return 1;
    }
    uint32_t n = 1;
    for (uint32_t t = 1; t < ubatch.n_tokens; ++t) {
        n += ubatch.seq_id[t][0] != ubatch.seq_id[t - 1][0];
    }
    return n;
}

// for the query store: the ubatch index of each run's last token, and the store row (the sequence's stream) it goes to
class locret_query_rows_input : public llm_graph_input_i {
public:
    locret_query_rows_input(ggml_tensor * last, ggml_tensor * rows) : last(last), rows(rows) {}

    void set_input(const llama_ubatch * ubatch) override {
        GGML_ASSERT(ubatch != nullptr && locret_count_runs(*ubatch) == (uint32_t) last->ne[0]);
        idx.clear();
        seq.clear();
        for (uint32_t t = 0; t < ubatch->n_tokens; ++t) {
            if (t + 1 == ubatch->n_tokens || ubatch->seq_id[t + 1][0] != ubatch->seq_id[t][0]) {
                idx.push_back((int32_t) t);
                seq.push_back((int64_t) ubatch->seq_id[t][0]);
            }
        }
        ggml_backend_tensor_set(last, idx.data(), 0, ggml_nbytes(last));
        ggml_backend_tensor_set(rows, seq.data(), 0, ggml_nbytes(rows));
    }

    bool can_reuse(const llm_graph_params & params) override {
        return locret_count_runs(params.ubatch) == (uint32_t) last->ne[0];
    }

    ggml_tensor * last; // I32 [n_runs]
    ggml_tensor * rows; // I64 [n_runs]
    std::vector<int32_t> idx;
    std::vector<int64_t> seq;
};

} // namespace

void llama_locret_graph_add_query(ggml_context * ctx, ggml_cgraph * gf, llm_graph_result * res,
        const llama_memory_context_i * mctx, ggml_tensor * q, float kq_scale, const llama_ubatch & ubatch, int il) {
    llama_locret_memory * mem = locret_memory_of_context(mctx);
    if (mem == nullptr || !mem->get_policy().selects_once() || il < 0 || ubatch.n_tokens == 0) {
        return;
    }
    const int32_t i = mem->layer_index((uint32_t) il);
    ggml_tensor * store = i >= 0 ? mem->query_store(i) : nullptr; // F32 [d_k*n_head, n_stream]
    if (store == nullptr) {
        return;
    }
    const int64_t n_tokens = ubatch.n_tokens;
    if (ggml_nelements(q) != store->ne[0] * n_tokens) {
        // a query layout this hook does not know: the layer stays uncaptured and the selection refuses to run
        return;
    }
    // q: [d_k, n_head, n_tokens] after RoPE (and after the Hadamard rotation the keys get, if any)
    ggml_tensor * q2 = ggml_reshape_2d(ctx, ggml_is_contiguous(q) ? q : ggml_cont(ctx, q), store->ne[0], n_tokens);
    if (res->t_locret_q_last == nullptr) {
        const int64_t n_runs = locret_count_runs(ubatch);
        ggml_tensor * last = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n_runs);
        ggml_tensor * rows = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n_runs);
        ggml_set_input(last);
        ggml_set_input(rows);
        ggml_set_name(last, "locret_query_last");
        ggml_set_name(rows, "locret_query_rows");
        res->add_input(std::make_unique<locret_query_rows_input>(last, rows));
        res->t_locret_q_last = last;
        res->t_locret_q_rows = rows;
    }
    ggml_tensor * last_q = ggml_get_rows(ctx, q2, res->t_locret_q_last); // F32 [d_k*n_head, n_runs]
    ggml_build_forward_expand(gf, ggml_set_rows(ctx, store, last_q, res->t_locret_q_rows));
    mem->set_query_scale(i, kq_scale);
}

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
