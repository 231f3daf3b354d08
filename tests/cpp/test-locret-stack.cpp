// The compaction's layer stack (locret-compact.h: locret_layer_stack, locret_moves::make_stack and ::prepare) on
// hand-made caches in host memory: no model, no context.
//
//   test-locret-stack
//
// - layers allocated one after the other in one buffer (as llama.cpp's cache allocates them) stack: the aliases span
//   every layer, with the distance between two layers as their stride;
// - layers that are not evenly spaced, or differ in shape, do not stack (the per-layer graph is used);
// - prepare() pads every layer's part of the move tables to the largest count with a row copied onto itself that no
//   move of the layer writes (a change of 0), in each of the three ways it finds one.
#include "locret-compact.h"

#include "ggml-backend.h"

#include <cstdio>
#include <vector>

#include "test-checks.h"

static const int64_t D       = 64;  // head size
static const int64_t N_HEAD  = 3;   // KV heads
static const int64_t KV_SIZE = 32;  // cells
static const int64_t N_ROWS  = N_HEAD * KV_SIZE;
static const size_t  CAP     = 40;  // move table room per layer

// n_layer layers of F16 K and V, made in the order llama.cpp's cache makes them (k0, v0, k1, v1, ...); `gap_before`
// puts an unrelated tensor before that layer's K (uneven spacing), `wide_layer` gives that layer one KV head more
struct cache {
    ggml_context_ptr        ctx;
    ggml_backend_buffer_ptr buf;
    std::vector<locret_kv_layer> layers;

    cache(int n_layer, int gap_before = -1, int wide_layer = -1) {
        ggml_init_params ip = { (size_t) (3 * n_layer + 1) * ggml_tensor_overhead(), nullptr, /*.no_alloc =*/ true };
        ctx.reset(ggml_init(ip));
        for (int il = 0; il < n_layer; ++il) {
            if (il == gap_before) {
                ggml_new_tensor_1d(ctx.get(), GGML_TYPE_F32, 100);
            }
            const int64_t n_head = N_HEAD + (il == wide_layer ? 1 : 0);
            locret_kv_layer L;
            L.il        = (uint32_t) il;
            L.n_head_kv = (uint32_t) n_head;
            L.d_k       = (uint32_t) D;
            L.d_v       = (uint32_t) D;
            L.k = ggml_new_tensor_3d(ctx.get(), GGML_TYPE_F16, D * n_head, KV_SIZE, 1);
            L.v = ggml_new_tensor_3d(ctx.get(), GGML_TYPE_F16, D * n_head, KV_SIZE, 1);
            L.rot.rope  = true;
            L.rot.n_rot = (int) D;
            layers.push_back(L);
        }
        buf.reset(ggml_backend_alloc_ctx_tensors_from_buft(ctx.get(), ggml_backend_cpu_buffer_type()));
    }
};

static void fill_moves(locret_moves & moves, size_t i, const std::vector<int64_t> & dst) {
    auto & m = moves.layer[i];
    m.n = dst.size();
    for (size_t j = 0; j < dst.size(); ++j) {
        m.src[j]   = (int32_t) (dst[j] + 1);
        m.dst[j]   = dst[j];
        m.delta[j] = -1;
    }
}

static void test_even_layers_stack() {
    cache c(4);
    locret_moves moves;
    moves.allocate(std::vector<size_t>(4, CAP), ggml_backend_cpu_buffer_type(), /*kv_rows =*/ false);
    moves.make_stack(c.layers, /*v_trans =*/ false, KV_SIZE, 1);
    const locret_layer_stack & S = moves.stack;
    CHECK(S.k != nullptr && S.v != nullptr && S.k_words != nullptr && S.v_words != nullptr, "even layers must stack");
    if (S.k == nullptr || S.k_words == nullptr) {
        return;
    }
    const size_t stride = (size_t) ((const char *) c.layers[1].k->data - (const char *) c.layers[0].k->data);
    CHECK_EQ(S.k->ne[0], D);
    CHECK_EQ(S.k->ne[1], N_ROWS);
    CHECK_EQ(S.k->ne[2], 4);
    CHECK_EQ(S.k->nb[1], D * 2);
    CHECK_EQ(S.k->nb[2], stride);
    CHECK(S.k->data == c.layers[0].k->data && S.v->data == c.layers[0].v->data, "aliases start at layer 0");
    CHECK_EQ(S.k_words->ne[0], D * 2 / 4); // an F16 row of 64 is 32 words
    CHECK_EQ(S.k_words->type, GGML_TYPE_F32);
    CHECK(S.rotates, "one set of RoPE parameters and F16 keys");
    CHECK(S.score == nullptr, "no scores kept");
    // the alias's last row is layer 3's last row
    CHECK((const char *) S.k->data + 3 * S.k->nb[2] + (N_ROWS - 1) * S.k->nb[1] ==
          (const char *) c.layers[3].k->data + (N_ROWS - 1) * D * 2, "layer 3 at index 3");

    // a transposed V does not stack (its moves are element by element)
    moves.make_stack(c.layers, /*v_trans =*/ true, KV_SIZE, 1);
    CHECK(moves.stack.v == nullptr && moves.stack.k != nullptr, "V transposed: K stacks, V does not");
    moves.rotate = false;
    fill_moves(moves, 0, { 0, 1 });
    moves.prepare(c.layers);
    CHECK_EQ(moves.n_stack, 0);

    // another RoPE in one layer: copies stack, rotations do not
    c.layers[2].rot.freq_base = 500000.0f;
    moves.make_stack(c.layers, false, KV_SIZE, 1);
    CHECK(moves.stack.k != nullptr && !moves.stack.rotates, "RoPE differs by layer");
    moves.rotate = true;
    moves.prepare(c.layers);
    CHECK_EQ(moves.n_stack, 0);
    moves.rotate = false;
    moves.prepare(c.layers);
    CHECK_EQ(moves.n_stack, 2);
}

static void test_uneven_layers_do_not_stack() {
    {
        cache c(4, /*gap_before =*/ 2);
        locret_moves moves;
        moves.allocate(std::vector<size_t>(4, CAP), ggml_backend_cpu_buffer_type(), /*kv_rows =*/ false);
        moves.make_stack(c.layers, false, KV_SIZE, 1);
        CHECK(moves.stack.k == nullptr && moves.stack.v == nullptr, "a tensor between layers 1 and 2");
        fill_moves(moves, 1, { 0 });
        moves.rotate = false;
        moves.prepare(c.layers);
        CHECK_EQ(moves.n_stack, 0);
    }
    {
        cache c(3, -1, /*wide_layer =*/ 1);
        locret_moves moves;
        moves.allocate(std::vector<size_t>(3, CAP), ggml_backend_cpu_buffer_type(), /*kv_rows =*/ false);
        moves.make_stack(c.layers, false, KV_SIZE, 1);
        CHECK(moves.stack.k == nullptr, "layer 1 has another head count");
    }
    {
        // move tables not evenly spaced (another room in one layer)
        cache c(3);
        locret_moves moves;
        moves.allocate({ CAP, CAP + 1, CAP }, ggml_backend_cpu_buffer_type(), /*kv_rows =*/ false);
        moves.make_stack(c.layers, false, KV_SIZE, 1);
        CHECK(moves.stack.k == nullptr, "uneven move tables");
    }
}

static void test_padding() {
    cache c(4);
    locret_moves moves;
    moves.allocate(std::vector<size_t>(4, CAP), ggml_backend_cpu_buffer_type(), /*kv_rows =*/ false);
    moves.make_stack(c.layers, false, KV_SIZE, 1);
    // layer 0: the most moves (5); layer 1: none; layer 2: rows up to the last one, so the row below the lowest;
    // layer 3: the first and last rows written, so the first row no move writes
    fill_moves(moves, 0, { 4, 5, 6, 7, 8 });
    fill_moves(moves, 2, { 10, N_ROWS - 1 });
    fill_moves(moves, 3, { 0, 1, N_ROWS - 1 });
    moves.rotate = true;
    moves.prepare(c.layers);
    CHECK_EQ(moves.n_stack, 5);
    const int64_t want_row[4] = { -1, 0, 9, 2 };
    for (int i = 1; i < 4; ++i) {
        const auto & m = moves.layer[i];
        for (size_t j = m.n; j < moves.n_stack; ++j) {
            CHECK_EQ(m.src[j], want_row[i]);
            CHECK_EQ(m.dst[j], want_row[i]);
            CHECK_EQ(m.delta[j], 0);
        }
        // the layer's own moves are untouched, and still counted alone
        for (size_t j = 0; j < m.n; ++j) {
            CHECK_EQ(m.delta[j], -1);
        }
    }
    CHECK_EQ(moves.count(), 5 + 0 + 2 + 3);
    // the padding is in the tables the graph reads (host memory: the arrays are the tables)
    const int64_t * dst = (const int64_t *) moves.t_dst->data;
    CHECK_EQ(dst[1 * CAP + 0], 0);
    CHECK_EQ(dst[2 * CAP + 2], 9);
    CHECK_EQ(dst[3 * CAP + 4], 2);
    // layer 0 has the most: not padded; the row after the highest write when there is one
    fill_moves(moves, 1, { 3 });
    moves.prepare(c.layers);
    CHECK_EQ(moves.layer[1].dst[1], 4);
    // clear(): no moves, and no stacked form left over
    moves.clear();
    CHECK_EQ(moves.n_stack, 0);
    moves.prepare(c.layers);
    CHECK_EQ(moves.n_stack, 0);
}

int main() {
    test_even_layers_stack();
    test_uneven_layers_do_not_stack();
    test_padding();
    if (g_failures > 0) {
        std::fprintf(stderr, "test-locret-stack: %d failure(s)\n", g_failures);
        return 1;
    }
    std::printf("test-locret-stack: ok\n");
    return 0;
}
