// A seeded mutation fuzzer for saved states of an evicting context: the KV cells and the Locret section
// (bookkeeping, positions and scores of every layer and KV head, the budget schedule, the pinned query) that
// llama_state_set_data and llama_state_seq_set_data read back.
//
//   fuzz-locret-state [N_INPUTS [SEED [MODEL.gguf [HEADS.gguf]]]]   (MODEL defaults to $LOCRET_TEST_MODEL, HEADS
//                                                                    to $LOCRET_TEST_HEADS; ctest runs 2000 inputs,
//                                                                    a long run is the same command with more)
//
// The seeds are two states of the default model with its heads at a small budget (b = 64, ubatch 32, so that a
// state is small and a load fast), saved after a 320-token prompt that made several evictions: the whole context's
// state and sequence 0's. Every input is one of them with one to three mutations (a truncation, flipped bits, a 4- or
// 8-byte field set to a boundary value, bytes inserted or removed), three in four of them inside the Locret section
// (found by its magic) or just before it. Each input must load or be refused with an error logged; a refusal must
// leave the sequence empty; a crash fails the run, a hang fails it through ctest's timeout. Every 500 inputs, and
// after every 20th input that loaded, the context decodes again: after a refusal from an empty cache, after a load
// from where the state left off (a mutated state that loaded may hold any values: the decode may fail, but must
// not crash), then the cache is cleared and a clean prompt must give finite logits.
#include "fuzz-common.h"
#include "fuzz-state.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

// the refusal cut at its first digit: inputs group by the kind of refusal
static std::string kind_of(const std::string & msg) {
    std::string m = msg.substr(0, msg.find('\n'));
    const size_t digit = m.find_first_of("0123456789");
    return m.substr(0, std::min<size_t>(digit, 100));
}

int main(int argc, char ** argv) {
    const long     n_inputs   = argc > 1 ? std::atol(argv[1]) : 2000;
    const uint64_t seed       = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 1;
    const char *   model_path = argc > 3 ? argv[3] : std::getenv("LOCRET_TEST_MODEL");
    const char *   heads_path = argc > 4 ? argv[4] : std::getenv("LOCRET_TEST_HEADS");
    if (model_path == nullptr || heads_path == nullptr) {
        std::fprintf(stderr, "usage: %s [N_INPUTS [SEED [MODEL.gguf [HEADS.gguf]]]] (or set LOCRET_TEST_MODEL and "
                "LOCRET_TEST_HEADS)\n", argv[0]);
        return 2;
    }
    if (n_inputs <= 0) {
        std::fprintf(stderr, "%s: N_INPUTS must be positive\n", argv[0]);
        return 2;
    }

    fuzz_state_fixture f;
    const std::string failed = fuzz_state_setup(f, model_path, heads_path, seed);
    if (!failed.empty()) {
        std::fprintf(stderr, "%s: %s\n", argv[0], failed.c_str());
        return 1;
    }
    llama_context * ctx = f.ctx;
    llama_memory_t mem = f.mem;
    const std::vector<uint8_t> (&seeds)[2] = f.seeds;
    const size_t (&sections)[2] = f.sections;
    const std::vector<llama_token> & probe = f.probe;
    std::mt19937_64 rng(seed ^ 0x9e3779b97f4a7c15ull);
    int status = 0;

    long n_loaded = 0, n_refused = 0, n_silent = 0, n_left_cells = 0, n_decoded_after = 0, n_decode_refused = 0;
    std::map<std::string, long> kinds;
    const auto t0 = std::chrono::steady_clock::now();
    for (long i = 0; i < n_inputs && status == 0; ++i) {
        const int k = (int) (i % 2);
        std::vector<uint8_t> in = seeds[k];
        const size_t from = sections[k] > 64 ? sections[k] - 64 : 0;
        const int n_mut = 1 + (int) (rng() % 3);
        for (int m = 0; m < n_mut; ++m) {
            fuzz_mutate(in, from, SIZE_MAX, rng);
        }
        g_errors.clear();
        const size_t got = k == 0 ? llama_state_set_data(ctx, in.data(), in.size())
                                  : llama_state_seq_set_data(ctx, in.data(), in.size(), 0);
        // every 500 inputs, and after every 20th loaded one
        const bool check_decode = (i + 1) % 500 == 0 || (got != 0 && (n_loaded + 1) % 20 == 0);
        if (got == 0) {
            n_refused++;
            if (g_errors.empty()) {
                n_silent++;
                std::fprintf(stderr, "FAIL: input %ld (%s state) was refused without a message\n", i, k ? "sequence" : "context");
                status = 1;
            }
            if (llama_memory_seq_pos_max(mem, 0) != -1) {
                n_left_cells++;
                std::fprintf(stderr, "FAIL: input %ld: a refused load left cells behind (last position %d)\n", i,
                        (int) llama_memory_seq_pos_max(mem, 0));
                status = 1;
            }
            kinds[kind_of(g_errors)]++;
        } else {
            n_loaded++;
            if (got > in.size()) {
                std::fprintf(stderr, "FAIL: input %ld: the load read %zu bytes of %zu\n", i, got, in.size());
                status = 1;
            }
            if (check_decode) {
                // go on from where the loaded state left off: it may fail, it must not crash
                n_decoded_after++;
                std::vector<llama_token> next(probe.begin(), probe.begin() + 4);
                if (!decode_tokens(ctx, next, llama_memory_seq_pos_max(mem, 0) + 1)) {
                    n_decode_refused++;
                }
            }
        }
        if (check_decode) {
            llama_memory_clear(mem, true);
            if (!decode_tokens(ctx, probe, 0)) {
                std::fprintf(stderr, "FAIL: after input %ld the cleared context does not decode\n", i);
                status = 1;
            } else if (!logits_finite(ctx, f.n_vocab)) {
                std::fprintf(stderr, "FAIL: after input %ld a clean prompt gives a non-finite logit\n", i);
                status = 1;
            }
        }
        if ((i + 1) % 100000 == 0) {
            std::fprintf(stderr, "fuzz-locret-state: %ld inputs\n", i + 1);
        }
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

    std::printf("fuzz-locret-state: %ld inputs (seed %llu; states of %zu and %zu bytes, Locret sections of %zu and %zu) in "
            "%.1f s: %ld loaded, %ld refused with a message, %ld without, %ld refusals left cells; %ld loaded states "
            "decoded on (%ld of them refused the decode)\n",
            n_loaded + n_refused, (unsigned long long) seed, seeds[0].size(), seeds[1].size(),
            seeds[0].size() - sections[0], seeds[1].size() - sections[1], secs, n_loaded, n_refused, n_silent,
            n_left_cells, n_decoded_after, n_decode_refused);
    fuzz_print_kinds(kinds);
    llama_backend_free();
    return status;
}
