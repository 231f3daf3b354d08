// The doors through which llama-bench reaches Locret: its options (read from the one table), the configuration of
// each test's model, Locret-Q's prefix, and the eviction time and device memory it reports. Its own parser and loop
// call these from a hook patch.
#pragma once

#include "locret-options.h"

#include <cstdint>
#include <string>
#include <vector>

struct llama_context;
struct llama_model;

// the usage lines of the Locret options
void locret_bench_print_usage();

// argv[i] names a Locret option: read its value (argv[++i]) into o. Returns false when the value is missing; throws
// std::invalid_argument for a value the option refuses. Not a Locret option: false, i unchanged.
bool locret_bench_parse_arg(locret_options & o, int argc, char ** argv, int & i);

// Before a test's context (made with `cparams`): --locret-budget-mib resolved for them, then the heads and settings
// registered for the model. Returns false with the reason printed.
bool locret_bench_configure(const locret_options & o, llama_model * model, const std::string & model_path,
                            const llama_context_params & cparams, llama_locret_heads ** heads);

// Locret-Q: the tokens that open a prompt starting sequence 0 (the query and a blank line), pinned before anything is
// evicted; empty without a query or when the sequence has started. Returns false with the reason printed when the
// query does not fit in the first batch (n_first tokens) or cannot be pinned.
bool locret_bench_query_prefix(llama_context * ctx, const std::string & query, int n_first, std::vector<llama_token> & out);

// eviction time inside the timed runs, split by where it goes
struct locret_bench_timer {
    uint64_t us[3] = { 0, 0, 0 }; // select, compaction, read-back
    uint64_t start_us[3] = { 0, 0, 0 };
    uint64_t rows[5] = { 0, 0, 0, 0, 0 }; // rows moved, rotated, kept, host syncs, compactions in the timed runs
    uint64_t start_rows[5] = { 0, 0, 0, 0, 0 };

    void start(const llama_context * ctx);
    void stop(const llama_context * ctx);
    // prints the split and the device memory in use (after the timed runs: ggml's buffers and the CUDA pools are not
    // given back during a run, so this is the test's peak)
    void report(const llama_context * ctx, const std::vector<uint64_t> & samples_ns) const;
};
