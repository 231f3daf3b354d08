// SAGE-KV (Wang et al., 2025): scores from the attention of a prompt's last token over the cache, computed once per
// prompt by an eviction-time graph (locret-sage.h) into the memory's score store. Its per-sequence state (below):
// chosen_to, the cells [0, chosen_to) its last selection chose (sinks and units by score), which later evictions keep
// as they are; pending, 1 while a prompt has ended and its one selection has not run yet (the query store holds the
// prompt's last query).

#include "locret-policy.h"
#include "locret-heads.h"
#include "locret-sage.h"
#include "locret-settings.h"

#include "llama-impl.h"

#include <algorithm>
#include <cmath>

namespace {

// SAGE-KV's per-sequence state in the policy's words (locret_policy_state, saved in state files)
uint32_t & chosen_to(locret_policy_state & st) { return st.word[0]; }
uint32_t   chosen_to(const locret_policy_state & st) { return st.word[0]; }
uint32_t & pending(locret_policy_state & st) { return st.word[1]; }
uint32_t   pending(const locret_policy_state & st) { return st.word[1]; }

struct locret_policy_sage : locret_policy {
    llama_locret_policy id() const override { return LLAMA_LOCRET_POLICY_SAGE; }
    bool reads_cells_in_order() const override { return true; }
    bool stores_scores() const override { return true; }

    bool sets_own_stabilizers() const override { return true; }
    std::string params_problem(const llama_locret_params & p, const locret_policy_values &) const override {
        if (p.stabilizers >= 0 || p.local >= 0) {
            return format("SAGE-KV keeps its own recent window (b/%d units); --locret-stabilizers and --locret-local do "
                    "not apply to it", LLAMA_LOCRET_SAGE_RECENT_DIV);
        }
        return "";
    }
    void configure(const llama_locret_params &, uint32_t n_ctx_seq, locret_config & cfg, std::string & err) const override {
        // SAGE-KV splits the budget itself (b/4 sinks, b/4 recent units, the rest by score) and reads the whole prompt
        // before it evicts: its cache holds n_ctx cells per sequence, and there is nothing for stabilizers or a local
        // tail to protect during a prefill that never evicts
        if (cfg.budget < 8) {
            err = format("with SAGE-KV the budget (%u) must be at least 8 units: b/4 sinks, b/4 recent units and the "
                    "units chosen by attention", cfg.budget);
        } else if (n_ctx_seq < cfg.budget + cfg.n_ubatch) {
            err = format("SAGE-KV keeps the whole prompt before it evicts: the context per sequence (%u) must be larger "
                    "than the budget plus the ubatch (%u + %u); raise -c", n_ctx_seq, cfg.budget, cfg.n_ubatch);
        }
        cfg.stabilizers = cfg.budget / LLAMA_LOCRET_SAGE_RECENT_DIV;
        cfg.local       = 0;
        cfg.capacity    = n_ctx_seq;
    }
    std::string pin_problem() const override {
        return "Locret: SAGE-KV chooses by the attention of the prompt's last token and keeps its own sinks; a pinned "
               "query (Locret-Q) does not apply to it";
    }
    std::string describe(const locret_config & cfg) const override {
        return format(", %u sinks and %u recent units, the whole prompt kept until its end", locret_sage_sinks(cfg.budget),
                cfg.stabilizers);
    }

    uint32_t query_rows(const locret_config &) const override { return 1; }
    size_t score_graph_nodes(size_t n_layers) const override { return locret_sage_n_nodes(n_layers); }
    void build_worst_score_graph(const locret_policy_env & env, ggml_context * ctx, ggml_cgraph * gf) const override {
        locret_build_sage(ctx, gf, env.layers, env.queries, std::vector<float>(env.layers.size(), 1.0f), env.cfg.n_cells,
                0, env.cfg.capacity);
    }

    bool reads_prompt_whole() const override { return true; }
    bool selection_due(const locret_policy_state & st) const override { return pending(st) != 0; }
    void placed(const locret_config & cfg, locret_policy_state & st, uint32_t n_used, uint32_t, uint32_t,
                bool prompt_end) const override {
        if (prompt_end) {
            // a prompt that passes the budget is chosen from at the next part, with this part's last query; one within
            // the budget stays whole, all but the recent window kept like the chosen set of a selection
            pending(st) = n_used > cfg.budget;
            if (pending(st) == 0) {
                chosen_to(st) = n_used - std::min(cfg.stabilizers, n_used);
            }
        }
    }
    bool prepare(const locret_policy_env & env, const locret_evict_args & a, locret_policy_state & st,
                 locret_protect & out) const override {
        if (pending(st) == 0) {
            // after the selection: the chosen set as it is, and the newest units in the rest of the budget
            out.n_pin  = std::min(chosen_to(st), a.n_keep);
            out.n_stab = a.n_keep - out.n_pin;
            return true;
        }
        // the one selection after a prompt: its sinks, its recent window, the best of the rest by the attention of the
        // prompt's last token
        if (!locret_queries_captured(env, "SAGE-KV")) {
            return false;
        }
        const bool ok = env.run("SAGE-KV", format("%u units", a.n_used), [&](ggml_context * ctx, ggml_cgraph * gf) {
            locret_build_sage(ctx, gf, env.layers, env.queries, env.query_scale, env.cfg.n_cells, a.strm, a.n_used);
        }, nullptr);
        out.n_pin  = locret_sage_sinks(env.cfg.budget);
        out.n_stab = env.cfg.stabilizers;
        return ok;
    }
    void compacted(const locret_config &, const locret_evict_args & a, const locret_protect & prot,
                   locret_policy_state & st) const override {
        if (pending(st) != 0) {
            // the sinks and the chosen units lead the stream from now on; the recent window follows them
            chosen_to(st) = a.n_keep - prot.n_stab;
            pending(st) = 0;
        }
    }
    void truncated(const locret_config & cfg, locret_policy_state & st, uint32_t n_used) const override {
        chosen_to(st) = std::min(chosen_to(st), n_used);
        if (pending(st) != 0 && n_used <= cfg.budget) {
            // what is left of the prompt fits the budget; kept whole, as a prompt within the budget is
            pending(st) = 0;
            chosen_to(st) = n_used - std::min(cfg.stabilizers, n_used);
        }
    }
    bool state_ok(const locret_config & cfg, const locret_policy_state & st, uint32_t n_used) const override {
        return chosen_to(st) <= n_used && pending(st) <= 1 && !(pending(st) == 1 && n_used <= cfg.budget);
    }
};

} // namespace

std::unique_ptr<locret_policy> locret_policy_make_sage() {
    return std::make_unique<locret_policy_sage>();
}
