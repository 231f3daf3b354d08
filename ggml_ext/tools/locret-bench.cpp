// Locret in llama-bench: options from the one table, configuration, Locret-Q's prefix and the eviction report.

#include "locret-bench.h"

#include "common.h"
#include "ggml-backend.h"

#include <algorithm>
#include <cstdio>
#include <stdexcept>

void locret_bench_print_usage() {
    for (size_t i = 0; i < locret_option_count(); ++i) {
        const locret_option & o = locret_option_at(i);
        const std::string head = std::string("  ") + o.name + " <" + o.value_hint + ">";
        // llama-bench's layout: the option in 46 columns, then its help, continued lines indented to match
        std::string help = o.help;
        for (size_t p = help.find('\n'); p != std::string::npos; p = help.find('\n', p + 1)) {
            help.insert(p + 1, std::string(46, ' '));
        }
        printf("%-45s %s\n", head.c_str(), help.c_str());
    }
}

bool locret_bench_parse_arg(locret_options & o, int argc, char ** argv, int & i) {
    const locret_option * opt = locret_option_find(argv[i]);
    if (opt == nullptr || i + 1 >= argc) {
        return false;
    }
    opt->set(o, argv[++i]);
    return true;
}

bool locret_bench_configure(const locret_options & o_in, llama_model * model, const std::string & model_path,
        const llama_context_params & cparams, llama_locret_heads ** heads) {
    locret_options o = o_in; // each test resolves a memory size for its own ubatch and K/V types
    std::string resolved;
    std::string failed = locret_options_resolve_mib(o, model_path, cparams, &resolved);
    if (!resolved.empty()) {
        fprintf(stderr, "llama-bench: %s\n", resolved.c_str());
    }
    if (failed.empty()) {
        failed = locret_options_configure(o, model, model_path, heads);
    }
    if (!failed.empty()) {
        fprintf(stderr, "llama-bench: error: Locret: %s\n", failed.c_str());
        return false;
    }
    return true;
}

bool locret_bench_query_prefix(llama_context * ctx, const std::string & query, int n_first, std::vector<llama_token> & out) {
    out.clear();
    if (query.empty() || llama_memory_seq_pos_max(llama_get_memory(ctx), 0) >= 0) {
        return true;
    }
    // the query and a blank line open the prompt, as the other tools place it; the rest stays random
    const llama_vocab * vocab = llama_model_get_vocab(llama_get_model(ctx));
    out = common_tokenize(vocab, locret_query_layout(query, ""), llama_vocab_get_add_bos(vocab), false);
    if ((int) out.size() > n_first) {
        fprintf(stderr, "llama-bench: the Locret-Q query (%zu tokens) does not fit in the prompt's first batch (%d tokens)\n",
                out.size(), n_first);
        return false;
    }
    const int32_t n_pin = llama_locret_query_tokens(vocab, out.data(), (int32_t) out.size(), query.c_str(), (int32_t) out.size());
    if (n_pin < 0 || llama_locret_pin_query(ctx, 0, n_pin) != 0) {
        fprintf(stderr, "llama-bench: Locret-Q: %s\n", llama_locret_last_error());
        return false;
    }
    return true;
}

void locret_bench_timer::start(const llama_context * ctx) {
    const llama_locret_stats s = llama_locret_get_stats(ctx);
    start_us[0] = s.t_select_us;
    start_us[1] = s.t_compact_us;
    start_us[2] = s.t_readback_us;
    const uint64_t now[5] = { s.n_rows_moved, s.n_rows_rotated, s.n_rows_kept, s.n_host_syncs, s.n_compactions };
    std::copy(now, now + 5, start_rows);
}

void locret_bench_timer::stop(const llama_context * ctx) {
    const llama_locret_stats s = llama_locret_get_stats(ctx);
    us[0] += s.t_select_us   - start_us[0];
    us[1] += s.t_compact_us  - start_us[1];
    us[2] += s.t_readback_us - start_us[2];
    const uint64_t now[5] = { s.n_rows_moved, s.n_rows_rotated, s.n_rows_kept, s.n_host_syncs, s.n_compactions };
    for (int i = 0; i < 5; ++i) {
        rows[i] += now[i] - start_rows[i];
    }
}

void locret_bench_timer::report(const llama_context * ctx, const std::vector<uint64_t> & samples_ns) const {
    if (llama_locret_is_evicting(ctx)) {
        uint64_t total_ns = 0;
        for (uint64_t ns : samples_ns) {
            total_ns += ns;
        }
        const double total_ms = total_ns / 1e6;
        const double spent_ms = (us[0] + us[1] + us[2]) / 1e3;
        fprintf(stderr, "locret: eviction time: select %.1f ms, compaction %.1f ms, read-back %.1f ms: "
                "%.1f ms of %.1f ms timed (%.2f %%)\n", us[0] / 1e3, us[1] / 1e3, us[2] / 1e3,
                spent_ms, total_ms, total_ms > 0 ? 100.0 * spent_ms / total_ms : 0.0);
        // what the evictions of the timed runs cost in rows (one per layer, KV head and unit) and host round trips
        fprintf(stderr, "locret: eviction rows: moved %llu, rotated %llu, kept %llu (moved / kept %.3f); host syncs "
                "%llu in %llu compactions\n", (unsigned long long) rows[0], (unsigned long long) rows[1],
                (unsigned long long) rows[2], rows[2] > 0 ? (double) rows[0] / rows[2] : 0.0,
                (unsigned long long) rows[3], (unsigned long long) rows[4]);
    }
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        if (ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_GPU) {
            continue;
        }
        size_t free = 0, total = 0;
        ggml_backend_dev_memory(dev, &free, &total);
        fprintf(stderr, "locret: device memory: %s %.1f MiB in use of %.1f MiB\n", ggml_backend_dev_name(dev),
                (total - free) / 1024.0 / 1024.0, total / 1024.0 / 1024.0);
    }
}
