// Locret settings: the per-model registry that the tools fill before creating a context, budget schedules, the names
// of the position layouts (policy names are in locret-policy.cpp), and the rule book: the checks a context's settings
// must pass when it is created, and its sizes (locret_config_make).

#include "locret-settings.h"
#include "locret-heads.h"
#include "locret-hooks.h"
#include "locret-policy.h"

#include "llama-cparams.h"
#include "llama-impl.h"
#include "llama-model.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>

//
// settings registered per model, consumed by the contexts created from it
//

static std::mutex                                          g_config_mutex;
static std::map<const llama_model *, llama_locret_params>  g_config;
static std::map<const llama_model *, locret_schedule_spec> g_schedule; // only schedules other than uniform
static std::map<const llama_model *, std::string>          g_policy_settings; // the caller's string, copied

struct llama_locret_params llama_locret_params_default(void) {
    llama_locret_params p;
    p.heads       = nullptr;
    p.budget      = 0;
    p.stabilizers = -1;
    p.local       = -1;
    p.policy      = LLAMA_LOCRET_POLICY_HEADS;
    p.pool        = -1;
    p.policy_settings = nullptr;
    p.budget_schedule = nullptr;
    p.defaults    = {};
    p.positions      = -1;
    p.position_limit = -1;
    return p;
}

// a setter's refusal: the reason for llama_locret_last_error() and the log, and the C API's -1
static int32_t locret_refuse(const char * fn, const std::string & err) {
    locret_set_error(err);
    LLAMA_LOG_ERROR("%s: %s\n", fn, err.c_str());
    return -1;
}

int32_t llama_locret_model_configure(struct llama_model * model, const struct llama_locret_params * params) {
    locret_set_error("");
    std::lock_guard<std::mutex> lock(g_config_mutex);
    g_schedule.erase(model); // a schedule belongs to the configuration it was set after
    if (params == nullptr || (params->budget == 0 && params->heads == nullptr)) {
        g_config.erase(model);
        return 0;
    }
    std::string err = locret_params_problem(*params);
    locret_schedule_spec schedule;
    if (err.empty() && params->heads == nullptr && params->budget > 0 && locret_policy_find(params->policy)->needs_heads) {
        err = "a Locret budget needs retaining heads (--locret-heads, or a model with embedded heads)";
    } else if (err.empty() && params->heads != nullptr && params->heads->model != model) {
        err = format("retaining heads from '%s' were loaded for another model", params->heads->path.c_str());
    }
    if (err.empty()) {
        try {
            schedule = locret_schedule_parse(params->budget_schedule);
        } catch (const std::exception & e) {
            err = e.what();
        }
    }
    if (!err.empty()) {
        return locret_refuse(__func__, err);
    }
    g_config[model] = *params;
    g_config[model].budget_schedule = nullptr; // the caller's string; its parsed form is kept below
    g_policy_settings[model] = params->policy_settings != nullptr ? params->policy_settings : "";
    g_config[model].policy_settings = g_policy_settings[model].c_str();
    if (schedule.kind != locret_schedule_spec::UNIFORM) {
        g_schedule[model] = schedule;
    }
    return 0;
}

void llama_locret_model_forget(const llama_model * model) {
    std::lock_guard<std::mutex> lock(g_config_mutex);
    g_config.erase(model);
    g_schedule.erase(model);
    g_policy_settings.erase(model);
}

//
// budget schedules
//

// the per-layer budgets of a schedule file: integers separated by blanks, commas or line ends; '#' starts a comment.
// A comment line "# model: NAME" names the model the file was made for (into *model, *has_model).
static std::vector<uint32_t> locret_read_schedule_file(const char * path, std::string * model, bool * has_model) {
    FILE * f = fopen(path, "rb");
    if (f == nullptr) {
        throw std::runtime_error(format("budget schedule '%s' is neither uniform, pyramid nor a readable file", path));
    }
    std::string text;
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof(buf), f)) > 0 && text.size() < (1u << 20)) {
        text.append(buf, n);
    }
    fclose(f);
    std::vector<uint32_t> out;
    std::string word;
    bool comment = false;
    static const char * MODEL_KEY = "# model:";
    for (size_t at = 0; at < text.size(); ) {
        const size_t eol = std::min(text.find('\n', at), text.size());
        const std::string line = text.substr(at, eol - at);
        if (line.rfind(MODEL_KEY, 0) == 0) {
            std::string name = line.substr(std::strlen(MODEL_KEY));
            const size_t b = name.find_first_not_of(" \t");
            const size_t e = name.find_last_not_of(" \t\r");
            *model     = b == std::string::npos ? "" : name.substr(b, e - b + 1);
            *has_model = true;
        }
        at = eol + 1;
    }
    auto flush = [&]() {
        if (word.empty()) {
            return;
        }
        char * end = nullptr;
        errno = 0;
        const long long v = strtoll(word.c_str(), &end, 10);
        if (*end != '\0' || errno != 0 || v < 1 || v > (1ll << 24)) {
            throw std::runtime_error(format("budget schedule file '%s': '%s' is not a budget (a whole number of units, "
                    "1 to %d)", path, word.c_str(), 1 << 24));
        }
        out.push_back((uint32_t) v);
        word.clear();
    };
    for (char c : text) {
        if (c == '\n') {
            comment = false;
        }
        if (comment || c == '#') {
            comment = true;
            flush();
            continue;
        }
        if (c == ' ' || c == '\t' || c == '\r' || c == '\n' || c == ',') {
            flush();
        } else {
            word.push_back(c);
        }
    }
    flush();
    if (out.empty()) {
        throw std::runtime_error(format("budget schedule file '%s' holds no budget (one whole number per evicting layer)", path));
    }
    return out;
}

locret_schedule_spec locret_schedule_parse(const char * schedule) {
    locret_schedule_spec spec;
    if (schedule == nullptr || schedule[0] == '\0' || std::strcmp(schedule, "uniform") == 0) {
        spec.kind = locret_schedule_spec::UNIFORM;
    } else if (std::strcmp(schedule, "pyramid") == 0) {
        spec.kind = locret_schedule_spec::PYRAMID;
    } else {
        spec.kind    = locret_schedule_spec::EXPLICIT;
        spec.budgets = locret_read_schedule_file(schedule, &spec.model, &spec.has_model);
        spec.source  = schedule;
    }
    return spec;
}

std::string locret_schedule_model_problem(const llama_model & model, const locret_schedule_spec & schedule) {
    if (schedule.kind != locret_schedule_spec::EXPLICIT || !schedule.has_model) {
        return "";
    }
    // a calibrated schedule fits one model's heads and layers
    char name[256] = "";
    if (llama_model_meta_val_str(&model, "general.name", name, sizeof(name)) < 0) {
        name[0] = '\0';
    }
    if (schedule.model == name) {
        return "";
    }
    return format("budget schedule '%s' was made for model '%s'; this model is '%s' (make one for it with locret "
            "calibrate)", schedule.source.c_str(), schedule.model.c_str(), name);
}

int32_t llama_locret_model_set_budget_schedule(struct llama_model * model, const char * schedule) {
    locret_set_error("");
    locret_schedule_spec spec;
    std::string err;
    try {
        spec = locret_schedule_parse(schedule);
    } catch (const std::exception & e) {
        err = e.what();
    }
    std::lock_guard<std::mutex> lock(g_config_mutex);
    auto it = g_config.find(model);
    if (err.empty() && spec.kind != locret_schedule_spec::UNIFORM) {
        if (it == g_config.end() || it->second.budget <= 0) {
            err = "a budget schedule spreads the Locret budget over the layers: set a budget first "
                  "(--locret-budget, llama_locret_model_configure)";
        } else {
            llama_locret_params with = it->second;
            with.budget_schedule = schedule;
            err = locret_params_problem(with);
            if (err.empty()) {
                err = locret_schedule_model_problem(*model, spec);
            }
        }
    }
    if (!err.empty()) {
        return locret_refuse(__func__, err);
    }
    if (spec.kind == locret_schedule_spec::UNIFORM) {
        g_schedule.erase(model);
    } else {
        g_schedule[model] = spec;
    }
    return 0;
}

const char * llama_locret_positions_name(llama_locret_positions mode) {
    switch (mode) {
        case LLAMA_LOCRET_POSITIONS_COMPACT: return "compact";
        case LLAMA_LOCRET_POSITIONS_KEEP:    return "keep";
        case LLAMA_LOCRET_POSITIONS_INPLACE: return "inplace";
    }
    return nullptr;
}

int32_t llama_locret_positions_parse(const char * text, int32_t * mode, int32_t * limit) {
    locret_set_error("");
    const std::string t = text == nullptr ? "" : text;
    *limit = -1;
    for (llama_locret_positions m : { LLAMA_LOCRET_POSITIONS_COMPACT, LLAMA_LOCRET_POSITIONS_KEEP,
                                      LLAMA_LOCRET_POSITIONS_INPLACE }) {
        if (t == llama_locret_positions_name(m)) {
            *mode = m;
            return 0;
        }
    }
    if (t.rfind("keep:", 0) == 0) {
        char * end = nullptr;
        errno = 0;
        const long long v = strtoll(t.c_str() + 5, &end, 10);
        if (t.size() > 5 && *end == '\0' && errno == 0 && v >= 1 && v <= INT32_MAX) {
            *mode  = LLAMA_LOCRET_POSITIONS_KEEP;
            *limit = (int32_t) v;
            return 0;
        }
    }
    locret_set_error(format("Locret positions must be compact, inplace, keep or keep:N (N the position limit, a whole "
            "number); "
            "got '%s'", t.c_str()));
    return -1;
}

int32_t llama_locret_model_set_positions(struct llama_model * model, int32_t mode, int32_t limit) {
    locret_set_error("");
    std::string err;
    std::lock_guard<std::mutex> lock(g_config_mutex);
    auto it = g_config.find(model);
    if (it == g_config.end() || it->second.budget <= 0) {
        err = "--locret-positions says where the units an eviction keeps sit: set a budget first (--locret-budget, "
              "llama_locret_model_configure)";
    } else {
        llama_locret_params with = it->second;
        with.positions      = mode;
        with.position_limit = limit;
        err = locret_params_problem(with);
        if (err.empty()) {
            it->second = with;
        }
    }
    if (!err.empty()) {
        return locret_refuse(__func__, err);
    }
    return 0;
}

locret_schedule_spec locret_schedule_find(const llama_model & model) {
    std::lock_guard<std::mutex> lock(g_config_mutex);
    auto it = g_schedule.find(&model);
    return it == g_schedule.end() ? locret_schedule_spec() : it->second;
}

bool locret_layer_evicts(const llama_hparams & hp, uint32_t il) {
    return hp.has_kv(il) && (hp.swa_type == LLAMA_SWA_TYPE_NONE || !hp.is_swa(il));
}

std::vector<uint32_t> locret_schedule_resolve(const locret_schedule_spec & spec, uint32_t n_layers, uint32_t b, uint32_t n_s,
                                              uint32_t pin_room) {
    std::vector<uint32_t> out;
    const uint64_t total = (uint64_t) n_layers * b;
    if (spec.kind == locret_schedule_spec::UNIFORM || n_layers == 0) {
        return out;
    }
    if (spec.kind == locret_schedule_spec::EXPLICIT) {
        out = spec.budgets;
        if (out.size() != n_layers) {
            throw std::runtime_error(format("budget schedule '%s' gives %zu budgets; this model evicts %u layers (one "
                    "budget each, in layer order)", spec.source.c_str(), out.size(), n_layers));
        }
        uint64_t sum = 0;
        for (uint32_t v : out) {
            sum += v;
        }
        if (sum != total) {
            throw std::runtime_error(format("budget schedule '%s' sums to %llu units; with a budget of %u over %u layers "
                    "it must sum to %llu (the same memory as the uniform budget)", spec.source.c_str(),
                    (unsigned long long) sum, b, n_layers, (unsigned long long) total));
        }
    } else {
        // PyramidKV: k_last = b/beta, k_first = 2b - k_last, linear between (its sum is n_layers * b before rounding)
        const uint32_t floor   = n_s + 1 + pin_room;
        const double   k_last  = std::max((double) b / LOCRET_PYRAMID_BETA, (double) floor);
        const double   k_first = 2.0 * b - k_last;
        if (k_first < k_last) {
            throw std::runtime_error(format("a pyramid schedule needs a budget of at least %u (the last layer keeps the "
                    "%u stabilizers%s and one unit more); got %u", floor, n_s,
                    pin_room > 0 ? format(", room for a pinned question of %u tokens (Locret-Q heads)", pin_room).c_str()
                                 : "", b));
        }
        uint64_t sum = 0;
        for (uint32_t l = 0; l < n_layers; ++l) {
            const double k = n_layers == 1 ? (double) b : k_first - (k_first - k_last) * l / (n_layers - 1);
            out.push_back((uint32_t) std::floor(k + 1e-9));
            sum += out.back();
        }
        for (uint32_t l = 0; sum < total; l = (l + 1) % n_layers) {
            out[l] += 1;
            sum += 1;
        }
        for (uint32_t l = 0; sum > total; l = (l + 1) % n_layers) { // rounding of the line itself, never more than a unit
            out[l] -= 1;
            sum -= 1;
        }
    }
    for (size_t l = 0; l < out.size(); ++l) {
        if (out[l] <= n_s) {
            throw std::runtime_error(format("budget schedule: layer %zu's budget (%u) must be larger than the stabilizers "
                    "(%u), which every layer keeps", l, out[l], n_s));
        }
    }
    return out;
}

bool locret_settings_find(const llama_model & model, llama_locret_params & out) {
    std::lock_guard<std::mutex> lock(g_config_mutex);
    auto it = g_config.find(&model);
    if (it == g_config.end()) {
        return false;
    }
    out = it->second;
    return true;
}

uint32_t locret_config::min_layer_budget() const {
    return layer_budget.empty() ? budget : *std::min_element(layer_budget.begin(), layer_budget.end());
}

uint32_t locret_kv_cells(uint32_t budget, uint32_t n_ubatch) {
    return GGML_PAD(budget + n_ubatch, 256);
}

//
// the rules
//

std::string locret_params_problem(const llama_locret_params & p) {
    const locret_policy_entry * policy = locret_policy_find(p.policy);
    if (policy == nullptr) {
        return format("unknown Locret policy %d", (int) p.policy);
    }
    if (p.budget < 0) {
        return format("the Locret budget must be at least 1 unit (got %d)", p.budget);
    }
    if (p.budget > 0 && p.stabilizers >= 0 && p.stabilizers >= p.budget) {
        return format("the Locret budget (%d) must be larger than the stabilizers (%d)", p.budget, p.stabilizers);
    }
    // pooling averages the heads' scores over a window centred on each token: an even window has no centre
    if (p.pool < -1) {
        return format("the score pooling window must be a number of tokens (got %d)", p.pool);
    }
    if (p.pool > 1 && p.pool % 2 == 0) {
        return format("the score pooling window must be odd, a window centred on each token (got %d)", p.pool);
    }
    const std::unique_ptr<locret_policy> scorer = policy->make();
    if (p.pool > 1 && !scorer->pools_scores()) {
        return format("score pooling averages a policy's scores over neighbouring units; policy %s has none to pool",
                policy->name);
    }
    locret_policy_values values;
    {
        std::string problem;
        if (!locret_policy_settings_parse(*policy, p.policy_settings, values, problem)) {
            return problem;
        }
    }
    {
        const std::string problem = scorer->params_problem(p, values);
        if (!problem.empty()) {
            return problem;
        }
    }
    if (p.positions < -1 || p.positions > LLAMA_LOCRET_POSITIONS_INPLACE) {
        return format("unknown Locret positions mode %d (compact, keep or inplace)", p.positions);
    }
    if (p.position_limit < -1) {
        return format("the Locret position limit must be a number of positions (got %d)", p.position_limit);
    }
    if ((p.positions == LLAMA_LOCRET_POSITIONS_KEEP || p.positions == LLAMA_LOCRET_POSITIONS_INPLACE) &&
            scorer->reads_cells_in_order()) {
        // the chunk's survivors fill holes anywhere in the cache: cells stop being in position order
        return format("--locret-positions %s fills the holes an eviction leaves with the chunk's units, out of position "
                "order; policy %s reads the units in position order (use compact)",
                llama_locret_positions_name((llama_locret_positions) p.positions), policy->name);
    }
    if (p.position_limit > 0 && p.positions != LLAMA_LOCRET_POSITIONS_KEEP) {
        return "a Locret position limit applies to --locret-positions keep only";
    }
    const bool scheduled = p.budget_schedule != nullptr && p.budget_schedule[0] != '\0' &&
            std::strcmp(p.budget_schedule, "uniform") != 0;
    if (scheduled && !policy->per_layer_budgets) {
        // LagKV's partitions and SAGE-KV's one selection are defined on cells every layer shares
        std::vector<std::string> names;
        for (size_t i = 0; i < locret_policy_count(); ++i) {
            if (locret_policy_at(i).per_layer_budgets) {
                names.push_back(locret_policy_at(i).name);
            }
        }
        std::string list;
        for (size_t i = 0; i < names.size(); ++i) {
            list += (i == 0 ? "" : i + 1 == names.size() ? " and " : ", ") + names[i];
        }
        return format("a budget schedule works with the %s policies, not %s", list.c_str(), policy->name);
    }
    return "";
}

llama_cparams locret_cparams_like_context(const llama_model & model, const llama_context_params & params,
        uint32_t * n_ubatch_requested) {
    // what llama_context's constructor derives from its parameters, for the fields the rules read (llama-context.cpp)
    const auto & hp = model.hparams;
    llama_cparams c = {};
    c.n_seq_max   = std::max(1u, params.n_seq_max);
    c.kv_unified  = params.kv_unified;
    c.n_ctx       = GGML_PAD(params.n_ctx == 0 ? hp.n_ctx_train : params.n_ctx, 256);
    c.n_ctx_seq   = c.kv_unified ? c.n_ctx : GGML_PAD(c.n_ctx / c.n_seq_max, 256);
    c.causal_attn = params.attention_type == LLAMA_ATTENTION_TYPE_UNSPECIFIED ? hp.causal_attn
                                                                               : params.attention_type == LLAMA_ATTENTION_TYPE_CAUSAL;
    c.n_batch     = c.causal_attn ? std::min(c.n_ctx, params.n_batch) : params.n_batch;
    c.n_ubatch    = std::min(c.n_batch, params.n_ubatch == 0 ? params.n_batch : params.n_ubatch);
    c.embeddings  = params.embeddings;
    c.pooling_type = params.pooling_type == LLAMA_POOLING_TYPE_UNSPECIFIED ?
            (hp.pooling_type == LLAMA_POOLING_TYPE_UNSPECIFIED ? LLAMA_POOLING_TYPE_NONE : hp.pooling_type) : params.pooling_type;
    const llama_rope_scaling_type scaling = params.rope_scaling_type == LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED ?
            hp.rope_scaling_type_train : params.rope_scaling_type;
    c.yarn_ext_factor  = params.yarn_ext_factor >= 0.0f ? params.yarn_ext_factor
                                                        : (scaling == LLAMA_ROPE_SCALING_TYPE_YARN ? 1.0f : 0.0f);
    c.yarn_attn_factor = params.yarn_attn_factor >= 0.0f ? params.yarn_attn_factor : hp.yarn_attn_factor;
    *n_ubatch_requested = params.n_ubatch;
    return c;
}

// an explicit setting (>= 0) must fit in one ubatch; a default (-1) is `recommended` (else `paper`) fitted to `cap`.
// Sets err (if still empty) when the explicit value does not fit.
static uint32_t locret_setting(int32_t requested, uint32_t recommended, uint32_t paper, uint32_t cap, uint32_t n_ubatch,
        const char * what, std::string & err) {
    if (requested < 0) {
        return std::min(recommended > 0 ? recommended : paper, cap);
    }
    if ((uint32_t) requested > n_ubatch && err.empty()) {
        err = format("the %s (%d) must fit in one ubatch (-ub %u)", what, requested, n_ubatch);
    }
    return (uint32_t) requested;
}

// the settings, model and context a Locret budget refuses: the first broken rule is the one reported
static void locret_check_model_and_context(const llama_hparams & hp, const llama_locret_params & p,
        const llama_cparams & cparams, uint32_t n_ubatch_requested, ggml_type type_k) {
    {
        const std::string problem = locret_params_problem(p);
        if (!problem.empty()) {
            throw std::runtime_error(problem);
        }
    }
    if (p.budget <= 0) {
        throw std::runtime_error("the Locret budget must be at least 1 unit (got 0)");
    }
    if (hp.rope_type == LLAMA_ROPE_TYPE_MROPE || hp.rope_type == LLAMA_ROPE_TYPE_IMROPE ||
            hp.rope_type == LLAMA_ROPE_TYPE_VISION) {
        throw std::runtime_error("multi-dimensional RoPE (M-RoPE) models are not supported by Locret eviction");
    }
    if (hp.n_lora_kv > 0) {
        throw std::runtime_error("models with compressed (MLA) attention are not supported by Locret eviction");
    }
    if (cparams.embeddings || cparams.pooling_type != LLAMA_POOLING_TYPE_NONE) {
        throw std::runtime_error("Locret eviction is for generation: an embeddings or pooling context would pool only "
                "the last ubatch (drop --embeddings / --pooling, or the budget)");
    }
    if (!cparams.causal_attn) {
        throw std::runtime_error("Locret eviction needs causal attention");
    }
    if (cparams.n_seq_max > 1 && cparams.kv_unified) {
        throw std::runtime_error(format("Locret eviction keeps one KV stream per sequence; %u sequences in a unified "
                "KV cache cannot be evicted separately (drop --kv-unified / -kvu)", cparams.n_seq_max));
    }
    if (type_k == GGML_TYPE_Q4_0 || type_k == GGML_TYPE_Q4_1 || type_k == GGML_TYPE_IQ4_NL) {
        // every compaction re-rotates and quantizes again the keys that move, and a key kept long moves at nearly
        // every eviction: at 4 bits the error compounds until retrieval fails (docs/memory.md); V is moved without
        // rounding and may stay 4-bit
        throw std::runtime_error(format("a %s K cache loses what it holds under repeated eviction (each move "
                "re-quantizes the key); use -ctk q8_0 (or f16) with a Locret budget; the V cache may stay %s",
                ggml_type_name(type_k), ggml_type_name(type_k)));
    }
    if (n_ubatch_requested > cparams.n_ctx) {
        throw std::runtime_error(format("the ubatch (-ub %u) is larger than the context (-c %u)", n_ubatch_requested,
                cparams.n_ctx));
    }
}

// the sliding windows Locret evicts beside: standard ones without YaRN, which the budget must cover
static void locret_check_sliding_window(const llama_hparams & hp, const llama_locret_params & p,
        const llama_cparams & cparams) {
    if (hp.swa_type == LLAMA_SWA_TYPE_NONE) {
        return;
    }
    if (hp.swa_type != LLAMA_SWA_TYPE_STANDARD) {
        throw std::runtime_error("Locret eviction supports standard sliding windows only (not chunked or symmetric "
                "ones)");
    }
    if (cparams.yarn_ext_factor != 0.0f || cparams.yarn_attn_factor != 1.0f) {
        // the window cache follows the global cache's compaction through llama.cpp's own K-shift, which scales
        // keys by the attention factor at every shift
        throw std::runtime_error("sliding-window models with YaRN or an attention factor are not supported by Locret "
                "eviction");
    }
    if ((uint32_t) p.budget < hp.n_swa) {
        throw std::runtime_error(format("with sliding-window layers the Locret budget (%d) must be at least the window "
                "(%u): the window layers keep the last %u tokens, which the compaction must not push below position 0",
                p.budget, hp.n_swa, hp.n_swa));
    }
}

// the budget, stabilizers, local length and pooling window, which must fit one ubatch, and the capacity they give
static locret_config locret_config_sizes(const llama_locret_params & p, const llama_locret_settings & rec,
        uint32_t n_ubatch) {
    const uint32_t budget = (uint32_t) p.budget;

    // defaults: the file's recommendation, else the paper's n_s = 2500 and n_loc = 100; n_s also to half the budget
    std::string err;
    const uint32_t n_s   = locret_setting(p.stabilizers, rec.stabilizers, 2500, std::min(n_ubatch, budget / 2), n_ubatch,
                                          "stabilizers", err);
    const uint32_t n_loc = locret_setting(p.local, rec.local, 100, n_ubatch, n_ubatch, "local length", err);
    if (!err.empty()) {
        throw std::runtime_error(err);
    }
    if (n_s >= budget) {
        throw std::runtime_error(format("the budget (%u) must be larger than the stabilizers (%u)", budget, n_s));
    }
    // the pooling window: given, else the one the heads were measured with when it fits the ubatch (-1: not given;
    // 0 or 1: none)
    const locret_policy_entry * entry = locret_policy_find(p.policy);
    const bool     pool_from_heads = p.pool == -1 && entry->needs_heads && rec.pool > 1 && rec.pool <= n_ubatch;
    const uint32_t pool = pool_from_heads ? rec.pool : p.pool <= 1 ? 0 : (uint32_t) p.pool;
    if (pool > n_ubatch) {
        throw std::runtime_error(format("the score pooling window (%u) must fit in one ubatch (-ub %u)", pool,
                n_ubatch));
    }

    locret_config cfg;
    cfg.heads       = p.heads;
    cfg.policy      = p.policy;
    cfg.budget      = budget;
    cfg.budget_mean = budget;
    cfg.stabilizers = n_s;
    cfg.local       = n_loc;
    cfg.pool        = pool;
    cfg.pool_from   = pool_from_heads ? rec.pool_from : 0;
    cfg.n_ubatch    = n_ubatch;
    cfg.capacity    = budget + n_ubatch;
    return cfg;
}

// the positions mode (keep, inplace or compact), refused where the model's RoPE or windows cannot take filled holes.
// Returns true when the mode is the heads file's recommendation (nobody asked for it: skipped, not refused, where it
// cannot apply)
static bool locret_config_positions(const llama_hparams & hp, const llama_locret_params & p,
        const llama_locret_settings & rec, const locret_policy & scorer, locret_config & cfg) {
    // where kept units sit: their own positions until the next part would pass the limit, or compacted at every
    // eviction (in their cells, or moved to cells in position order). Not asked for: the heads' recommendation where
    // the policy and the model take it (which layout a model reads best is measured per model), else in place where
    // they take it (the model reads what compact positions give it, and an eviction moves the chunk's
    // survivors instead of nearly every unit), else compact
    bool all_swa = hp.swa_type != LLAMA_SWA_TYPE_NONE;
    for (uint32_t il = 0; il < hp.n_layer() && all_swa; ++il) {
        all_swa = hp.is_swa(il);
    }
    const bool holes_ok = hp.rope_type != LLAMA_ROPE_TYPE_NONE && !all_swa &&
                          !scorer.reads_cells_in_order();
    const int32_t fallback = holes_ok ? LLAMA_LOCRET_POSITIONS_INPLACE : LLAMA_LOCRET_POSITIONS_COMPACT;
    const int32_t advised  = rec.positions > 0 ? (int32_t) rec.positions - 1 : -1;
    const bool    take_advice = p.positions < 0 && advised >= 0 &&
                                (advised == LLAMA_LOCRET_POSITIONS_COMPACT || holes_ok);
    const int32_t positions = p.positions >= 0 ? p.positions : take_advice ? advised : fallback;
    cfg.keep_positions  = positions == LLAMA_LOCRET_POSITIONS_KEEP;
    cfg.rotate_in_place = positions == LLAMA_LOCRET_POSITIONS_INPLACE;
    if (cfg.holes_filled()) {
        const char * mode = cfg.keep_positions ? "keep" : "inplace";
        if (hp.rope_type == LLAMA_ROPE_TYPE_NONE) {
            throw std::runtime_error(format("--locret-positions %s saves moving or re-rotating keys; this model has "
                    "no RoPE (use compact)", mode));
        }
        if (all_swa) {
            // a window masks by cell position, which a hole filled with a newer unit no longer tells
            throw std::runtime_error(format("--locret-positions %s needs full-attention layers to evict; every layer "
                    "of this model has a sliding window (use compact)", mode));
        }
    }
    if (cfg.keep_positions) {
        const uint32_t limit = p.position_limit > 0 ? (uint32_t) p.position_limit :
                               take_advice && rec.position_limit > 0 ? rec.position_limit : 0;
        cfg.position_limit = limit > 0 ? limit : hp.n_ctx_train;
    }
    return take_advice;
}

// a budget schedule's per-layer budgets, for this model only: the largest sizes the cache and sets when evictions run
static void locret_config_schedule(const llama_model & model, const locret_schedule_spec & schedule,
        const llama_locret_settings & rec, locret_config & cfg) {
    const auto & hp = model.hparams;
    if (const std::string why = locret_schedule_model_problem(model, schedule); !why.empty()) {
        throw std::runtime_error(why);
    }
    if (schedule.kind == locret_schedule_spec::UNIFORM) {
        return;
    }
    // the layers the model's own cache holds and the memory evicts: those with a KV cache, without the window
    // layers of an iSWA model (the memory's constructor checks the count); the cache is sized for the largest
    // layer budget, and evictions run when that would overflow
    uint32_t n_evicting = 0;
    for (uint32_t il = 0; il < hp.n_layer(); ++il) {
        n_evicting += locret_layer_evicts(hp, il);
    }
    // Locret-Q heads pin the question they find by default: the smallest layer keeps room for it
    const uint32_t pin_room = rec.query_auto ? LLAMA_LOCRET_PIN_ROOM : 0;
    cfg.layer_budget = locret_schedule_resolve(schedule, n_evicting, cfg.budget, cfg.stabilizers, pin_room);
    if (!cfg.layer_budget.empty()) {
        cfg.budget = *std::max_element(cfg.layer_budget.begin(), cfg.layer_budget.end());
    }
    cfg.capacity = cfg.budget + cfg.n_ubatch;
    cfg.n_cells  = locret_kv_cells(cfg.budget, cfg.n_ubatch);
}

locret_config locret_config_make(const llama_model & model, const llama_locret_params & p, const locret_schedule_spec & schedule,
        const llama_cparams & cparams, uint32_t n_ubatch_requested, ggml_type type_k) {
    const auto & hp = model.hparams;

    locret_check_model_and_context(hp, p, cparams, n_ubatch_requested, type_k);
    locret_check_sliding_window(hp, p, cparams);

    const llama_locret_settings rec = p.heads != nullptr ? llama_locret_heads_recommended(p.heads) : p.defaults;
    locret_config cfg = locret_config_sizes(p, rec, cparams.n_ubatch);

    // the policy's own settings and rules (SAGE-KV's split of the budget and its whole-prompt cache, ...)
    const std::unique_ptr<locret_policy> scorer = locret_policy_make(p.policy);
    {
        std::string err;
        if (!locret_policy_settings_parse(*locret_policy_find(p.policy), p.policy_settings, cfg.policy_values, err)) {
            throw std::runtime_error(err);
        }
        scorer->configure(p, cparams.n_ctx_seq, cfg, err);
        if (!err.empty()) {
            throw std::runtime_error(err);
        }
    }
    cfg.n_cells = GGML_PAD(cfg.capacity, 256);

    const bool advised_positions = locret_config_positions(hp, p, rec, *scorer, cfg);
    locret_config_schedule(model, schedule, rec, cfg);

    if (advised_positions && cfg.keep_positions && cfg.position_limit < cfg.capacity) {
        // the heads' kept positions cannot hold this budget below the limit: the default layout instead
        cfg.keep_positions  = false;
        cfg.rotate_in_place = true;
    }
    if (cfg.keep_positions && cfg.position_limit < cfg.capacity) {
        // after compacting positions a full cache is read at positions up to b + B
        throw std::runtime_error(format("the Locret position limit (%u) must be at least the budget plus the ubatch "
                "(%u)%s", cfg.position_limit, cfg.capacity, p.position_limit > 0 ? "" : ": the model's trained "
                "context is smaller; use compact positions"));
    }
    return cfg;
}

//
// the rule book's C API
//

int32_t llama_locret_check_params(const llama_model * model, const llama_locret_params * params,
        const llama_context_params * cparams) {
    locret_set_error("");
    if (model == nullptr || params == nullptr || cparams == nullptr) {
        locret_set_error("llama_locret_check_params: model, params and cparams must not be NULL");
        return -1;
    }
    try {
        if (params->budget == 0) {
            const std::string problem = locret_params_problem(*params);
            if (!problem.empty()) {
                throw std::runtime_error(problem);
            }
            return 0;
        }
        uint32_t n_ubatch_requested = 0;
        const llama_cparams c = locret_cparams_like_context(*model, *cparams, &n_ubatch_requested);
        locret_config_make(*model, *params, locret_schedule_parse(params->budget_schedule), c, n_ubatch_requested,
                cparams->type_k);
    } catch (const std::exception & e) {
        locret_set_error(e.what());
        return -1;
    }
    return 0;
}

int64_t llama_locret_kv_cells(const llama_model * model, const llama_locret_params * params, uint32_t n_ctx_seq,
        uint32_t n_ubatch) {
    locret_set_error("");
    if (model == nullptr || params == nullptr) {
        locret_set_error("llama_locret_kv_cells: model and params must not be NULL");
        return -1;
    }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx     = n_ctx_seq;
    cp.n_batch   = n_ubatch;
    cp.n_ubatch  = n_ubatch;
    cp.n_seq_max = 1;
    try {
        uint32_t n_ubatch_requested = 0;
        const llama_cparams c = locret_cparams_like_context(*model, cp, &n_ubatch_requested);
        return locret_config_make(*model, *params, locret_schedule_parse(params->budget_schedule), c, n_ubatch_requested,
                GGML_TYPE_F16).n_cells;
    } catch (const std::exception & e) {
        locret_set_error(e.what());
        return -1;
    }
}
