// Coverage-guided fuzz target (libFuzzer) for the retaining-heads loader, llama_locret_heads_load: every input is a
// heads file for the default model; it must load, or be refused with a message. A crash, a sanitizer report (ASan,
// UBSan), a leak or a hang is a finding.
//
//   LOCRET_TEST_MODEL=model.gguf lf-locret-heads CORPUS_DIR [libFuzzer flags]     (scripts/fuzz.sh runs it)
//   LOCRET_FUZZ_SEED_DIR=DIR ...   first writes the seed (valid random heads, d_R 4) into DIR
//
// The same file, linked with fuzz-replay-main.cpp instead of libFuzzer, replays a corpus in ctest (replay-locret-heads).
#include "fuzz-seeds.h"
#include "llama-locret.h"
#include "llama.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <unistd.h>

static llama_model * g_model = nullptr;
static std::string   g_input;  // where an input is written (the loader reads a path): in fuzz.sh's scratch folder, else /dev/shm when there is one

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
    const char * model_path = std::getenv("LOCRET_TEST_MODEL");
    if (model_path == nullptr) {
        std::fprintf(stderr, "lf-locret-heads: set LOCRET_TEST_MODEL to the default model\n");
        std::exit(2);
    }
    llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.no_alloc  = true;                  // the loader needs the model's shapes, not its weights
    mp.load_mode = LLAMA_LOAD_MODE_NONE;  // (no_alloc cannot map the file)
    g_model = llama_model_load_from_file(model_path, mp);
    if (g_model == nullptr) {
        std::fprintf(stderr, "lf-locret-heads: cannot load %s\n", model_path);
        std::exit(2);
    }
    // scripts/fuzz.sh names a scratch folder it removes afterwards (a crash skips the atexit removal below)
    const char * scratch = std::getenv("LOCRET_FUZZ_SCRATCH");
    const std::string dir = scratch != nullptr && *scratch ? scratch :
            access("/dev/shm", W_OK) == 0 ? "/dev/shm" : (std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "/tmp");
    g_input = dir + "/lf-locret-heads-" + std::to_string((long) getpid()) + ".gguf";
    if (const char * seeds = std::getenv("LOCRET_FUZZ_SEED_DIR")) {
        size_t meta = 0;
        if (seed_heads(g_model, std::string(seeds) + "/seed-d4.gguf", meta).empty()) {
            std::fprintf(stderr, "lf-locret-heads: cannot write the seed into %s\n", seeds);
            std::exit(2);
        }
    }
    std::atexit([] { std::remove(g_input.c_str()); llama_model_free(g_model); });
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    if (!write_file(g_input, data, size)) {
        std::fprintf(stderr, "lf-locret-heads: cannot write %s\n", g_input.c_str());
        std::abort();
    }
    llama_locret_heads * heads = llama_locret_heads_load(g_model, g_input.c_str());
    if (heads != nullptr) {
        llama_locret_heads_free(heads);
        return 0;
    }
    const char * msg = llama_locret_last_error();
    if (msg == nullptr || *msg == '\0') {
        std::fprintf(stderr, "lf-locret-heads: an input of %zu bytes was refused without a message\n", size);
        std::abort();  // a finding like a crash
    }
    return 0;
}
