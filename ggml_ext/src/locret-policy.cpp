// The policy registry: one row per policy, read by name lookup, the tools' help, Python's list and the rules.

#include "locret-policy.h"
#include "locret-heads.h"
#include "locret-compact.h"
#include "locret-settings.h"

#include "llama-impl.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

// in enum order: row i is policy i
static const locret_policy_entry LOCRET_POLICY_TABLE[] = {
    //  id                             name         help                                                          heads  schedule factory
    { LLAMA_LOCRET_POLICY_HEADS,     "heads",     "the retaining heads' causal importance scores (Locret)",        true,  true,  locret_policy_make_heads     },
    { LLAMA_LOCRET_POLICY_RANDOM,    "random",    "a fixed pseudo-random score per unit (the paper's ablation)",  false, true,  locret_policy_make_random    },
    { LLAMA_LOCRET_POLICY_STREAMING, "streaming", "StreamingLLM: the first 4 positions, then the most recent",    false, true,  locret_policy_make_streaming },
    { LLAMA_LOCRET_POLICY_LAGKV,     "lagkv",     "LagKV: partitions scored against the next one's K/V ranges",   false, false, locret_policy_make_lagkv     },
    { LLAMA_LOCRET_POLICY_SAGE,      "sage",      "SAGE-KV: the prompt read whole, then one selection by the "
                                                  "attention of its last token",                                  false, false, locret_policy_make_sage      },
    { LLAMA_LOCRET_POLICY_SNAPKV,    "snapkv",    "SnapKV per chunk: the attention of each part's last queries",   false, false, locret_policy_make_snapkv    },
};

size_t locret_policy_count() {
    return sizeof(LOCRET_POLICY_TABLE) / sizeof(LOCRET_POLICY_TABLE[0]);
}

const locret_policy_entry & locret_policy_at(size_t i) {
    return LOCRET_POLICY_TABLE[i];
}

const locret_policy_entry * locret_policy_find(llama_locret_policy id) {
    const size_t i = (size_t) id;
    return i < locret_policy_count() && LOCRET_POLICY_TABLE[i].id == id ? &LOCRET_POLICY_TABLE[i] : nullptr;
}

std::unique_ptr<locret_policy> locret_policy_make(llama_locret_policy id) {
    const locret_policy_entry * e = locret_policy_find(id);
    return e != nullptr ? e->make() : nullptr;
}

//
// a policy's own settings: "key=value[,key=value...]" against its knob table
//

static std::string locret_knob_keys(const std::vector<locret_policy_knob> & knobs) {
    std::string keys;
    for (const locret_policy_knob & k : knobs) {
        keys += std::string(keys.empty() ? "" : ", ") + k.key;
    }
    return keys;
}

// one "key=value" of policy e into v; "" or the refusal
static std::string locret_policy_setting_parse(const locret_policy_entry & e, const std::vector<locret_policy_knob> & knobs,
        const std::string & item, locret_policy_values & v) {
    const size_t eq = item.find('=');
    if (eq == std::string::npos || eq == 0) {
        return format("policy settings are key=value pairs separated by commas (got '%s')", item.c_str());
    }
    const std::string key = item.substr(0, eq);
    const std::string val = item.substr(eq + 1);
    if (knobs.empty()) {
        return format("policy %s has no settings (got '%s')", e.name, item.c_str());
    }
    size_t i = 0;
    while (i < knobs.size() && key != knobs[i].key) {
        ++i;
    }
    if (i == knobs.size()) {
        return format("policy %s has no setting '%s' (its settings: %s)", e.name, key.c_str(),
                locret_knob_keys(knobs).c_str());
    }
    if (v.given & (1u << i)) {
        return format("%s:%s is given twice", e.name, key.c_str());
    }
    const locret_policy_knob & k = knobs[i];
    char * end = nullptr;
    errno = 0;
    const long x = val.empty() ? 0 : std::strtol(val.c_str(), &end, 10);
    if (val.empty() || *end != '\0' || errno != 0 || x < k.min || x > k.max) {
        return format("%s:%s must be an integer from %d to %d (got '%s')", e.name, key.c_str(), k.min, k.max, val.c_str());
    }
    v.value[i] = (int32_t) x;
    v.given   |= 1u << i;
    return "";
}

bool locret_policy_settings_parse(const locret_policy_entry & e, const char * text, locret_policy_values & out,
        std::string & err) {
    const std::vector<locret_policy_knob> knobs = e.make()->knobs();
    GGML_ASSERT(knobs.size() <= locret_policy_values::MAX);
    out = {};
    out.n = (uint32_t) knobs.size();
    for (size_t i = 0; i < knobs.size(); ++i) {
        out.value[i] = knobs[i].def;
    }
    const std::string s = text != nullptr ? text : "";
    // every item between commas, an empty one included ("k=4," is a mistake, not "k=4")
    for (size_t at = 0; !s.empty(); ) {
        const size_t comma = std::min(s.find(',', at), s.size());
        err = locret_policy_setting_parse(e, knobs, s.substr(at, comma - at), out);
        if (!err.empty()) {
            return false;
        }
        if (comma == s.size()) {
            break;
        }
        at = comma + 1;
    }
    return true;
}

std::string locret_policy_settings_str(const locret_policy_entry & e, const locret_policy_values & v) {
    const std::vector<locret_policy_knob> knobs = e.make()->knobs();
    std::string out;
    for (size_t i = 0; i < knobs.size() && i < v.n; ++i) {
        out += format("%s%s=%d", out.empty() ? "" : ",", knobs[i].key, v.value[i]);
    }
    return out;
}

std::string locret_policy_settings_mismatch(const locret_policy_entry & e, uint32_t saved_version,
        const std::vector<int32_t> & saved, const locret_policy_values & cur) {
    const std::unique_ptr<locret_policy> pol = e.make();
    if (saved_version != pol->settings_version() || saved.size() != cur.n) {
        return format("the saved state's %s settings are of layout %u with %zu values, this build's of layout %u with %u",
                e.name, saved_version, saved.size(), pol->settings_version(), cur.n);
    }
    if (!std::equal(saved.begin(), saved.end(), cur.value)) {
        locret_policy_values was = cur;
        std::copy(saved.begin(), saved.end(), was.value);
        return format("the saved state was made with policy settings %s, this context's are %s",
                locret_policy_settings_str(e, was).c_str(), locret_policy_settings_str(e, cur).c_str());
    }
    return "";
}

bool locret_queries_captured(const locret_policy_env & env, const char * title) {
    for (size_t i = 0; i < env.layers.size(); ++i) {
        if (std::isnan(env.query_scale[i])) {
            locret_set_error(format("%s: the queries of layer %u were never captured (this model's attention does not "
                    "go through the hooked build_attn); use another policy", title, env.layers[i].il));
            LLAMA_LOG_ERROR("%s: Locret: %s\n", __func__, llama_locret_last_error());
            return false;
        }
    }
    return true;
}

int32_t llama_locret_policy_count(void) {
    return (int32_t) locret_policy_count();
}

const char * llama_locret_policy_name(enum llama_locret_policy policy) {
    const locret_policy_entry * e = locret_policy_find(policy);
    return e != nullptr ? e->name : nullptr;
}

const char * llama_locret_policy_help(enum llama_locret_policy policy) {
    const locret_policy_entry * e = locret_policy_find(policy);
    return e != nullptr ? e->help : nullptr;
}

const char * llama_locret_policies_help(void) {
    static const std::string text = [] {
        std::string t = "Locret: what scores the units that eviction keeps (needs --locret-budget; default: heads):";
        for (size_t i = 0; i < locret_policy_count(); ++i) {
            const locret_policy_entry & e = LOCRET_POLICY_TABLE[i];
            t += format("\n%s: %s%s", e.name, e.help, e.needs_heads ? "" : " (no heads needed)");
            const char * settings = llama_locret_policy_settings_help(e.id);
            if (settings[0] != '\0') {
                t += format("\n    %s:%s", e.name, settings);
            }
        }
        return t;
    }();
    return text.c_str();
}

int32_t llama_locret_policy_from_name(const char * name, enum llama_locret_policy * out) {
    locret_set_error("");
    std::string valid;
    for (size_t i = 0; i < locret_policy_count(); ++i) {
        const locret_policy_entry & e = LOCRET_POLICY_TABLE[i];
        if (name != nullptr && std::strcmp(name, e.name) == 0) {
            *out = e.id;
            return 0;
        }
        valid += std::string(valid.empty() ? "" : ", ") + e.name;
    }
    locret_set_error(format("unknown Locret policy '%s'; valid policies: %s", name ? name : "(null)", valid.c_str()));
    return -1;
}

int32_t llama_locret_policy_from_spec(const char * spec, enum llama_locret_policy * out, const char ** settings) {
    locret_set_error("");
    if (spec == nullptr) {
        return llama_locret_policy_from_name(nullptr, out);
    }
    const char * colon = std::strchr(spec, ':');
    const std::string name = colon != nullptr ? std::string(spec, colon - spec) : std::string(spec);
    llama_locret_policy id;
    if (llama_locret_policy_from_name(name.c_str(), &id) != 0) {
        return -1;
    }
    const char * rest = colon != nullptr ? colon + 1 : "";
    locret_policy_values v;
    std::string err;
    if (!locret_policy_settings_parse(*locret_policy_find(id), rest, v, err)) {
        locret_set_error(err);
        return -1;
    }
    *out      = id;
    *settings = rest;
    return 0;
}

const char * llama_locret_policy_settings_help(enum llama_locret_policy policy) {
    static const std::vector<std::string> text = [] {
        std::vector<std::string> t;
        for (size_t i = 0; i < locret_policy_count(); ++i) {
            std::string line;
            for (const locret_policy_knob & k : LOCRET_POLICY_TABLE[i].make()->knobs()) {
                line += format("%s%s=N: %s (%d-%d; default %d)", line.empty() ? "" : "; ", k.key, k.help, k.min, k.max,
                        k.def);
            }
            t.push_back(line);
        }
        return t;
    }();
    const locret_policy_entry * e = locret_policy_find(policy);
    return e != nullptr ? text[(size_t) policy].c_str() : nullptr;
}

int32_t llama_locret_policy_get_traits(enum llama_locret_policy policy, struct llama_locret_policy_traits * out) {
    locret_set_error("");
    const locret_policy_entry * e = locret_policy_find(policy);
    if (e == nullptr) {
        locret_set_error(format("unknown Locret policy %d", (int) policy));
        return -1;
    }
    const std::unique_ptr<locret_policy> pol = e->make();
    out->needs_heads          = e->needs_heads;
    out->per_layer_budgets    = e->per_layer_budgets;
    out->reads_prompt_whole   = pol->reads_prompt_whole();
    out->sets_own_stabilizers = pol->sets_own_stabilizers();
    out->pools_scores         = pol->pools_scores();
    out->reads_cells_in_order = pol->reads_cells_in_order();
    out->takes_pinned_query   = pol->pin_problem().empty();
    out->has_settings         = !pol->knobs().empty();
    return 0;
}
