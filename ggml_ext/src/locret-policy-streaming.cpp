// StreamingLLM (Xiao et al., 2023): the first logical positions (attention sinks) always win, then recency.

#include "locret-policy.h"

#include <cmath>

namespace {

struct locret_policy_streaming : locret_policy {
    static constexpr int32_t n_sinks = 4;

    llama_locret_policy id() const override { return LLAMA_LOCRET_POLICY_STREAMING; }
    void score(const locret_score_args & a) const override {
        for (uint32_t c = 0; c < a.n; ++c) {
            // recency counted back from the next position, so that float rounding cannot tie recent units even at
            // positions past 2^24
            a.score[c] = a.pos[c] < n_sinks ? INFINITY : -(float) ((int64_t) a.logical_next - a.pos[c]);
        }
    }
};

} // namespace

std::unique_ptr<locret_policy> locret_policy_make_streaming() {
    return std::make_unique<locret_policy_streaming>();
}
