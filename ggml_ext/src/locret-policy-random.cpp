// The paper's random-eviction ablation: a fixed pseudo-random number per (layer, KV head, logical position).

#include "locret-policy.h"

namespace {

// the SplitMix64 finalizer: a bijection of 64-bit words with full avalanche
uint64_t locret_mix64(uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}

const uint64_t LOCRET_RANDOM_SEED = 0x4c6f63726574ULL; // "Locret"

struct locret_policy_random : locret_policy {
    llama_locret_policy id() const override { return LLAMA_LOCRET_POLICY_RANDOM; }
    void score(const locret_score_args & a) const override {
        for (uint32_t c = 0; c < a.n; ++c) {
            a.score[c] = locret_random_score(a.il, a.ih, a.pos[c]);
        }
    }
};

} // namespace

// the top 24 bits of a 64-bit hash of (seed, layer, KV head, logical position): uniform in [0, 1), exact in a float,
// the same on every run and machine
float locret_random_score(uint32_t il, uint32_t ih, int32_t pos) {
    const uint64_t key = ((uint64_t) (il & 0xffff) << 48) | ((uint64_t) (ih & 0xffff) << 32) | (uint64_t) (uint32_t) pos;
    return (float) (locret_mix64(key ^ LOCRET_RANDOM_SEED) >> 40) * (1.0f / 16777216.0f);
}

std::unique_ptr<locret_policy> locret_policy_make_random() {
    return std::make_unique<locret_policy_random>();
}
