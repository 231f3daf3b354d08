// The policy registry: one row per policy, read by name lookup, the tools' help, Python's list and the rules.

#include "locret-policy.h"
#include "locret-heads.h"
#include "locret-compact.h"

#include "llama-impl.h"

#include <cmath>
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
    { LLAMA_LOCRET_POLICY_SNAPKV,    "snapkv",    "SnapKV per chunk: the attention of each part's last 32 queries", false, false, locret_policy_make_snapkv    },
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
