// The device's top-b selection (locret_build_select: a graph of existing ggml ops) against the host's (locret_select,
// the reference that tests/py/test_eviction.py checks against a numpy model of Algorithm 1), on every backend of this
// build (CPU, and CUDA in a CUDA build): the same kept cells for every (layer, KV head), ties included.
//
//   test-locret-select [--bench]
//
// It also checks a layer's cut at an eviction (locret_cut_layer: the cells a layer reads, with a budget schedule's
// masked cells left out, split into pinned, candidates and stabilizers) against a brute-force walk over the cells.
//
// --bench also times the selection at the paper's Llama-3.1-8B shape (32 layers x 8 KV heads, b = 16384 from 17408
// units) on each backend; the timing is printed, never checked.
#include "locret-select.h"

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "test-checks.h"

enum score_kind {
    SCORES_RANDOM,   // continuous: ties are unlikely
    SCORES_FEW,      // four distinct values: ties everywhere, also across the cut
    SCORES_EQUAL,    // one value: the cut falls inside a single tie
    SCORES_SPECIAL,  // +-inf, +-0 and repeated values
};

struct select_case {
    const char * name;
    int64_t n_head_kv, n_layers, n_cells, n_streams;
    uint32_t strm, n_used, n_keep, n_stab;
    score_kind kind;
    uint32_t n_pin = 0; // a pinned query (Locret-Q): the first cells, kept whatever their scores
};

static float draw(score_kind kind, std::mt19937 & rng) {
    switch (kind) {
        case SCORES_RANDOM: return std::normal_distribution<float>(0.0f, 1.0f)(rng);
        case SCORES_FEW:    return (float) std::uniform_int_distribution<int>(0, 3)(rng) * 0.25f - 0.5f;
        case SCORES_EQUAL:  return 0.125f;
        case SCORES_SPECIAL: {
            static const float v[] = { INFINITY, -INFINITY, 0.0f, -0.0f, 1.0f, 1.0f, -2.5f, 3e-30f };
            return v[std::uniform_int_distribution<int>(0, 7)(rng)];
        }
    }
    return 0.0f;
}

// runs one case on `backend`; returns the graph's compute time in ms
static double run_case(ggml_backend_t backend, const select_case & c, bool check) {
    std::mt19937 rng(1234);
    const int64_t n_rows_store = c.n_cells * c.n_streams;
    std::vector<float> data((size_t) (c.n_head_kv * n_rows_store * c.n_layers));
    for (auto & x : data) {
        x = draw(c.kind, rng);
    }

    ggml_init_params sp = { ggml_tensor_overhead() * 2, nullptr, true };
    ggml_context * ctx_store = ggml_init(sp);
    ggml_tensor * scores = ggml_new_tensor_3d(ctx_store, GGML_TYPE_F32, c.n_head_kv, n_rows_store, c.n_layers);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx_store, backend);
    ggml_backend_tensor_set(scores, data.data(), 0, ggml_nbytes(scores));

    const uint32_t n_cand = c.n_used - c.n_stab - c.n_pin;
    const uint32_t n_top  = c.n_keep - c.n_stab - c.n_pin;
    ggml_init_params gp = { ggml_tensor_overhead() * 64 + ggml_graph_overhead(), nullptr, true };
    ggml_context * ctx = ggml_init(gp);
    ggml_tensor * top = locret_build_select(ctx, scores, c.strm, (uint32_t) c.n_cells, c.n_pin, n_cand, n_top);
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, top);
    for (int i = 0; i < ggml_graph_n_nodes(gf); ++i) {
        ggml_tensor * node = ggml_graph_node(gf, i);
        CHECK(ggml_backend_supports_op(backend, node), "%s: %s does not run %s (%s)", c.name, ggml_backend_name(backend),
              ggml_op_desc(node), node->name);
    }
    ggml_gallocr_t galloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(backend));
    const bool allocated = ggml_gallocr_alloc_graph(galloc, gf);
    CHECK(allocated, "%s: graph allocation failed", c.name);
    double ms = 0.0;
    if (allocated) {
        const auto t0 = std::chrono::steady_clock::now();
        CHECK(ggml_backend_graph_compute(backend, gf) == GGML_STATUS_SUCCESS, "%s: compute failed", c.name);
        ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();

        std::vector<int32_t> got((size_t) ggml_nelements(top));
        ggml_backend_tensor_get(top, got.data(), 0, ggml_nbytes(top));
        if (check) {
            std::vector<float> row(c.n_used);
            std::vector<uint32_t> want;
            std::vector<uint32_t> dev(c.n_keep);
            std::vector<uint8_t>  mark;
            int n_bad_rows = 0;
            for (int64_t l = 0; l < c.n_layers; ++l) {
                for (int64_t h = 0; h < c.n_head_kv; ++h) {
                    for (uint32_t cell = 0; cell < c.n_used; ++cell) {
                        row[cell] = data[(size_t) ((l * n_rows_store + (int64_t) c.strm * c.n_cells + cell) * c.n_head_kv + h)];
                    }
                    locret_select(row.data(), c.n_used, c.n_keep, c.n_pin, c.n_stab, want);
                    const int64_t r = l * c.n_head_kv + h;
                    locret_keep_from_top(got.data() + r * n_top, n_top, c.n_used, c.n_pin, c.n_stab, dev.data(), mark);
                    n_bad_rows += want != dev;
                    // the pinned cells are kept even where every other cell outscores them
                    for (uint32_t k = 0; k < c.n_pin; ++k) {
                        n_bad_rows += want[k] != k;
                    }
                }
            }
            CHECK(n_bad_rows == 0, "%s on %s: %d of %lld rows keep other cells than the host's selection", c.name,
                  ggml_backend_name(backend), n_bad_rows, (long long) (c.n_layers * c.n_head_kv));
        }
    }
    ggml_gallocr_free(galloc);
    ggml_free(ctx);
    ggml_backend_buffer_free(buf);
    ggml_free(ctx_store);
    return ms;
}

// locret_cut_layer against a walk over the cells: the layer reads [0, m0) and [dead_end, n_used) (m0 = min(live_end,
// dead_end)); of those, in cell order, the first n_pin are pinned, the last `stab` stabilizers, the rest candidates,
// which the cut gives as two runs of cells
static void check_cut(uint32_t live_end, uint32_t dead_end, uint32_t n_used, uint32_t budget, uint32_t n_keep,
                      uint32_t n_pin, uint32_t n_stab) {
    const locret_layer_cut c = locret_cut_layer(live_end, dead_end, n_used, budget, n_keep, n_pin, n_stab);
    std::vector<uint32_t> read;
    for (uint32_t cell = 0; cell < n_used; ++cell) {
        if (cell < std::min(live_end, dead_end) || cell >= dead_end) {
            read.push_back(cell);
        }
    }
    const uint32_t n_held = (uint32_t) read.size();
    const uint32_t n_live = std::min(std::min(n_keep, budget), n_held);
    const uint32_t stab   = std::min(n_stab, n_held - n_pin);
    const std::vector<uint32_t> cand(read.begin() + n_pin, read.end() - stab);
    std::vector<uint32_t> runs;
    for (uint32_t k = 0; k < c.n0; ++k) {
        runs.push_back(c.c0 + k);
    }
    for (uint32_t k = 0; k < c.n1; ++k) {
        runs.push_back(c.c1 + k);
    }
    char what[160];
    std::snprintf(what, sizeof(what), "cut (live %u, dead %u, used %u, budget %u, keep %u, pin %u, stab %u)", live_end,
                  dead_end, n_used, budget, n_keep, n_pin, n_stab);
    CHECK(c.n_held == n_held && c.n_live == n_live && c.stab == stab, what);
    CHECK(c.gap == dead_end - std::min(live_end, dead_end), what);
    CHECK(c.n_cand == cand.size() && c.n_top == n_live - n_pin - stab, what);
    CHECK(runs == cand, what); // the candidates' cells, in order, as the two runs name them
    CHECK(c.on_device() == (c.n_top > 0 && c.n_top < c.n_cand), what);
}

static int check_cuts() {
    int n = 0;
    // no schedule: every cell read, one run
    check_cut(0, 0, 100, 64, 64, 0, 8); ++n;
    check_cut(0, 0, 100, 64, 64, 10, 8); ++n;
    // a schedule's masked cells [live, dead): candidates on both sides, or only above them
    check_cut(30, 50, 120, 40, 64, 0, 8); ++n;
    check_cut(30, 50, 120, 40, 64, 12, 8); ++n;
    check_cut(5, 50, 120, 40, 64, 12, 8); ++n;   // the pinned cells reach past the live end
    check_cut(50, 50, 120, 40, 64, 12, 8); ++n;  // the largest layer: nothing masked
    check_cut(30, 50, 60, 40, 64, 4, 16); ++n;   // more stabilizers than cells above the mask
    check_cut(30, 50, 50, 40, 64, 0, 0); ++n;    // nothing placed since the last eviction
    // every (live, dead, used) of a small stream, budgets around what the layer holds
    for (uint32_t used = 1; used <= 12; ++used) {
        for (uint32_t dead = 0; dead <= used; ++dead) {
            for (uint32_t live = 0; live <= dead; ++live) {
                const uint32_t held = used - (dead - live);
                for (uint32_t pin = 0; pin <= std::min(held, 2u); ++pin) {
                    for (uint32_t stab = 0; stab <= 3; ++stab) {
                        for (uint32_t keep = pin + std::min(stab, held - pin); keep <= held + 1; keep += 2) {
                            check_cut(live, dead, used, keep + (live % 2), keep, pin, stab); ++n;
                        }
                    }
                }
            }
        }
    }
    return n;
}

int main(int argc, char ** argv) {
    const bool bench = argc > 1 && std::strcmp(argv[1], "--bench") == 0;
    ggml_backend_load_all();

    const select_case cases[] = {
        { "random",              3, 4,  256, 1, 0,  200,  96,  0, SCORES_RANDOM  },
        { "random, stabilizers", 3, 4,  256, 1, 0,  200,  96, 16, SCORES_RANDOM  },
        { "few values",          3, 4,  256, 1, 0,  256, 100, 16, SCORES_FEW     },
        { "all equal",           2, 3,  128, 1, 0,  128,  64,  8, SCORES_EQUAL   },
        { "inf and zeros",       4, 2,  128, 1, 0,  120,  50,  0, SCORES_SPECIAL },
        { "second stream",       3, 2,  256, 3, 2,  250, 128, 16, SCORES_FEW     },
        { "keep one",            2, 2,  128, 2, 1,  100,   1,  0, SCORES_FEW     },
        { "drop one",            2, 2,  128, 1, 0,  100,  99,  0, SCORES_FEW     },
        { "long rows",           8, 2, 4608, 1, 0, 4608, 4096,  0, SCORES_FEW     }, // past a one-block sort
        { "pinned query",        3, 4,  256, 1, 0,  200,  96, 16, SCORES_RANDOM, 24 },
        { "pinned, ties",        3, 2,  256, 2, 1,  256, 100,  8, SCORES_FEW,    40 },
        { "pinned, -inf",        4, 2,  128, 1, 0,  120,  50,  0, SCORES_SPECIAL, 10 },
    };
    int n_backends = 0;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        const auto type = ggml_backend_dev_type(dev);
        if (type != GGML_BACKEND_DEVICE_TYPE_CPU && type != GGML_BACKEND_DEVICE_TYPE_GPU) {
            continue;
        }
        ggml_backend_t backend = ggml_backend_dev_init(dev, nullptr);
        if (backend == nullptr) {
            continue;
        }
        ++n_backends;
        for (const auto & c : cases) {
            run_case(backend, c, true);
        }
        if (bench) {
            const select_case shape = { "Llama-3.1-8B shape", 8, 32, 17408, 1, 0, 17408, 16384, 0, SCORES_RANDOM };
            run_case(backend, shape, false); // warm-up (CUDA pools, kernels)
            const double ms = run_case(backend, shape, true);
            std::printf("%s: selection of %u from %u units x %d rows: %.2f ms\n", ggml_backend_name(backend),
                        shape.n_keep, shape.n_used, (int) (shape.n_layers * shape.n_head_kv), ms);
        }
        std::printf("%s: %zu cases checked\n", ggml_backend_name(backend), sizeof(cases) / sizeof(cases[0]));
        ggml_backend_free(backend);
    }
    CHECK(n_backends > 0, "no backend");
    std::printf("%d layer cuts checked\n", check_cuts());
    if (g_failures > 0) {
        std::fprintf(stderr, "%d check(s) failed\n", g_failures);
        return 1;
    }
    std::printf("all device selections equal the host's\n");
    return 0;
}
