// Locret's nodes in llama.cpp's graph, from existing ggml ops only, so that every backend (CPU, CUDA on the RTX 4090
// and Jetson Orin) runs the same graph: the causal importance scores (CIS) of the heads, and the query capture of the
// policies that score by attention (SAGE-KV, SnapKV).

#include "locret-heads.h"
#include "locret-hooks.h"
#include "locret-memory.h"

#include "llama-graph.h"
#include "llama-batch.h"
#include "llama-impl.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

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

// x: [d_in, n_tokens] = concat(Q, K, V) flattened, the heads' input
static ggml_tensor * locret_heads_input(ggml_context * ctx, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v,
        int64_t n_tokens) {
    ggml_tensor * qk = ggml_concat(ctx, locret_flatten_heads(ctx, q, n_tokens), locret_flatten_heads(ctx, k, n_tokens), 0);
    return ggml_concat(ctx, qk, locret_flatten_heads(ctx, v, n_tokens), 0);
}

// s = fc2_w · act(fc1_w · x + fc1_b) + fc2_b: x [d_in, n_tokens] -> s [n_head_kv, n_tokens] for one layer's tensors,
// or x [d_in, n_tokens, n_layer] -> s [n_head_kv, n_tokens, n_layer] for the stacked ones (the biases broadcast)
static ggml_tensor * locret_build_mlp(ggml_context * ctx, const llama_locret_heads & heads, ggml_tensor * fc1_w,
        ggml_tensor * fc1_b, ggml_tensor * fc2_w, ggml_tensor * fc2_b, ggml_tensor * x) {
    ggml_tensor * h = ggml_mul_mat(ctx, fc1_w, x); // [d_R, n_tokens(, n_layer)]
    if (fc1_b) {
        h = ggml_add(ctx, h, fc1_b);
    }
    switch (heads.activation) {
        case LOCRET_ACT_SILU: h = ggml_silu(ctx, h); break;
        case LOCRET_ACT_GELU: h = ggml_gelu(ctx, h); break;
        case LOCRET_ACT_RELU: h = ggml_relu(ctx, h); break;
    }
    ggml_tensor * s = ggml_mul_mat(ctx, fc2_w, h); // [n_head_kv, n_tokens(, n_layer)]
    if (fc2_b) {
        s = ggml_add(ctx, s, fc2_b);
    }
    return s;
}

uint32_t llama_locret_graph_n_nodes(uint32_t n_layer) {
    // per layer: up to 6 flattening nodes (view, or cont + reshape), 2 concats, 2 mul_mat, 2 add and the activation,
    // 7 for pooling (reshape, permute, cont, pool, permute, cont, reshape) and the store; stacked, 3 sets (and 3 conts),
    // a view of the scores, and 7 once; with room to spare; and a budget schedule's mask (a view and an add) per layer
    return 36 * n_layer;
}

static uint32_t locret_pool_window(const llama_locret_memory & mem, const llama_ubatch & ubatch,
        const llama_memory_context_i * mctx);

namespace {

// the store rows of the ubatch's tokens: stream*n_cells + cell, the cell the memory's plan gives each token (its stream
// is its sequence, locret-memory.h); the memory context is the one of the ubatch the graph computes
class locret_score_rows_input : public llm_graph_input_i {
public:
    locret_score_rows_input(ggml_tensor * rows, uint32_t n_cells, const llama_memory_context_i * mctx)
        : rows(rows), n_cells(n_cells), mctx(mctx) {}

    void set_input(const llama_ubatch * ubatch) override {
        GGML_ASSERT(ubatch != nullptr && (int64_t) ubatch->n_tokens == rows->ne[0]);
        llama_locret_memory * mem = nullptr;
        const locret_ubatch_plan * plan = locret_plan_of(mctx, &mem);
        GGML_ASSERT(plan != nullptr && plan->cell.size() == ubatch->n_tokens);
        data.resize(ubatch->n_tokens);
        for (uint32_t t = 0; t < ubatch->n_tokens; ++t) {
            data[t] = (int64_t) ubatch->seq_id[t][0] * n_cells + plan->cell[t];
        }
        ggml_backend_tensor_set(rows, data.data(), 0, ggml_nbytes(rows));
    }

    bool can_reuse(const llm_graph_params & params) override {
        mctx = params.mctx;
        const llama_locret_memory * mem = locret_memory_of_context(mctx);
        // the pooling window is built into the graph: a sequence pooled otherwise needs a graph of its own
        return (int64_t) params.ubatch.n_tokens == rows->ne[0] &&
                (mem == nullptr || locret_pool_window(*mem, params.ubatch, mctx) == pool);
    }

    ggml_tensor * rows; // I64 [n_tokens]
    const uint32_t n_cells;
    const llama_memory_context_i * mctx;
    std::vector<int64_t> data;
    uint32_t pool = 0; // the pooling window the graph was built with (1: pooled nodes that keep each score)

    // a stacked scoring graph's state while the model's layers are built (locret_build_stacked)
    ggml_tensor * stack_x  = nullptr; // F32 [d_in, n_tokens, n_layer]: the heads' inputs of the layers built so far
    int32_t       stack_il = 0;       // the next layer expected
};

} // namespace

// Score pooling: cis F32 [n_head_kv, n_tokens] -> the mean of each token's scores over a window of `pool` tokens
// centred on it, clipped at the edges of its sequence's run in the ubatch. The ubatches of an evicting memory hold one
// sequence (split_simple, split_seq), or the same number of tokens of each of n_seqs sequences, one run after another
// (split_equal: generation, one token each; the reservation's ubatch), so the runs are rows of n_seq_tokens tokens.
static int64_t locret_pool_run(const llama_ubatch & ubatch) { // tokens of one sequence's run
    return ubatch.equal_seqs() ? ubatch.n_seq_tokens : ubatch.n_tokens;
}

// (callers pool only runs of at least 2 tokens)
static ggml_tensor * locret_build_pooled(ggml_context * ctx, ggml_tensor * cis, const llama_ubatch & ubatch,
        uint32_t pool) {
    const int64_t n_head_kv = cis->ne[0];
    const int64_t n_run     = locret_pool_run(ubatch);
    const int64_t n_runs    = (int64_t) ubatch.n_tokens / n_run;
    // [n_head_kv, n_run, n_runs] -> [n_run, n_head_kv, n_runs]: one row per (KV head, sequence), pooled along it
    ggml_tensor * rows = ggml_reshape_3d(ctx, cis, n_head_kv, n_run, n_runs);
    rows = ggml_cont(ctx, ggml_permute(ctx, rows, 1, 0, 2, 3));
    // stride 1, padding pool/2: as many outputs as tokens; the op averages over the positions inside the row only
    ggml_tensor * pooled = ggml_pool_1d(ctx, rows, GGML_OP_POOL_AVG, (int) pool, 1, (int) pool / 2);
    pooled = ggml_cont(ctx, ggml_permute(ctx, pooled, 1, 0, 2, 3));
    return ggml_reshape_2d(ctx, pooled, n_head_kv, ubatch.n_tokens);
}

static bool locret_every_token_outputs(const llama_ubatch & ubatch);

// The window a ubatch's stored scores are pooled over: 0 where they are not pooled (no pooling, a generation part, runs
// of one token); else its sequence's window (locret_pool_of), or 1 for a sequence that does not pool when pooling
// depends on the prompt (the config's pool_from): a window of 1 keeps each score, in a graph of the same shape, so
// that the reservation (no plan: the largest window) sizes every graph.
static uint32_t locret_pool_window(const llama_locret_memory & mem, const llama_ubatch & ubatch,
        const llama_memory_context_i * mctx) {
    const uint32_t pool = mem.config().pool;
    if (pool <= 1 || locret_every_token_outputs(ubatch) || locret_pool_run(ubatch) < 2) {
        return 0;
    }
    if (mem.config().pool_from == 0 || locret_plan_of(mctx, nullptr) == nullptr) {
        return pool;
    }
    // the runs of a ubatch that pools are one sequence's (split_simple, split_seq); split_equal's of several hold
    // generated tokens, which are not pooled, or the reservation's
    return std::max<uint32_t>(1, locret_pool_of(mem, ubatch.seq_id[0][0]));
}

static bool locret_every_token_outputs(const llama_ubatch & ubatch) {
    for (uint32_t i = 0; i < ubatch.n_tokens; ++i) {
        if (ubatch.output[i] == 0) {
            return false;
        }
    }
    return true;
}

// The largest ubatch scored over the stacked heads: its inputs, d_in x n_tokens x n_layer F32, live in the compute
// buffer until the last layer (3.7 MiB for SmolLM2 at 32 tokens, 25 MiB for Llama-3.1-8B); generation (one token per
// sequence) and speculative batches fit, a prefill ubatch is scored layer by layer, where one layer's ops are few
// beside the model's own.
static const int64_t LOCRET_STACK_MAX_TOKENS = 32;

// LOCRET_DEBUG_HEADS=layer scores every ubatch layer by layer, =stack stacks every ubatch that can be (tests compare
// the two); read at each graph build
static bool locret_stack_scores(const llama_locret_heads & heads, const llama_locret_memory & mem, int64_t n_tokens) {
    if (heads.stack.fc1_w == nullptr || mem.score_store().all() == nullptr ||
            mem.get_layers().size() != heads.layers.size()) {
        return false; // layers on several devices, or a cache that evicts some layers only (iSWA)
    }
    const char * e = getenv("LOCRET_DEBUG_HEADS");
    if (e != nullptr && strcmp(e, "layer") == 0) {
        return false;
    }
    return n_tokens <= LOCRET_STACK_MAX_TOKENS || (e != nullptr && strcmp(e, "stack") == 0);
}

// Stacked scoring, layer il of a graph: copy the layer's Q, K, V into its slice of the stacked input (three ops); at the
// last layer score every layer at once (the MLP over the stacked heads: five ops), write every layer's scores into the
// store (one op) and hand the recorder each layer's slice. A layer that does not reach this hook in order leaves the
// stack unscored and its t_locret_cis NULL, which llama_locret_check_graph refuses.
static void locret_build_stacked(ggml_context * ctx, ggml_cgraph * gf, llm_graph_result * res,
        const llama_locret_heads & heads, llama_locret_memory & mem, locret_score_rows_input & in,
        ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, int64_t n_tokens, int il) {
    const int64_t n_layer = (int64_t) heads.layers.size();
    if (il != in.stack_il) {
        in.stack_il = -1; // out of order: never scored
        return;
    }
    if (il == 0) {
        in.stack_x = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, heads.d_in, n_tokens, n_layer);
        ggml_set_name(in.stack_x, "locret_heads_x");
    }
    // each set writes in place and depends on the previous one, so the stack is complete when the MLP reads it
    size_t offset = (size_t) il * in.stack_x->nb[2];
    for (ggml_tensor * t : { q, k, v }) {
        ggml_tensor * part = locret_flatten_heads(ctx, t, n_tokens);
        if (!ggml_is_contiguous(part)) {
            part = ggml_cont(ctx, part); // GGML_OP_SET reads a contiguous source on CUDA
        }
        in.stack_x = ggml_set_inplace(ctx, in.stack_x, part, in.stack_x->nb[1], in.stack_x->nb[2], in.stack_x->nb[3],
                offset);
        offset += part->nb[1];
    }
    in.stack_il = il + 1;
    if (in.stack_il < n_layer) {
        return;
    }
    const locret_heads_stack & st = heads.stack;
    ggml_tensor * cis = locret_build_mlp(ctx, heads, st.fc1_w, st.fc1_b, st.fc2_w, st.fc2_b, in.stack_x);
    ggml_set_name(cis, "locret_cis");
    ggml_set_output(cis); // the recorder reads it after the graph
    ggml_build_forward_expand(gf, cis);
    ggml_build_forward_expand(gf, ggml_set_rows(ctx, mem.score_store().all(), cis, res->t_locret_rows));
    res->t_locret_cis.assign(n_layer, nullptr);
    for (int64_t j = 0; j < n_layer; ++j) {
        ggml_tensor * layer = ggml_view_2d(ctx, cis, cis->ne[0], n_tokens, cis->nb[1], j * cis->nb[2]);
        ggml_format_name(layer, "locret_cis-%d", (int) j);
        ggml_build_forward_expand(gf, layer); // a view in the graph gets its data when the graph is allocated
        res->t_locret_cis[j] = layer;
    }
}

void llama_locret_graph_add_cis(ggml_context * ctx, ggml_cgraph * gf, llm_graph_result * res,
        const llama_locret_heads * heads, const llama_memory_context_i * mctx,
        ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, const llama_ubatch & ubatch, int il) {
    if (heads == nullptr || il < 0 || il >= (int) heads->layers.size()) {
        return;
    }
    const int64_t n_tokens = ubatch.n_tokens;

    // an evicting memory keeps the scores beside the cache: written here like the keys, never read back per ubatch
    llama_locret_memory * mem = locret_memory_of_context(mctx);
    const int32_t i = mem != nullptr ? mem->layer_index((uint32_t) il) : -1;
    ggml_tensor * store = i >= 0 ? mem->score_store().layer(i) : nullptr;
    if (store != nullptr && res->t_locret_rows == nullptr) {
        ggml_tensor * rows = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n_tokens);
        ggml_set_input(rows);
        ggml_set_name(rows, "locret_score_rows");
        res->add_input(std::make_unique<locret_score_rows_input>(rows, mem->config().n_cells, mctx));
        res->t_locret_rows = rows;
    }
    // the recorder reads the heads' own scores (cis); the store, which eviction reads, the pooled ones. A part whose
    // every token asks for an output (generation: a speculative batch, the sampled token and its draft) is scored
    // token by token as single generated tokens are, so that its accepted tokens get the scores a token-by-token run
    // gives them, whatever was drafted beside them
    const uint32_t pool   = store != nullptr ? locret_pool_window(*mem, ubatch, mctx) : 0;
    const bool     pooled = pool > 0;
    locret_score_rows_input * rows_in = nullptr; // holds the stack's state between layers, and the pooling window
    for (auto & input : res->inputs) {
        if (auto * r = dynamic_cast<locret_score_rows_input *>(input.get()); r != nullptr && r->rows == res->t_locret_rows) {
            rows_in = r;
        }
    }
    if (rows_in != nullptr) {
        rows_in->pool = pool;
    }
    if (store != nullptr && !pooled && locret_stack_scores(*heads, *mem, n_tokens)) {
        GGML_ASSERT(rows_in != nullptr);
        locret_build_stacked(ctx, gf, res, *heads, *mem, *rows_in, q, k, v, n_tokens, il);
        return;
    }

    const locret_head_layer & layer = heads->layers[il];
    ggml_tensor * cis = locret_build_mlp(ctx, *heads, layer.fc1_w, layer.fc1_b, layer.fc2_w, layer.fc2_b,
            locret_heads_input(ctx, q, k, v, n_tokens));
    ggml_format_name(cis, "locret_cis-%d", il);
    // an output: the allocator must not reuse its memory before the recorder reads the scores
    ggml_set_output(cis);
    ggml_build_forward_expand(gf, cis);
    if (store != nullptr) {
        ggml_tensor * kept = pooled ? locret_build_pooled(ctx, cis, ubatch, pool) : cis;
        ggml_build_forward_expand(gf, ggml_set_rows(ctx, store, kept, res->t_locret_rows));
    }

    if (res->t_locret_cis.size() < heads->layers.size()) {
        res->t_locret_cis.resize(heads->layers.size(), nullptr);
    }
    res->t_locret_cis[il] = cis;
}

//
// queries for the policies that score by attention (SAGE-KV: each sequence's last token; SnapKV: its last w tokens):
// the post-RoPE queries of the end of each sequence's run in the ubatch, captured into the memory's query store
//

namespace {

// the ubatch's rows to capture: for each run of one sequence (split_simple / split_seq: one run; split_equal: one per
// sequence), its last min(n_rows - n_pin_rows, run length) tokens, into the store rows of its stream, the newest last:
// row stream*n_rows + n_rows - k + j for the j-th of the k captured tokens. With n_pin_rows > 0, also the tokens at the
// last k = min(n_pin_rows, n_pinned) pinned positions of a sequence that pins (locret_cells::pinned_to_capture), into the
// stream's leading rows, the newest last: position p to row stream*n_rows + n_pin_rows - n_pinned + p.
void locret_query_rows(const llama_ubatch & ubatch, const llama_locret_memory & mem, std::vector<int32_t> * idx,
        std::vector<int64_t> * row) {
    const uint32_t n_rows     = mem.query_store().rows();
    const uint32_t n_pin_rows = mem.query_store().pin_rows();
    const uint32_t n_window   = n_rows - n_pin_rows;
    idx->clear();
    row->clear();
    if (n_pin_rows > 0) {
        for (uint32_t t = 0; t < ubatch.n_tokens; ++t) {
            const llama_seq_id seq   = ubatch.seq_id[t][0];
            const locret_cells * s   = mem.get_stream(seq);
            const uint32_t     n_pin = s != nullptr ? s->pinned_to_capture() : 0;
            const llama_pos    p     = ubatch.pos[t];
            if (n_pin > 0 && p >= (llama_pos) n_pin - (llama_pos) std::min(n_pin_rows, n_pin) && p < (llama_pos) n_pin) {
                idx->push_back((int32_t) t);
                row->push_back((int64_t) seq * n_rows + n_pin_rows - n_pin + p);
            }
        }
    }
    uint32_t start = 0;
    for (uint32_t t = 0; t < ubatch.n_tokens; ++t) {
        if (t + 1 < ubatch.n_tokens && ubatch.seq_id[t + 1][0] == ubatch.seq_id[t][0]) {
            continue;
        }
        // the run [start, t]
        const uint32_t k    = std::min(n_window, t + 1 - start);
        const int64_t  strm = ubatch.seq_id[t][0];
        for (uint32_t j = 0; j < k; ++j) {
            idx->push_back((int32_t) (t + 1 - k + j));
            row->push_back(strm * n_rows + n_rows - k + j);
        }
        start = t + 1;
    }
}

class locret_query_rows_input : public llm_graph_input_i {
public:
    locret_query_rows_input(ggml_tensor * idx, ggml_tensor * rows, const llama_locret_memory * mem) : idx(idx), rows(rows), mem(mem) {}

    void set_input(const llama_ubatch * ubatch) override {
        GGML_ASSERT(ubatch != nullptr);
        locret_query_rows(*ubatch, *mem, &v_idx, &v_row);
        GGML_ASSERT(v_idx.size() == (size_t) idx->ne[0]);
        ggml_backend_tensor_set(idx, v_idx.data(), 0, ggml_nbytes(idx));
        ggml_backend_tensor_set(rows, v_row.data(), 0, ggml_nbytes(rows));
    }

    bool can_reuse(const llm_graph_params & params) override {
        locret_query_rows(params.ubatch, *mem, &v_idx, &v_row);
        return v_idx.size() == (size_t) idx->ne[0];
    }

    ggml_tensor * idx;  // I32 [n_captured]: the ubatch index of each captured token
    ggml_tensor * rows; // I64 [n_captured]: its row in the store
    const llama_locret_memory * mem;
    std::vector<int32_t> v_idx;
    std::vector<int64_t> v_row;
};

} // namespace

void llama_locret_graph_add_query(ggml_context * ctx, ggml_cgraph * gf, llm_graph_result * res,
        const llama_memory_context_i * mctx, ggml_tensor * q, float kq_scale, const llama_ubatch & ubatch, int il) {
    llama_locret_memory * mem = locret_memory_of_context(mctx);
    if (mem == nullptr || mem->query_store().rows() == 0 || il < 0 || ubatch.n_tokens == 0) {
        return;
    }
    const int32_t i = mem->layer_index((uint32_t) il);
    ggml_tensor * store = i >= 0 ? mem->query_store().layer(i) : nullptr; // F32 [d_k*n_head, n_rows*n_stream]
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
        std::vector<int32_t> idx;
        std::vector<int64_t> row;
        locret_query_rows(ubatch, *mem, &idx, &row);
        ggml_tensor * t_idx  = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, (int64_t) idx.size());
        ggml_tensor * t_rows = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, (int64_t) row.size());
        ggml_set_input(t_idx);
        ggml_set_input(t_rows);
        ggml_set_name(t_idx, "locret_query_last");
        ggml_set_name(t_rows, "locret_query_rows");
        res->add_input(std::make_unique<locret_query_rows_input>(t_idx, t_rows, mem));
        res->t_locret_q_last = t_idx;
        res->t_locret_q_rows = t_rows;
    }
    ggml_tensor * captured = ggml_get_rows(ctx, q2, res->t_locret_q_last); // F32 [d_k*n_head, n_captured]
    ggml_build_forward_expand(gf, ggml_set_rows(ctx, store, captured, res->t_locret_q_rows));
    mem->query_store().set_scale(i, kq_scale);
}
