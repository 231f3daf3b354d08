// LagKV (Liang et al., 2025): attention-free scores that an eviction-time graph computes from the cached K and V
// (locret-lagkv.h) into the memory's score store.

#include "locret-policy.h"

namespace {

struct locret_policy_lagkv : locret_policy {
    llama_locret_policy id() const override { return LLAMA_LOCRET_POLICY_LAGKV; }
    bool stores_scores() const override { return true; }
    bool scores_from_cache() const override { return true; }
    void score(const locret_score_args &) const override {} // never asked: the scores are in the store
};

} // namespace

std::unique_ptr<locret_policy> locret_policy_make_lagkv() {
    return std::make_unique<locret_policy_lagkv>();
}
