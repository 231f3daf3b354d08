// The scoring policies: the retaining heads (Locret), the paper's ablations random and streaming, and LagKV.

#include "locret-policy.h"

#include <cmath>

namespace {

// Locret: the scores are the causal importance scores the graph stored beside the cache; never asked to score
struct locret_policy_heads : locret_policy {
    llama_locret_policy id() const override { return LLAMA_LOCRET_POLICY_HEADS; }
    bool uses_heads() const override { return true; }
    void score(const locret_score_args &) const override {}
};

// the paper's random-eviction ablation: a fixed pseudo-random number per (layer, KV head, logical position)
struct locret_policy_random : locret_policy {
    llama_locret_policy id() const override { return LLAMA_LOCRET_POLICY_RANDOM; }
    void score(const locret_score_args & a) const override {
        for (uint32_t c = 0; c < a.n; ++c) {
            a.score[c] = locret_random_score(a.il, a.ih, a.pos[c]);
        }
    }
};

// StreamingLLM: the first logical positions (attention sinks) always win, then recency
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

// LagKV: attention-free scores that an eviction-time graph computes from the cached K and V (locret-lagkv.h) into the
// memory's score store; never asked to score
struct locret_policy_lagkv : locret_policy {
    llama_locret_policy id() const override { return LLAMA_LOCRET_POLICY_LAGKV; }
    bool stores_scores() const override { return true; }
    bool scores_from_cache() const override { return true; }
    void score(const locret_score_args &) const override {}
};

// SAGE-KV: scores from the attention of a prompt's last token over the cache, computed by an eviction-time graph
// (locret-sage.h) into the memory's score store once per prompt; never asked to score
struct locret_policy_sage : locret_policy {
    llama_locret_policy id() const override { return LLAMA_LOCRET_POLICY_SAGE; }
    bool stores_scores() const override { return true; }
    bool selects_once() const override { return true; }
    void score(const locret_score_args &) const override {}
};

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

} // namespace

// the top 24 bits of a 64-bit hash of (seed, layer, KV head, logical position): uniform in [0, 1), exact in a float,
// the same on every run and machine
float locret_random_score(uint32_t il, uint32_t ih, int32_t pos) {
    const uint64_t key = ((uint64_t) (il & 0xffff) << 48) | ((uint64_t) (ih & 0xffff) << 32) | (uint64_t) (uint32_t) pos;
    return (float) (locret_mix64(key ^ LOCRET_RANDOM_SEED) >> 40) * (1.0f / 16777216.0f);
}

std::unique_ptr<locret_policy> locret_policy_make(llama_locret_policy id) {
    switch (id) {
        case LLAMA_LOCRET_POLICY_HEADS:     return std::make_unique<locret_policy_heads>();
        case LLAMA_LOCRET_POLICY_RANDOM:    return std::make_unique<locret_policy_random>();
        case LLAMA_LOCRET_POLICY_STREAMING: return std::make_unique<locret_policy_streaming>();
        case LLAMA_LOCRET_POLICY_LAGKV:     return std::make_unique<locret_policy_lagkv>();
        case LLAMA_LOCRET_POLICY_SAGE:      return std::make_unique<locret_policy_sage>();
    }
    return nullptr;
}
