// Coverage-guided fuzz target (libFuzzer) for the Locret section of saved states (what llama_state_set_data and
// llama_state_seq_set_data read after llama.cpp's own KV cells: bookkeeping, positions and scores of every layer and
// KV head, the budget schedule, the pinned query). An input's first byte picks the state (even: the whole context's,
// odd: sequence 0's); the rest replaces that seed state's Locret section, after its KV part, so that every input
// reaches our reader and costs a load, not a 1.6 MB copy of cells. It must load, or be refused with an error logged
// and the sequence left empty; after a load the context decodes on from where the state left off (that may fail, it
// must not crash), then the cleared context must decode a clean prompt to finite logits. A crash, a sanitizer
// report, a leak or a hang is a finding. (The seeded fuzz-locret-state mutates whole states, KV part included.)
//
//   LOCRET_TEST_MODEL=model.gguf LOCRET_TEST_HEADS=heads.gguf lf-locret-state CORPUS_DIR [libFuzzer flags]
//   LOCRET_FUZZ_SEED_DIR=DIR ...   first writes the two seeds (the sections of a 320-token prompt's states) into DIR
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
            in.insert(in.end(), g_fixture->seeds[k].begin() + (ptrdiff_t) g_fixture->sections[k], g_fixture->seeds[k].end());
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
    const int k = data[0] & 1;
    // the seed state's KV part, then the input as its Locret section
    std::vector<uint8_t> & state = f.scratch;
    state.assign(f.seeds[k].begin(), f.seeds[k].begin() + (ptrdiff_t) f.sections[k]);
    state.insert(state.end(), data + 1, data + size);
    g_errors.clear();
    const size_t got = k == 1 ? llama_state_seq_set_data(f.ctx, state.data(), state.size(), 0)
                              : llama_state_set_data(f.ctx, state.data(), state.size());
    if (got == 0) {
        if (g_errors.empty()) {
            std::fprintf(stderr, "lf-locret-state: a %s state was refused without a message\n", k ? "sequence" : "context");
            std::abort();
        }
        if (llama_memory_seq_pos_max(f.mem, 0) != -1) {
            std::fprintf(stderr, "lf-locret-state: a refused load left cells behind\n");
            std::abort();
        }
        return 0;
    }
    if (got > state.size()) {
        std::fprintf(stderr, "lf-locret-state: the load read %zu bytes of %zu\n", got, state.size());
        std::abort();
    }
    const std::vector<llama_token> next(f.probe.begin(), f.probe.begin() + 4);
    decode_tokens(f.ctx, next, llama_memory_seq_pos_max(f.mem, 0) + 1);  // may fail, must not crash
    llama_memory_clear(f.mem, true);
    if (!decode_tokens(f.ctx, next, 0) || !logits_finite(f.ctx, f.n_vocab)) {
        std::fprintf(stderr, "lf-locret-state: after a load the cleared context does not decode a clean prompt\n");
        std::abort();
    }
    return 0;
}
