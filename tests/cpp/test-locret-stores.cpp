// The score store and the query store (locret-stores.h) in host memory, without a model: their shapes (one tensor for
// every layer when the layers have the same KV heads, else one each), where a stream's rows sit, get/set/copy of a
// stream's scores, and the query store's rows, pinned rows, block size and scales.
//
//   test-locret-stores
#include "locret-stores.h"

#include "ggml-cpu.h"

#include <cmath>
#include <cstdio>
#include <vector>

#include "test-checks.h"

static void test_scores(bool uniform) {
    const std::vector<locret_store_layer> layers = { { 0, 2, 64 }, { 3, uniform ? 2u : 3u, 64 } };
    const uint32_t n_cells = 16, n_seq = 3;
    locret_score_store st;
    CHECK(st.empty(), "a new store is empty");
    st.make(layers, n_cells, n_seq, ggml_backend_cpu_buffer_type());
    CHECK(!st.empty(), "made");
    CHECK((st.all() != nullptr) == uniform, "one tensor for all layers only when their KV heads agree");
    for (size_t i = 0; i < layers.size(); ++i) {
        CHECK_EQ(st.layer(i)->ne[0], layers[i].n_head_kv);
        CHECK_EQ(st.layer(i)->ne[1], n_cells * n_seq);
        CHECK_EQ(st.offset(i, 2), 2 * n_cells * layers[i].n_head_kv * sizeof(float));
    }
    CHECK(st.bytes() >= (2 + layers[1].n_head_kv) * n_cells * n_seq * sizeof(float), "bytes %zu", st.bytes());

    // zeroed; a stream's scores land at its rows and nowhere else
    const uint32_t n_used = 5;
    std::vector<float> in(n_used * layers[1].n_head_kv), out(in.size(), -1.0f);
    for (size_t k = 0; k < in.size(); ++k) {
        in[k] = 1.0f + (float) k;
    }
    st.get(1, 1, n_used, out.data());
    CHECK(out[0] == 0.0f && out.back() == 0.0f, "not zeroed");
    st.set(1, 1, n_used, in.data());
    st.get(1, 1, n_used, out.data());
    CHECK(out == in, "set/get of stream 1");
    const float * raw = (const float *) st.layer(1)->data;
    CHECK(raw[n_cells * layers[1].n_head_kv] == 1.0f, "stream 1 starts at row n_cells");
    CHECK(raw[n_cells * layers[1].n_head_kv - 1] == 0.0f, "stream 0 untouched");
    st.get(0, 1, n_used, out.data()); // the other layer's stream 1 is untouched
    CHECK(out[0] == 0.0f, "layer 0 untouched");

    // copy: stream 2 takes stream 1's first n_used cells in every layer
    st.copy(1, 2, n_used);
    st.get(1, 2, n_used, out.data());
    CHECK(out == in, "copy");
}

static void test_queries() {
    const std::vector<locret_store_layer> layers = { { 0, 2, 64 }, { 1, 2, 96 } };
    locret_query_store q;
    CHECK(q.empty() && std::isnan(q.get_scale(0)), "a new store is empty, its scales NaN");
    q.make(layers, 96, 64, 2, ggml_backend_cpu_buffer_type());
    CHECK_EQ(q.rows(), 96);
    CHECK_EQ(q.pin_rows(), 64);
    CHECK_EQ(q.layer(1)->ne[0], 96);
    CHECK_EQ(q.layer(1)->ne[1], 96 * 2);
    CHECK_EQ(q.block_bytes(q.layer(1)), 96 * 96 * sizeof(float));
    CHECK(std::isnan(q.get_scale(1)), "a scale is NaN until recorded");
    q.set_scale(1, 0.125f);
    CHECK(q.get_scale(1) == 0.125f && std::isnan(q.get_scale(0)), "scales per layer");
    CHECK_EQ(q.tensors().size(), 2);
    const float * raw = (const float *) q.layer(0)->data;
    CHECK(raw[0] == 0.0f && raw[64 * 96 * 2 - 1] == 0.0f, "zeroed");
}

int main() {
    ggml_backend_load_all();
    test_scores(true);
    test_scores(false);
    test_queries();
    if (g_failures == 0) {
        std::printf("ok: stores\n");
    }
    return g_failures == 0 ? 0 : 1;
}
