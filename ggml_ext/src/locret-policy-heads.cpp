// Locret's own policy: the scores are the retaining heads' causal importance scores, which the graph computes with the
// units (locret-graph.cpp) and stores beside the cache.

#include "locret-policy.h"

namespace {

struct locret_policy_heads : locret_policy {
    llama_locret_policy id() const override { return LLAMA_LOCRET_POLICY_HEADS; }
    bool uses_heads() const override { return true; }
    bool pools_scores() const override { return true; }
};

} // namespace

std::unique_ptr<locret_policy> locret_policy_make_heads() {
    return std::make_unique<locret_policy_heads>();
}
