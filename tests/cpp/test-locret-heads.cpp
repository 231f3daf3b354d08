// The retaining-heads C API from C++: write heads with ggml's own gguf API, load and attach them,
// decode, read the recorded scores, and check the refusals.
//
//   test-locret-heads MODEL.gguf        (scripts/test.sh passes the default model)
//
// Properties checked (the Python tests compare the values with a PyTorch reference):
// - a token's scores do not depend on how the prompt is split into ubatches (up to the model's
//   own numerical differences between ubatch sizes);
// - recorded positions follow the batch; scores are finite and not constant;
// - heads for a different layer count are refused with a message naming it;
// - heads loaded for one model cannot be attached to another model's context.
#include "heads-header.h"
#include "llama-locret.h"
#include "llama-locret-debug.h"

#include "ggml.h"
#include "gguf.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "test-checks.h"

// heads with random F32 weights for a model with the given attention shape
static void write_heads(const std::string & path, const llama_model * model, uint32_t n_layer_in_file) {
    const uint32_t n_head_kv = llama_model_n_head_kv(model);
    const uint32_t d_r       = 32;

    gguf_context * gguf = gguf_init_empty();
    const uint32_t d_in = heads_header(gguf, model, n_layer_in_file, d_r);

    ggml_init_params ip = { /*.mem_size =*/ 2 * n_layer_in_file * (ggml_tensor_overhead() + (d_in + n_head_kv) * d_r * sizeof(float)) + 1024,
                            /*.mem_buffer =*/ nullptr, /*.no_alloc =*/ false };
    ggml_context * ctx = ggml_init(ip);
    std::mt19937 rng(1234);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (uint32_t il = 0; il < n_layer_in_file; ++il) {
        ggml_tensor * fc1 = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, d_in, d_r);
        ggml_tensor * fc2 = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, d_r, n_head_kv);
        ggml_format_name(fc1, "locret.blk.%u.fc1.weight", il);
        ggml_format_name(fc2, "locret.blk.%u.fc2.weight", il);
        for (int64_t i = 0; i < ggml_nelements(fc1); ++i) { ((float *) fc1->data)[i] = normal(rng) / std::sqrt((float) d_in); }
        for (int64_t i = 0; i < ggml_nelements(fc2); ++i) { ((float *) fc2->data)[i] = normal(rng) / std::sqrt((float) d_r); }
        gguf_add_tensor(gguf, fc1);
        gguf_add_tensor(gguf, fc2);
    }
    gguf_write_to_file(gguf, path.c_str(), false);
    gguf_free(gguf);
    ggml_free(ctx);
}

// decode `tokens` in ubatches of `n_ubatch` and return the recorded scores [n_layer][n_head_kv][n_tokens]
static std::vector<float> scores_with_ubatch(llama_model * model, const llama_locret_heads * heads,
        const std::vector<llama_token> & tokens, int n_ubatch, std::vector<int32_t> & positions) {
    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx     = 512;
    cparams.n_batch   = 512;
    cparams.n_ubatch  = n_ubatch;
    cparams.n_threads = cparams.n_threads_batch = 2;
    llama_context * ctx = llama_init_from_model(model, cparams);
    CHECK(ctx != nullptr, "context");
    CHECK(llama_locret_set_heads(ctx, heads) == 0, "%s", llama_locret_last_error());
    CHECK(llama_locret_get_heads(ctx) == heads, "attached heads");
    llama_locret_record_scores(ctx, true);

    std::vector<llama_token> copy = tokens;
    CHECK(llama_decode(ctx, llama_batch_get_one(copy.data(), (int32_t) copy.size())) == 0, "decode");

    const int32_t n = llama_locret_recorded_n_tokens(ctx);
    CHECK(n == (int32_t) tokens.size(), "recorded %d tokens, decoded %zu", n, tokens.size());
    std::vector<float> scores((size_t) llama_model_n_layer(model) * llama_model_n_head_kv(model) * n);
    positions.assign(n, -1);
    CHECK(llama_locret_recorded_scores(ctx, scores.data(), positions.data(), n) == n, "%s", llama_locret_last_error());
    CHECK(llama_locret_recorded_scores(ctx, scores.data(), positions.data(), n + 1) == -1, "a wrong count must be refused");
    llama_free(ctx);
    return scores;
}

int main(int argc, char ** argv) {
    const char * model_path = argc > 1 ? argv[1] : std::getenv("LOCRET_TEST_MODEL");
    if (model_path == nullptr) {
        std::fprintf(stderr, "usage: %s MODEL.gguf (or set LOCRET_TEST_MODEL)\n", argv[0]);
        return 1;
    }
    llama_backend_init();
    llama_model_params mparams = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(model_path, mparams);
    if (model == nullptr) {
        std::fprintf(stderr, "FAIL: cannot load %s\n", model_path);
        return 1;
    }
    const int32_t n_layer = llama_model_n_layer(model);
    const std::string good_path = "test-locret-heads.gguf";
    const std::string bad_path  = "test-locret-heads-bad.gguf";
    write_heads(good_path, model, n_layer);
    write_heads(bad_path,  model, n_layer + 2);

    CHECK(llama_locret_file_has_heads(good_path.c_str()) == 1, "heads file not recognised");
    CHECK(llama_locret_file_has_heads(model_path) == 0, "the plain model has no heads");
    CHECK(llama_locret_file_has_heads("no-such-file.gguf") == -1, "a missing file is unreadable");

    // refusal: heads for another layer count
    CHECK(llama_locret_heads_load(model, bad_path.c_str()) == nullptr, "heads with %d layers accepted", n_layer + 2);
    CHECK(std::strstr(llama_locret_last_error(), "n_layer is") != nullptr, "error was '%s'", llama_locret_last_error());

    llama_locret_heads * heads = llama_locret_heads_load(model, good_path.c_str());
    CHECK(heads != nullptr, "%s", llama_locret_last_error());
    if (heads == nullptr) {
        return 1;
    }
    CHECK(llama_locret_heads_hidden_size(heads) == 32, "d_R");

    // a prompt of distinct tokens, scored in one ubatch and in eight
    std::vector<llama_token> tokens;
    for (int i = 0; i < 128; ++i) {
        tokens.push_back((llama_token) (100 + 37 * i));
    }
    std::vector<int32_t> pos_one, pos_many;
    const std::vector<float> one  = scores_with_ubatch(model, heads, tokens, 128, pos_one);
    const std::vector<float> many = scores_with_ubatch(model, heads, tokens, 16,  pos_many);
    // the model itself computes slightly differently per ubatch size (other matmul kernels), so
    // compare per (layer, KV head) series by correlation: misplaced or mixed-up tokens break it
    const size_t n_tok = tokens.size();
    const size_t n_series = one.size() / n_tok;
    float min_corr = 1.0f, min_v = INFINITY, max_v = -INFINITY;
    bool finite = true;
    for (size_t s = 0; s < n_series; ++s) {
        const float * a = &one[s * n_tok];
        const float * b = &many[s * n_tok];
        double ma = 0, mb = 0;
        for (size_t t = 0; t < n_tok; ++t) { ma += a[t]; mb += b[t]; }
        ma /= n_tok; mb /= n_tok;
        double sab = 0, saa = 0, sbb = 0;
        for (size_t t = 0; t < n_tok; ++t) {
            finite = finite && std::isfinite(a[t]) && std::isfinite(b[t]);
            sab += (a[t] - ma) * (b[t] - mb); saa += (a[t] - ma) * (a[t] - ma); sbb += (b[t] - mb) * (b[t] - mb);
            min_v = std::fmin(min_v, a[t]);
            max_v = std::fmax(max_v, a[t]);
        }
        min_corr = std::fmin(min_corr, (float) (sab / std::sqrt(saa * sbb + 1e-30)));
    }
    std::printf("scores: %zu values in [%.4f, %.4f]; min correlation, 1 ubatch vs 8 ubatches, over %zu (layer, head) series: %.5f\n",
            one.size(), min_v, max_v, n_series, min_corr);
    CHECK(finite, "non-finite scores");
    CHECK(max_v - min_v > 1e-3f, "scores are constant");
    CHECK(min_corr >= 0.99f, "scores depend on the ubatch split: correlation %.4f", min_corr);
    for (size_t i = 0; i < tokens.size(); ++i) {
        CHECK(pos_one[i] == (int32_t) i && pos_many[i] == (int32_t) i, "position %zu", i);
    }

    // refusal: heads loaded for this model cannot go on another model's context
    llama_model * other = llama_model_load_from_file(model_path, mparams);
    llama_context * other_ctx = llama_init_from_model(other, llama_context_default_params());
    CHECK(llama_locret_set_heads(other_ctx, heads) == -1, "heads of another model instance were attached");
    CHECK(std::strstr(llama_locret_last_error(), "another model") != nullptr, "error was '%s'", llama_locret_last_error());
    llama_free(other_ctx);
    llama_model_free(other);

    llama_locret_heads_free(heads);
    llama_model_free(model);
    std::remove(good_path.c_str());
    std::remove(bad_path.c_str());
    llama_backend_free();

    if (g_failures) {
        std::fprintf(stderr, "%d check(s) failed\n", g_failures);
        return 1;
    }
    std::printf("ok\n");
    return 0;
}
