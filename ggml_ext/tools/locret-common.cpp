// Locret in llama.cpp's common library: the options (from the one table), the refusals of features an evicting cache
// cannot serve, -fit's sizing, the configuration before the context, and Locret-Q.

#include "locret-common.h"
#include "locret-server.h"

#include "arg.h"
#include "common.h"
#include "log.h"

#include <algorithm>
#include <utility>

// common_arg takes plain function pointers: one instantiation per row of the option table
static constexpr size_t LOCRET_MAX_OPTIONS = 24;

template <size_t I>
static void locret_set_option(common_params & params, const std::string & value) {
    locret_option_at(I).set(params.locret, value);
}

template <size_t... I>
static std::vector<common_arg> locret_make_args(std::index_sequence<I...>) {
    using setter = void (*)(common_params &, const std::string &);
    static const setter setters[] = { locret_set_option<I>... };
    GGML_ASSERT(locret_option_count() <= sizeof...(I) && "raise LOCRET_MAX_OPTIONS");
    std::vector<common_arg> args;
    for (size_t i = 0; i < locret_option_count(); ++i) {
        const locret_option & o = locret_option_at(i);
        common_arg arg({ o.name }, o.value_hint, o.help, setters[i]);
        if (o.env != nullptr) {
            arg.set_env(o.env);
        }
        args.push_back(std::move(arg));
    }
    return args;
}

std::vector<common_arg> locret_common_args() {
    return locret_make_args(std::make_index_sequence<LOCRET_MAX_OPTIONS>());
}

static void locret_stop(const std::string & reason) {
    LOG_ERR("Locret: %s\n", reason.c_str());
    // the tools exit right after this: make sure the reason reaches the user
    common_log_flush(common_log_main());
}

std::string locret_common_speculation_refused(const common_params & params) {
    const locret_options & o = params.locret;
    if (o.budget < 0) {
        return "";
    }
    // the n-gram kinds draft from the tokens read so far and need no second cache; a standalone draft model
    // (draft-simple) reads the same tokens into a context of its own, which evicts in its own bounded cache
    // (locret_common_configure_draft). The server caps each draft at the room before the next eviction of both caches
    // (llama_locret_seq_room), so rejected tokens are always their newest and removable, and the target evicts exactly
    // where it does without speculation. The other draft kinds read the target's hidden states or share its cache.
    bool any = false;
    for (const auto t : params.speculative.types) {
        const bool is_ngram = t == COMMON_SPECULATIVE_TYPE_NGRAM_SIMPLE || t == COMMON_SPECULATIVE_TYPE_NGRAM_MAP_K ||
                              t == COMMON_SPECULATIVE_TYPE_NGRAM_MAP_K4V || t == COMMON_SPECULATIVE_TYPE_NGRAM_MOD ||
                              t == COMMON_SPECULATIVE_TYPE_NGRAM_CACHE;
        if (t != COMMON_SPECULATIVE_TYPE_NONE && !is_ngram && t != COMMON_SPECULATIVE_TYPE_DRAFT_SIMPLE) {
            return "speculative decoding with --spec-type draft-eagle3, draft-mtp, draft-dflash or draft-dspark cannot "
                   "be used with --locret-budget: those drafts read the target's hidden states or share its KV cache, "
                   "which evicts; a draft model (-md with --spec-type draft-simple) and the n-gram kinds work";
        }
        any = any || t != COMMON_SPECULATIVE_TYPE_NONE;
    }
    if (any && o.policy == LLAMA_LOCRET_POLICY_SAGE) {
        return "speculative decoding cannot be used with --locret-policy sage: SAGE-KV selects once at a prompt's end, "
               "and a verification batch of several tokens reads as one";
    }
    return "";
}

// the draft model's budget and policy (its defaults: the target's budget; heads when it has heads, else streaming)
static llama_locret_params locret_draft_params(const locret_options & o, const std::string & draft_path) {
    llama_locret_params p = llama_locret_params_default();
    p.budget = o.draft_budget > 0 ? o.draft_budget : o.budget;
    p.policy = (llama_locret_policy) o.draft_policy;
    if (o.draft_policy < 0) {
        llama_locret_settings rec;
        const bool has_heads = !o.draft_heads.empty() || llama_locret_file_recommended(draft_path.c_str(), &rec) == 1;
        p.policy = has_heads ? LLAMA_LOCRET_POLICY_HEADS : LLAMA_LOCRET_POLICY_STREAMING;
    }
    return p;
}

void locret_common_fit_draft(const common_params & params_dft, llama_context_params & cparams_dft) {
    const locret_options & o = params_dft.locret;
    if (o.budget <= 0) {
        return;
    }
    // -fit plans the draft's memory for the cells its own cache holds, as the target's
    const llama_locret_params p = locret_draft_params(o, params_dft.model.path);
    const int64_t n_cells = llama_locret_fit_n_ctx(params_dft.model.path.c_str(), o.draft_heads.c_str(), &p, &cparams_dft);
    if (n_cells > 0) {
        cparams_dft.n_ctx = (uint32_t) n_cells;
    }
}

bool locret_common_configure_draft(const common_params & params, llama_model * model_dft, locret_heads_ptr & heads) {
    heads.reset();
    const locret_options & o = params.locret;
    if (o.budget <= 0) {
        return true; // the target keeps every token: so does its draft, as in llama.cpp
    }
    // params is the draft's copy (common_base_params_to_speculative): its model is the draft model
    const std::string & path = params.model.path;
    const llama_locret_params p = locret_draft_params(o, path);
    const int32_t budget = p.budget;
    const llama_locret_policy policy = p.policy;
    llama_locret_heads * loaded = nullptr;
    const int32_t rc = llama_locret_configure_default(model_dft, path.c_str(), o.draft_heads.c_str(), &p, &loaded);
    heads.reset(loaded);
    if (rc != 0) {
        locret_stop(std::string("the draft model's cache: ") + llama_locret_last_error());
        return false;
    }
    LOG_INF("Locret: the draft model evicts in its own cache: budget %d, policy %s%s\n", budget,
            llama_locret_policy_name(policy), heads != nullptr ? " (its own heads)" : "");
    return true;
}

bool locret_common_before_load(common_params & params, llama_context_params & cparams, bool fit) {
    std::string resolved;
    const std::string mib_failed = locret_options_resolve_mib(params.locret, params.model.path, cparams, &resolved);
    if (!mib_failed.empty()) {
        locret_stop(mib_failed);
        return false;
    }
    if (!resolved.empty()) {
        LOG_INF("%s\n", resolved.c_str());
    }
    const locret_options & o = params.locret;
    if (o.budget < 0) {
        return true;
    }
    // these features move or reuse positions of a cache that keeps every token; an evicting cache has compacted
    // them, so they are refused rather than silently ignored
    const char * refused = params.ctx_shift         ? "--context-shift" :
                           params.n_keep != 0       ? "--keep" :
                           params.n_cache_reuse > 0 ? "--cache-reuse" : nullptr;
    if (refused != nullptr) {
        locret_stop(string_format("%s cannot be used with --locret-budget: the evicting cache compacts positions, so "
                "there is no context to shift or reuse", refused));
        return false;
    }
    const std::string spec_refused = locret_common_speculation_refused(params);
    if (!spec_refused.empty()) {
        locret_stop(spec_refused);
        return false;
    }
    if (!fit || o.budget == 0) {
        return true;
    }
    // -fit plans memory for the cells the cache holds (the rule book's count), whatever -c is
    const llama_locret_params p = o.params();
    const int64_t n_cells = llama_locret_fit_n_ctx(params.model.path.c_str(), o.heads.c_str(), &p, &cparams);
    if (n_cells < 0) {
        locret_stop(llama_locret_last_error());
        return false;
    }
    LOG_TRC("Locret: fitting with %u KV cells instead of -c %u\n", (uint32_t) n_cells, cparams.n_ctx);
    cparams.n_ctx = (uint32_t) n_cells;
    return true;
}

void locret_common_after_fit(const common_params & params, uint32_t n_ctx_asked, llama_context_params & cparams) {
    if (params.locret.budget > 0) {
        cparams.n_ctx = n_ctx_asked; // the limit on logical positions
    }
}

bool locret_common_configure(const common_params & params, llama_model * model, locret_heads_ptr & heads) {
    llama_locret_heads * loaded = nullptr;
    const std::string failed = locret_options_configure(params.locret, model, params.model.path, &loaded);
    heads.reset(loaded);
    if (!failed.empty()) {
        locret_stop(failed);
        return false;
    }
    if (heads != nullptr) {
        LOG_INF("attached Locret retaining heads (d_R = %d) from '%s'\n", llama_locret_heads_hidden_size(heads.get()),
                params.locret.heads.empty() ? params.model.path.c_str() : params.locret.heads.c_str());
    }
    // Locret-Q auto: asked for, or recommended by the heads when no query is given; with eviction by the heads (without
    // a budget there is nothing to pin)
    const locret_options & o = params.locret;
    const bool recommended = heads != nullptr && llama_locret_heads_recommended(heads.get()).query_auto != 0;
    o.query_auto_on = (o.query_auto || (recommended && o.query.empty() && !o.query_off)) && o.budget > 0 &&
            o.policy == LLAMA_LOCRET_POLICY_HEADS;
    if (o.query_auto_on && !o.query_auto) {
        LOG_INF("Locret-Q (auto): the heads recommend it; the question at the end of each prompt is pinned "
                "(--locret-query off turns it off)\n");
    }
    o.vocab = llama_model_get_vocab(model);
    locret_server_set_query_auto(o.query_auto_on, o.requery, o.vocab);
    return true;
}

std::string locret_common_place_query(const common_params & params, const std::string & prompt) {
    const locret_options & o = params.locret;
    if (o.query_auto_on) {
        o.query_found = locret_find_prompt_question(o.vocab, prompt);
        if (o.query_found.empty()) {
            LOG_INF("Locret-Q (auto): no question at the end of the prompt; plain Locret eviction\n");
            return prompt;
        }
        LOG_INF("Locret-Q (auto): the question at the end of the prompt goes to its start and is pinned: \"%s\"\n",
                o.query_found.c_str());
        return locret_prompt_layout(o.vocab, o.query_found, prompt);
    }
    return o.query.empty() ? prompt : locret_prompt_layout(o.vocab, o.query, prompt);
}

bool locret_common_pin_query(const common_params & params, llama_context * ctx, llama_seq_id seq_id,
        const std::vector<llama_token> & prompt) {
    const bool auto_on = params.locret.query_auto_on;
    const std::string & query = auto_on ? params.locret.query_found : params.locret.query;
    if (llama_locret_is_evicting(ctx)) {
        llama_locret_seq_prompt(ctx, seq_id, (int32_t) prompt.size()); // pooling for long prompts, decided once
    }
    if (query.empty()) {
        return true;
    }
    if (!llama_locret_is_evicting(ctx)) {
        LOG_ERR("--locret-query needs an evicting cache (--locret-budget)\n");
        return false;
    }
    const llama_vocab * vocab = llama_model_get_vocab(llama_get_model(ctx));
    const int32_t n_pin = llama_locret_query_tokens(vocab, prompt.data(), (int32_t) prompt.size(), query.c_str(),
            (int32_t) llama_locret_get_stats(ctx).budget);
    if (n_pin < 0 || llama_locret_pin_query(ctx, seq_id, n_pin) != 0) {
        if (auto_on) {
            // a question found, not asked for: one the budget cannot hold leaves plain Locret, with a warning
            LOG_WRN("Locret-Q (auto): the question is not pinned (%s); plain Locret eviction\n", llama_locret_last_error());
            return true;
        }
        LOG_ERR("--locret-query: %s\n", llama_locret_last_error());
        return false;
    }
    return true;
}
