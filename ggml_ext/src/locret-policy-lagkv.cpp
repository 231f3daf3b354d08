// LagKV (Liang et al., 2025): attention-free scores that an eviction-time graph computes from the cached K and V
// (locret-lagkv.h) into the memory's score store. Its per-sequence state (scored_to, below): the cells [0, scored_to)
// that are sinks, pinned or scored; the later ones wait for their partition's successor (the same cells in every head:
// they are never evicted).

#include "locret-policy.h"
#include "locret-lagkv.h"
#include "locret-settings.h"

#include "llama-impl.h"

#include <algorithm>

namespace {

// LagKV's per-sequence state in the policy's words (locret_policy_state, saved in state files): word 0, the second unused
uint32_t & scored_to(locret_policy_state & st) { return st.word[0]; }
uint32_t   scored_to(const locret_policy_state & st) { return st.word[0]; }

// its settings: lagkv:lag=N, units per partition (the paper's L = 128)
enum { LAG = 0 };
const locret_policy_knob KNOBS[] = {
    { "lag", "units per partition", 128, 2, 65536 },
};

uint32_t lag_of(const locret_config & cfg) {
    return (uint32_t) cfg.policy_values.value[LAG];
}

struct locret_policy_lagkv : locret_policy {
    llama_locret_policy id() const override { return LLAMA_LOCRET_POLICY_LAGKV; }
    bool reads_cells_in_order() const override { return true; }
    bool stores_scores() const override { return true; }

    std::vector<locret_policy_knob> knobs() const override { return { std::begin(KNOBS), std::end(KNOBS) }; }

    void configure(const llama_locret_params &, uint32_t, locret_config & cfg, std::string & err) const override {
        // the budget must keep the sinks, the partitions not yet scored (fewer than two) and the stabilizers whatever
        // the scores say
        const uint32_t lag = lag_of(cfg);
        const uint64_t kept = locret_lagkv_unscored(lag) + cfg.stabilizers;
        if (kept >= cfg.budget) {
            err = format("with LagKV the budget (%u) must exceed what it keeps unscored: %u sinks + 2 partitions of %u "
                    "units + %u stabilizers = %llu (lower lagkv:lag or --locret-stabilizers, or raise the budget)",
                    cfg.budget, (unsigned) LLAMA_LOCRET_LAGKV_SINKS, lag, cfg.stabilizers, (unsigned long long) kept);
        }
    }
    uint64_t unscored_units(const locret_config & cfg) const override { return locret_lagkv_unscored(lag_of(cfg)); }
    std::string unscored_what(const locret_config & cfg) const override {
        return format("LagKV's %d sinks and 2 partitions of %u", LLAMA_LOCRET_LAGKV_SINKS, lag_of(cfg));
    }
    std::string describe(const locret_config & cfg) const override {
        return format(", lag %u, %d sinks", lag_of(cfg), LLAMA_LOCRET_LAGKV_SINKS);
    }

    size_t score_graph_nodes(size_t n_layers) const override { return locret_lagkv_n_nodes(n_layers); }
    void build_worst_score_graph(const locret_policy_env & env, ggml_context * ctx, ggml_cgraph * gf) const override {
        // a full cache after the sinks, all but its last partition scored
        const uint32_t n_part = (env.cfg.capacity - LLAMA_LOCRET_LAGKV_SINKS) / lag_of(env.cfg);
        locret_build_lagkv(ctx, gf, env.layers, env.v_trans, env.cfg.n_cells, 0, LLAMA_LOCRET_LAGKV_SINKS, n_part - 1,
                lag_of(env.cfg));
    }

    bool prepare(const locret_policy_env & env, const locret_evict_args & a, locret_policy_state & st,
                 locret_protect & out) const override {
        // score the partitions that have a complete successor now (one graph for every layer); the sinks stay like a
        // pinned prefix, the units still waiting for their successor like stabilizers (the budget was checked to hold
        // both)
        const uint32_t lag   = lag_of(env.cfg);
        uint32_t & done      = scored_to(st);
        const uint32_t start = std::max({ done, a.n_pinned, std::min<uint32_t>(LLAMA_LOCRET_LAGKV_SINKS, a.n_used) });
        const uint32_t n_part = a.n_used > start ? (a.n_used - start) / lag : 0;
        if (n_part < 2) {
            done = start; // no partition has a complete successor yet
        } else {
            const bool ok = env.run("LagKV", format("%u partitions", n_part - 1), [&](ggml_context * ctx, ggml_cgraph * gf) {
                locret_build_lagkv(ctx, gf, env.layers, env.v_trans, env.cfg.n_cells, a.strm, start, n_part - 1, lag);
            }, nullptr);
            if (!ok) {
                return false;
            }
            done = start + (n_part - 1) * lag;
        }
        out.n_pin  = std::max(a.n_pinned, std::min<uint32_t>(LLAMA_LOCRET_LAGKV_SINKS, a.n_used));
        out.n_stab = std::max(a.n_stab, a.n_used - done);
        return true;
    }
    void compacted(const locret_config &, const locret_evict_args & a, const locret_protect &,
                   locret_policy_state & st) const override {
        // the units waiting for their partition's successor were all kept: they end the stream
        scored_to(st) = a.n_keep - (a.n_used - scored_to(st));
    }
    void truncated(const locret_config &, locret_policy_state & st, uint32_t n_used) const override {
        scored_to(st) = std::min(scored_to(st), n_used);
    }
    bool state_ok(const locret_config &, const locret_policy_state & st, uint32_t n_used) const override {
        return scored_to(st) <= n_used && st.word[1] == 0;
    }
};

} // namespace

std::unique_ptr<locret_policy> locret_policy_make_lagkv() {
    return std::make_unique<locret_policy_lagkv>();
}
