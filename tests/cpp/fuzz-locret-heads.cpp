// A seeded mutation fuzzer for the retaining-heads loader (llama_locret_heads_load).
//
//   fuzz-locret-heads [N_INPUTS [SEED [MODEL.gguf]]]    (MODEL defaults to $LOCRET_TEST_MODEL; ctest runs 3000
//                                                        inputs, a long run is the same command with more)
//
// The seed input is a valid heads file for MODEL written with ggml's gguf API (d_R 4, so that an input is small).
// Every input is that file with one to three mutations: a truncation, flipped bits, an integer field of the
// header overwritten with a boundary value (0, 1, 2^31 - 1, 2^32 - 1, 2^63 - 1, ...), or bytes inserted into or
// removed from the header. Each input must load (a mutation of tensor data gives other valid heads) or be refused
// with a message; a crash fails the run, a hang fails it through ctest's timeout. The run prints how many inputs
// were loaded and refused, and the most frequent refusals.
#include "fuzz-common.h"
#include "fuzz-seeds.h"
#include "llama-locret.h"

#include "ggml.h"
#include "gguf.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

// the refusal without the file's path, cut at the first digit: inputs group by the kind of refusal
static std::string kind_of(const std::string & msg, const std::string & path) {
    std::string m = msg;
    for (size_t at; (at = m.find(path)) != std::string::npos; ) {
        m.erase(at, path.size());
    }
    const size_t digit = m.find_first_of("0123456789");
    return m.substr(0, std::min<size_t>(digit, 90));
}

int main(int argc, char ** argv) {
    const long     n_inputs   = argc > 1 ? std::atol(argv[1]) : 2000;
    const uint64_t seed       = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 1;
    const char *   model_path = argc > 3 ? argv[3] : std::getenv("LOCRET_TEST_MODEL");
    if (model_path == nullptr) {
        std::fprintf(stderr, "usage: %s [N_INPUTS [SEED [MODEL.gguf]]] (or set LOCRET_TEST_MODEL)\n", argv[0]);
        return 2;
    }
    if (n_inputs <= 0) {
        std::fprintf(stderr, "%s: N_INPUTS must be positive\n", argv[0]);
        return 2;
    }

    llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr); // a million refusals are not logged
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.no_alloc  = true;                  // the loader needs the model's shapes, not its weights
    mp.load_mode = LLAMA_LOAD_MODE_NONE;  // (no_alloc cannot map the file)
    llama_model * model = llama_model_load_from_file(model_path, mp);
    if (model == nullptr) {
        std::fprintf(stderr, "%s: cannot load %s\n", argv[0], model_path);
        return 2;
    }

    const char * tmp = std::getenv("TMPDIR");
    const std::string dir  = tmp != nullptr && *tmp ? tmp : "/tmp";
    const std::string tag  = std::to_string((long) std::chrono::steady_clock::now().time_since_epoch().count() % 1000000007);
    const std::string path_seed  = dir + "/fuzz-locret-heads-seed-" + tag + ".gguf";
    const std::string path_input = dir + "/fuzz-locret-heads-input-" + tag + ".gguf";

    size_t meta = 0;
    const std::vector<uint8_t> base = seed_heads(model, path_seed, meta);
    int status = 0;
    llama_locret_heads * seed_loaded = base.empty() ? nullptr : llama_locret_heads_load(model, path_seed.c_str());
    if (seed_loaded == nullptr) {
        std::fprintf(stderr, "FAIL: the seed heads do not load: %s\n", llama_locret_last_error());
        status = 1;
    }
    llama_locret_heads_free(seed_loaded);

    std::mt19937_64 rng(seed);
    long n_loaded = 0, n_refused = 0, n_silent = 0;
    std::map<std::string, long> kinds;
    const auto t0 = std::chrono::steady_clock::now();
    for (long i = 0; i < n_inputs && status == 0; ++i) {
        std::vector<uint8_t> in = base;
        const int n_mut = 1 + (int) (rng() % 3);
        for (int m = 0; m < n_mut; ++m) {
            fuzz_mutate(in, 0, meta, rng);
        }
        if (!write_file(path_input, in)) {
            std::fprintf(stderr, "FAIL: cannot write %s\n", path_input.c_str());
            status = 1;
            break;
        }
        llama_locret_heads * heads = llama_locret_heads_load(model, path_input.c_str());
        if (heads != nullptr) {
            n_loaded++;
            llama_locret_heads_free(heads);
            continue;
        }
        const std::string msg = llama_locret_last_error();
        if (msg.empty()) {
            n_silent++;
            std::fprintf(stderr, "FAIL: input %ld was refused without a message\n", i);
            status = 1;
        }
        n_refused++;
        kinds[kind_of(msg, path_input)]++;
        if ((i + 1) % 100000 == 0) {
            std::fprintf(stderr, "fuzz-locret-heads: %ld inputs\n", i + 1);
        }
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::remove(path_seed.c_str());
    std::remove(path_input.c_str());

    std::printf("fuzz-locret-heads: %ld inputs (seed %llu, %zu-byte seed file) in %.1f s: %ld loaded, %ld refused with a message, %ld without\n",
            n_loaded + n_refused, (unsigned long long) seed, base.size(), secs, n_loaded, n_refused, n_silent);
    fuzz_print_kinds(kinds);
    llama_model_free(model);
    llama_backend_free();
    return status;
}
