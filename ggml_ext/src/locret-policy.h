// Where the score of each KV unit comes from. Every policy runs the same eviction (top-b per layer and KV head,
// stabilizers, local tail, compaction); only the scores differ. Selection (locret-select) and compaction
// (locret-compact) know nothing of policies.
#pragma once

#include "llama-locret.h"

#include <cstddef>
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

// One row per policy. Adding a policy is one file (its locret_policy and a factory) and one row of the table in
// locret-policy.cpp (plus its factory's declaration below and its value in the public enum); names, help, Python's list and the rules read the table.
struct locret_policy_entry {
    llama_locret_policy id;
    const char * name;       // --locret-policy NAME
    const char * help;       // one line: what scores the units (the tools' help, Python's list)
    bool needs_heads;        // the scores come from retaining heads: a budget without heads is refused
    bool per_layer_budgets;  // a budget schedule may give each layer its own budget
    std::unique_ptr<locret_policy> (*make)();
};

// the factories, one per policy file (locret-policy-NAME.cpp)
std::unique_ptr<locret_policy> locret_policy_make_heads();
std::unique_ptr<locret_policy> locret_policy_make_random();
std::unique_ptr<locret_policy> locret_policy_make_streaming();
std::unique_ptr<locret_policy> locret_policy_make_lagkv();
std::unique_ptr<locret_policy> locret_policy_make_sage();

size_t                      locret_policy_count();
const locret_policy_entry & locret_policy_at(size_t i);
// the row of a policy, or NULL for a value from outside the enum (C callers, ctypes)
const locret_policy_entry * locret_policy_find(llama_locret_policy id);

std::unique_ptr<locret_policy> locret_policy_make(llama_locret_policy id);

// the random policy's score of (layer, KV head, logical position); tests/py/test_policies.py mirrors it
float locret_random_score(uint32_t il, uint32_t ih, int32_t pos);
