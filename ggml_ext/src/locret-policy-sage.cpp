// SAGE-KV (Wang et al., 2025): scores from the attention of a prompt's last token over the cache, computed once per
// prompt by an eviction-time graph (locret-sage.h) into the memory's score store.

#include "locret-policy.h"

namespace {

struct locret_policy_sage : locret_policy {
    llama_locret_policy id() const override { return LLAMA_LOCRET_POLICY_SAGE; }
    bool stores_scores() const override { return true; }
    bool selects_once() const override { return true; }
    void score(const locret_score_args &) const override {} // never asked: the scores are in the store
};

} // namespace

std::unique_ptr<locret_policy> locret_policy_make_sage() {
    return std::make_unique<locret_policy_sage>();
}
