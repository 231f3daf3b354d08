// What the fuzzers of saved states share (the seeded mutation fuzzer fuzz-locret-state and the coverage-guided
// lf-locret-state): an evicting context of the default model with its heads at a small budget (b = 64, ubatch 32, so
// that a state is small and a load fast), a 320-token prompt that made several evictions, and the two seed states it
// leaves (the whole context's and sequence 0's); the errors the library logged; the Locret section of a state.
#pragma once

#include "llama-locret.h"
#include "llama.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

static const int32_t FUZZ_STATE_BUDGET = 64;
static const int32_t FUZZ_STATE_UBATCH = 32;
static const int32_t FUZZ_STATE_PROMPT = 320;

// what the library logged at error level since the last reset (a refusal must say why)
static std::string g_errors;

static void on_log(ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_ERROR) {
        g_errors += text;
    }
}

static bool decode_tokens(llama_context * ctx, const std::vector<llama_token> & tokens, llama_pos pos0) {
    for (size_t i = 0; i < tokens.size(); i += FUZZ_STATE_UBATCH) {
        const int32_t n = (int32_t) std::min<size_t>(FUZZ_STATE_UBATCH, tokens.size() - i);
        llama_batch batch = llama_batch_init(n, 0, 1);
        for (int32_t j = 0; j < n; ++j) {
            batch.token[j]     = tokens[i + j];
            batch.pos[j]       = pos0 + (llama_pos) (i + j);
            batch.n_seq_id[j]  = 1;
            batch.seq_id[j][0] = 0;
            batch.logits[j]    = i + j + 1 == tokens.size();
        }
        batch.n_tokens = n;
        const int32_t rc = llama_decode(ctx, batch);
        llama_batch_free(batch);
        if (rc != 0) {
            return false;
        }
    }
    return true;
}

// the byte where the Locret section starts (its magic "LRCT"), searched from the end; 0 if absent
static size_t locret_section(const uint8_t * state, size_t size) {
    static const uint8_t magic[4] = { 'L', 'R', 'C', 'T' };
    for (size_t at = size >= 4 ? size - 4 : 0; at-- > 0; ) {
        if (std::memcmp(state + at, magic, 4) == 0) {
            return at;
        }
    }
    return 0;
}

static bool logits_finite(llama_context * ctx, int32_t n_vocab) {
    const float * logits = llama_get_logits_ith(ctx, -1);
    for (int32_t t = 0; t < n_vocab; ++t) {
        if (!std::isfinite(logits[t])) {
            return false;
        }
    }
    return true;
}

struct fuzz_state_fixture {
    llama_model *         model = nullptr;
    llama_locret_heads *  heads = nullptr;
    llama_context *       ctx   = nullptr;
    llama_memory_t        mem   = nullptr;
    int32_t               n_vocab = 0;
    std::vector<llama_token> probe;   // a clean prompt of one ubatch
    std::vector<uint8_t>  seeds[2];   // the context's state, sequence 0's state
    size_t                sections[2] = { 0, 0 };  // where each seed's Locret section starts
    std::vector<uint8_t>  scratch;    // an input's state (the coverage-guided target reuses it)

    ~fuzz_state_fixture() {
        llama_free(ctx);
        llama_locret_heads_free(heads);
        llama_model_free(model);
    }
};

// set up `f` (logs collected in g_errors); an empty string when it worked, else what failed
static std::string fuzz_state_setup(fuzz_state_fixture & f, const char * model_path, const char * heads_path,
                                    uint64_t seed) {
    llama_log_set(on_log, nullptr); // a million refusals are not printed, only collected
    llama_backend_init();
    f.model = llama_model_load_from_file(model_path, llama_model_default_params());
    if (f.model == nullptr) {
        return std::string("cannot load ") + model_path;
    }
    llama_locret_params lp = llama_locret_params_default();
    lp.budget      = FUZZ_STATE_BUDGET;
    lp.stabilizers = 8;
    lp.local       = 4;
    if (llama_locret_configure_default(f.model, model_path, heads_path, &lp, &f.heads) != 0) {
        return std::string("cannot configure Locret: ") + llama_locret_last_error();
    }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx     = 8192;
    cp.n_batch   = FUZZ_STATE_UBATCH;
    cp.n_ubatch  = FUZZ_STATE_UBATCH;
    cp.n_seq_max = 1;
    cp.n_threads = cp.n_threads_batch = 1;
    f.ctx = llama_init_from_model(f.model, cp);
    if (f.ctx == nullptr) {
        return std::string("cannot create the context: ") + llama_locret_last_error() + g_errors;
    }
    f.mem     = llama_get_memory(f.ctx);
    f.n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(f.model));

    // a prompt of ordinary token ids (the scores and positions it leaves are what the state holds)
    std::mt19937_64 rng(seed);
    std::vector<llama_token> prompt(FUZZ_STATE_PROMPT);
    for (auto & t : prompt) {
        t = (llama_token) (200 + rng() % (uint64_t) std::min(20000, f.n_vocab - 200));
    }
    f.probe.assign(prompt.begin(), prompt.begin() + FUZZ_STATE_UBATCH);
    if (!decode_tokens(f.ctx, prompt, 0)) {
        return "the seed prompt does not decode";
    }
    const llama_locret_stats stats = llama_locret_get_stats(f.ctx);
    if (stats.n_evictions < 3) {
        return "the seed prompt made " + std::to_string(stats.n_evictions) + " evictions, not several";
    }
    f.seeds[0].resize(llama_state_get_size(f.ctx));
    f.seeds[0].resize(llama_state_get_data(f.ctx, f.seeds[0].data(), f.seeds[0].size()));
    f.seeds[1].resize(llama_state_seq_get_size(f.ctx, 0));
    f.seeds[1].resize(llama_state_seq_get_data(f.ctx, f.seeds[1].data(), f.seeds[1].size(), 0));
    for (int k = 0; k < 2; ++k) {
        f.sections[k] = locret_section(f.seeds[k].data(), f.seeds[k].size());
        g_errors.clear();
        const size_t got = k == 0 ? llama_state_set_data(f.ctx, f.seeds[k].data(), f.seeds[k].size())
                                  : llama_state_seq_set_data(f.ctx, f.seeds[k].data(), f.seeds[k].size(), 0);
        if (got != f.seeds[k].size() || f.sections[k] == 0) {
            return "seed " + std::to_string(k) + " (" + std::to_string(f.seeds[k].size()) + " bytes, Locret section at " +
                   std::to_string(f.sections[k]) + ") does not load back: " + g_errors;
        }
    }
    return "";
}
