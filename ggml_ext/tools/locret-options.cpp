// The Locret options of the llama.cpp tools: one table, read by common's parser (locret-common.cpp) and llama-bench's
// (locret-bench.cpp).

#include "locret-options.h"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <vector>

llama_locret_params locret_options::params() const {
    llama_locret_params p = llama_locret_params_default();
    p.budget          = budget < 0 ? 0 : budget;
    p.stabilizers     = stabilizers;
    p.local           = local;
    p.policy          = policy;
    p.pool            = pool;
    p.policy_settings = policy_settings.c_str();
    p.budget_schedule = budget_schedule.empty() ? nullptr : budget_schedule.c_str();
    p.positions       = positions;
    p.position_limit  = position_limit;
    return p;
}

// a whole number, all of `value` (a trailing word or an overflow is an error, not a silent truncation)
static int32_t locret_parse_int(const char * option, const std::string & value) {
    char * end = nullptr;
    errno = 0;
    const long long v = std::strtoll(value.c_str(), &end, 10);
    if (value.empty() || *end != '\0' || errno != 0 || v < INT32_MIN || v > INT32_MAX) {
        throw std::invalid_argument(std::string(option) + ": '" + value + "' is not a whole number");
    }
    return (int32_t) v;
}

// a size in MiB: a positive number, all of `value` (its upper bound is the rule book's: llama_locret_budget_for_mib)
static double locret_parse_mib(const char * option, const std::string & value) {
    char * end = nullptr;
    errno = 0;
    const double v = std::strtod(value.c_str(), &end);
    if (value.empty() || *end != '\0' || errno != 0 || !(v > 0.0)) {
        throw std::invalid_argument(std::string(option) + ": '" + value + "' is not a size in MiB (a number above 0)");
    }
    return v;
}

static std::string locret_query_checked(const char * option, const std::string & text) {
    if (text.find_first_not_of(" \t\r\n") == std::string::npos) {
        throw std::invalid_argument(std::string(option) + ": the query is empty");
    }
    return text;
}

static std::vector<locret_option> locret_make_options() {
    return {
        { "--locret-heads", "FNAME", "LLAMA_ARG_LOCRET_HEADS",
          "Locret retaining heads (GGUF made by convert/heads_to_gguf.py) that score every KV unit;\n"
          "default: the heads embedded in the model file, if any",
          [](locret_options & o, const std::string & v) { o.heads = v; } },
        { "--locret-budget", "N", "LLAMA_ARG_LOCRET_BUDGET",
          "Locret: evict the KV cache to the N units per layer and KV head that the retaining heads score highest;\n"
          "KV memory then holds N + ubatch cells whatever -c is, and -c becomes the limit on logical positions\n"
          "(default: no eviction)",
          [](locret_options & o, const std::string & v) { o.budget = locret_parse_int("--locret-budget", v); } },
        { "--locret-budget-mib", "MIB", "LLAMA_ARG_LOCRET_BUDGET_MIB",
          "Locret: the budget as memory: the largest --locret-budget whose KV cache (budget and ubatch cells, the\n"
          "window layers' cache and the F32 scores) fits MIB MiB per sequence (slot) for this model, its K/V types\n"
          "and the schedule; logged at start-up with the units it resolves to (default: not used)",
          [](locret_options & o, const std::string & v) { o.budget_mib = locret_parse_mib("--locret-budget-mib", v); } },
        { "--locret-stabilizers", "N", "LLAMA_ARG_LOCRET_STABILIZERS",
          "Locret: last units of each prefill chunk that are always kept (at most -ub, below the budget;\n"
          "default: the heads file's value, else 2500, fitted to the ubatch and half the budget)",
          [](locret_options & o, const std::string & v) { o.stabilizers = locret_parse_int("--locret-stabilizers", v); } },
        { "--locret-local", "N", "LLAMA_ARG_LOCRET_LOCAL",
          "Locret: last prompt tokens processed after the compression and never evicted with it\n"
          "(at most -ub; default: the heads file's value, else 100)",
          [](locret_options & o, const std::string & v) { o.local = locret_parse_int("--locret-local", v); } },
        { "--locret-policy", "NAME[:KEY=N,...]", "LLAMA_ARG_LOCRET_POLICY", llama_locret_policies_help(),
          [](locret_options & o, const std::string & v) {
              const char * settings = nullptr;
              if (llama_locret_policy_from_spec(v.c_str(), &o.policy, &settings) != 0) {
                  throw std::invalid_argument(llama_locret_last_error());
              }
              o.policy_settings = settings;
          } },
        { "--locret-draft-budget", "N", "LLAMA_ARG_LOCRET_DRAFT_BUDGET",
          "Locret: with a draft model (-md, --spec-type draft-simple), the draft context's own budget: it evicts\n"
          "in a cache of N + ubatch cells too (default: --locret-budget)",
          [](locret_options & o, const std::string & v) { o.draft_budget = locret_parse_int("--locret-draft-budget", v); } },
        { "--locret-draft-policy", "NAME", "LLAMA_ARG_LOCRET_DRAFT_POLICY",
          "Locret: the draft context's policy (default: heads when --locret-draft-heads is given or the draft\n"
          "model embeds heads, else streaming: sinks and the newest units, which needs none)",
          [](locret_options & o, const std::string & v) {
              llama_locret_policy p;
              if (llama_locret_policy_from_name(v.c_str(), &p) != 0) {
                  throw std::invalid_argument(llama_locret_last_error());
              }
              o.draft_policy = (int32_t) p;
          } },
        { "--locret-draft-heads", "FNAME", "LLAMA_ARG_LOCRET_DRAFT_HEADS",
          "Locret: retaining heads for the draft model (default: the heads embedded in the draft model, if any)",
          [](locret_options & o, const std::string & v) { o.draft_heads = v; } },
        { "--locret-pool", "N", "LLAMA_ARG_LOCRET_POOL",
          "Locret: score each unit by the mean of the heads' scores over the N tokens around it (odd, at most -ub),\n"
          "so that a sentence or a number tends to be kept whole rather than a few of its tokens; needs\n"
          "--locret-budget; 0: none (default: the heads file's recommended window, else none, the paper's Locret)",
          [](locret_options & o, const std::string & v) { o.pool = locret_parse_int("--locret-pool", v); } },
        // a knob of one policy is that policy's setting now: the old option names the new form
        { "--locret-lag", "N", "LLAMA_ARG_LOCRET_LAG",
          "Locret: replaced by --locret-policy lagkv:lag=N (refused)",
          [](locret_options &, const std::string &) {
              throw std::invalid_argument("--locret-lag is gone: LagKV's partition is a setting of its policy, "
                      "--locret-policy lagkv:lag=N");
          } },
        { "--locret-budget-schedule", "uniform|pyramid|FILE", "LLAMA_ARG_LOCRET_BUDGET_SCHEDULE",
          "Locret: how the budget is spread over the evicting layers: uniform (each keeps --locret-budget), pyramid\n"
          "(PyramidKV: the first layer about 2b, the last b/20 (at least the stabilizers + 1), linear between) or a\n"
          "FILE of per-layer budgets (one whole number per evicting layer) summing to the budget times the layers;\n"
          "the KV cache is sized for the largest layer budget; heads, random and streaming policies (default: uniform)",
          [](locret_options & o, const std::string & v) { o.budget_schedule = v; } },
        { "--locret-positions", "inplace|compact|keep[:N]", "LLAMA_ARG_LOCRET_POSITIONS",
          "Locret: where kept units sit. inplace: positions 0..n-1 after every eviction, each unit re-rotated in its\n"
          "cell and the chunk's survivors copied into the holes (what compact gives the model, a chunk of rows moved);\n"
          "compact: the same positions with the units moved to cells 0..n-1 (the paper's layout; moves nearly every\n"
          "row); keep: each unit keeps the position it was read at and the survivors fill the holes (none\n"
          "re-rotated), positions compacted only when they would reach N (default: the model's trained context).\n"
          "inplace and keep: heads, random and streaming policies (default: the heads file's recommendation where it\n"
          "applies, else inplace for those, else compact)",
          [](locret_options & o, const std::string & v) {
              if (llama_locret_positions_parse(v.c_str(), &o.positions, &o.position_limit) != 0) {
                  throw std::invalid_argument(llama_locret_last_error());
              }
          } },
        { "--locret-query", "TEXT|auto|off", nullptr,
          "Locret-Q: a question placed at the start of the prompt (of the first user turn with a chat template),\n"
          "then a blank line; its tokens are never evicted and count in the budget, so every eviction sees it.\n"
          "auto: the question at the end of the prompt (in a chat: of the last user message), found by a written\n"
          "rule (docs/locret-q.md); without one, plain Locret; off: no query. Use retaining heads trained for it\n"
          "(heads/*.query.gguf); needs --locret-budget (default: auto with heads that recommend it, else off)",
          [](locret_options & o, const std::string & v) {
              o.query_auto = v == "auto";
              o.query_off  = v == "off";
              o.query      = o.query_auto || o.query_off ? std::string() : locret_query_checked("--locret-query", v);
          } },
        { "--locret-requery", "on|off", "LLAMA_ARG_LOCRET_REQUERY",
          "Locret-Q auto in llama-server's chats: on, a follow-up's question is pinned in place of the first, so the\n"
          "whole conversation is read again for it (the cost is logged); off, the conversation's first question stays\n"
          "pinned and a follow-up reads only its new tokens, answered from what the first question's eviction kept\n"
          "(default: on)",
          [](locret_options & o, const std::string & v) {
              if (v != "on" && v != "off") {
                  throw std::invalid_argument("--locret-requery: expected on or off, got '" + v + "'");
              }
              o.requery = v == "on";
          } },
        { "--locret-query-file", "FNAME", nullptr,
          "Locret-Q: --locret-query read from a file",
          [](locret_options & o, const std::string & v) {
              std::ifstream file(v, std::ios::binary);
              if (!file) {
                  throw std::invalid_argument("--locret-query-file: cannot read '" + v + "'");
              }
              const std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
              o.query      = locret_query_checked("--locret-query-file", text);
              o.query_auto = false;
              o.query_off  = false;
          } },
    };
}

static const std::vector<locret_option> & locret_options_table() {
    static const std::vector<locret_option> table = locret_make_options();
    return table;
}

size_t locret_option_count() {
    return locret_options_table().size();
}

const locret_option & locret_option_at(size_t i) {
    return locret_options_table().at(i);
}

const locret_option * locret_option_find(const std::string & name) {
    for (const locret_option & o : locret_options_table()) {
        if (name == o.name) {
            return &o;
        }
    }
    return nullptr;
}

std::string locret_options_configure(const locret_options & o, llama_model * model, const std::string & model_path,
        llama_locret_heads ** heads) {
    llama_locret_params p = o.params();
    p.budget = o.budget; // -1: no --locret-budget (params() reads it as no eviction)
    if (llama_locret_configure_default(model, model_path.c_str(), o.heads.c_str(), &p, heads) != 0) {
        return llama_locret_last_error();
    }
    return "";
}

// a string from a C function that, like snprintf, returns the length it needs when given no buffer
template <typename F>
static std::string locret_string_from(F && write) {
    const int32_t n = write(nullptr, 0);
    std::string out((size_t) n, '\0');
    write(out.data(), n + 1);
    return out;
}

std::string locret_find_question(const std::string & text) {
    return locret_string_from([&](char * out, int32_t n_out) {
        return llama_locret_find_question(text.c_str(), out, n_out);
    });
}

std::string locret_find_prompt_question(const llama_vocab * vocab, const std::string & prompt) {
    return locret_string_from([&](char * out, int32_t n_out) {
        return llama_locret_find_prompt_question(vocab, prompt.c_str(), out, n_out);
    });
}

std::string locret_prompt_layout(const llama_vocab * vocab, const std::string & query, const std::string & prompt) {
    return locret_string_from([&](char * out, int32_t n_out) {
        return llama_locret_prompt_layout(vocab, query.c_str(), prompt.c_str(), out, n_out);
    });
}

std::string locret_options_resolve_mib(locret_options & o, const std::string & model_path,
        const llama_context_params & cparams, std::string * resolved) {
    if (o.budget_mib <= 0) {
        return "";
    }
    if (o.budget >= 0) {
        return "give --locret-budget (units) or --locret-budget-mib (memory), not both";
    }
    const llama_locret_params p = o.params();
    llama_locret_resolved r;
    const int32_t budget = llama_locret_budget_for_mib(model_path.c_str(), o.heads.c_str(), &p, &cparams, o.budget_mib, &r);
    if (budget < 0) {
        return std::string("--locret-budget-mib: ") + llama_locret_last_error();
    }
    o.budget = budget;
    if (resolved != nullptr) {
        const double mib = 1024.0 * 1024.0;
        char line[512];
        snprintf(line, sizeof(line), "Locret: --locret-budget-mib %g resolves to a budget of %d units: %u KV cells per "
                "sequence, %.2f MiB per sequence (K/V %.2f MiB, window cache %.2f MiB, scores %.2f MiB)", o.budget_mib,
                budget, r.n_cells, (r.kv_bytes + r.window_bytes + r.store_bytes) / mib, r.kv_bytes / mib,
                r.window_bytes / mib, r.store_bytes / mib);
        *resolved = line;
    }
    return "";
}

std::string locret_query_layout(const std::string & query, const std::string & text) {
    return locret_string_from([&](char * out, int32_t n_out) {
        return llama_locret_query_layout(query.c_str(), text.c_str(), out, n_out);
    });
}

std::string locret_error_suffix() {
    const char * why = llama_locret_last_error();
    return why[0] != '\0' ? std::string(": ") + why : std::string();
}
