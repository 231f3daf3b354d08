// Where the score of each KV unit comes from. Every policy runs the same eviction (top-b per layer and KV head,
// stabilizers, local tail, compaction); only the scores differ. Selection (locret-select) and compaction
// (locret-compact) know nothing of policies.
#pragma once

#include "llama-locret.h"

#include <cstdint>
#include <memory>

// what a policy may look at when it scores one (layer, KV head) of one sequence at an eviction
struct locret_score_args {
    uint32_t        il;           // model layer
    uint32_t        ih;           // KV head
    const int32_t * pos;          // [n] logical position of the unit in each cell
    float         * score;        // [n] out: the scores
    uint32_t        n;            // cells in use
    int32_t         logical_next; // logical position of the sequence's next token
};

struct locret_policy {
    virtual ~locret_policy() = default;

    virtual llama_locret_policy id() const = 0;

    // the scores are the retaining heads' causal importance scores, computed in the graph with the units
    virtual bool uses_heads() const { return false; }

    // the scores live in the memory's score store beside the cache (moved with the units, selected on the device)
    virtual bool stores_scores() const { return uses_heads(); }

    // the scores are computed from the cache itself by an eviction-time graph (LagKV, locret-lagkv.h), for the units
    // that can be scored by then; the memory keeps the others like stabilizers
    virtual bool scores_from_cache() const { return false; }

    // SAGE-KV (locret-sage.h): the whole prompt stays while it is read; the first eviction after a prompt's end scores
    // it once by the attention of its last token, and later evictions keep that choice and slide the recent window
    virtual bool selects_once() const { return false; }

    // fill args.score for the units about to be selected from (not asked of a policy that stores its scores)
    virtual void score(const locret_score_args & args) const = 0;
};

std::unique_ptr<locret_policy> locret_policy_make(llama_locret_policy id);

// the random policy's score of (layer, KV head, logical position); tests/py/test_policies.py mirrors it
float locret_random_score(uint32_t il, uint32_t ih, int32_t pos);
