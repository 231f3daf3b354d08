// Coverage-guided fuzz target (libFuzzer) for saved states of an evicting context (llama_state_set_data and
// llama_state_seq_set_data, the KV cells and the Locret section). An input's first byte picks the reader (even: the
// whole context's state, odd: sequence 0's), the rest is the state. It must load, or be refused with an error logged
// and the sequence left empty; after a load the context decodes on from where the state left off (that may fail,
// it must not crash), and after every input the cleared context must decode a clean prompt to finite logits.
// A crash, a sanitizer report, a leak or a hang is a finding.
//
//   LOCRET_TEST_MODEL=model.gguf LOCRET_TEST_HEADS=heads.gguf lf-locret-state CORPUS_DIR [libFuzzer flags]
//   LOCRET_FUZZ_SEED_DIR=DIR ...   first writes the two seed states (a 320-token prompt, several evictions) into DIR
//
// The same file, linked with fuzz-replay-main.cpp instead of libFuzzer, replays a corpus in ctest (replay-locret-state).
#include "fuzz-seeds.h"
#include "fuzz-state.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

static fuzz_state_fixture * g_fixture = nullptr;

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
    const char * model_path = std::getenv("LOCRET_TEST_MODEL");
    const char * heads_path = std::getenv("LOCRET_TEST_HEADS");
    if (model_path == nullptr || heads_path == nullptr) {
        std::fprintf(stderr, "lf-locret-state: set LOCRET_TEST_MODEL and LOCRET_TEST_HEADS\n");
        std::exit(2);
    }
    g_fixture = new fuzz_state_fixture();
    const std::string failed = fuzz_state_setup(*g_fixture, model_path, heads_path, 1);
    if (!failed.empty()) {
        std::fprintf(stderr, "lf-locret-state: %s\n", failed.c_str());
        std::exit(2);
    }
    if (const char * seeds = std::getenv("LOCRET_FUZZ_SEED_DIR")) {
        for (int k = 0; k < 2; ++k) {
            std::vector<uint8_t> in(1, (uint8_t) k);
            in.insert(in.end(), g_fixture->seeds[k].begin(), g_fixture->seeds[k].end());
            if (!write_file(std::string(seeds) + (k == 0 ? "/seed-context.state" : "/seed-sequence.state"), in)) {
                std::fprintf(stderr, "lf-locret-state: cannot write the seeds into %s\n", seeds);
                std::exit(2);
            }
        }
    }
    std::atexit([] { delete g_fixture; });
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    if (size == 0) {
        return 0;
    }
    fuzz_state_fixture & f = *g_fixture;
    const bool seq = data[0] & 1;
    data++;
    size--;
    g_errors.clear();
    const size_t got = seq ? llama_state_seq_set_data(f.ctx, data, size, 0) : llama_state_set_data(f.ctx, data, size);
    if (got == 0) {
        if (g_errors.empty()) {
            std::fprintf(stderr, "lf-locret-state: a %s state of %zu bytes was refused without a message\n",
                    seq ? "sequence" : "context", size);
            std::abort();
        }
        if (llama_memory_seq_pos_max(f.mem, 0) != -1) {
            std::fprintf(stderr, "lf-locret-state: a refused load left cells behind\n");
            std::abort();
        }
    } else {
        if (got > size) {
            std::fprintf(stderr, "lf-locret-state: the load read %zu bytes of %zu\n", got, size);
            std::abort();
        }
        std::vector<llama_token> next(f.probe.begin(), f.probe.begin() + 4);
        decode_tokens(f.ctx, next, llama_memory_seq_pos_max(f.mem, 0) + 1);  // may fail, must not crash
    }
    llama_memory_clear(f.mem, true);
    if (!decode_tokens(f.ctx, f.probe, 0) || !logits_finite(f.ctx, f.n_vocab)) {
        std::fprintf(stderr, "lf-locret-state: after an input the cleared context does not decode a clean prompt\n");
        std::abort();
    }
    return 0;
}
