// The caches of a budget schedule's layer groups (locret_layer_groups in locret-size.h: one cache per distinct budget,
// each sized for its group) and how a sequence's cells map into each. One group without a schedule.
//
// Every sequence's bookkeeping (locret_cells: cells, units' positions, scores) is laid out in group 0's cells; group 0's
// cache is the one that evicts. Group g's cache holds the same cells except those no layer of the group reads: below
// the group's live end a cell is its own, from the dead end on it sits `gap` cells lower (gap = dead end - the group's
// live end), and the cells between do not exist in that cache. The memory (locret-memory.h) owns one of these.
#pragma once

#include "locret-cells.h"
#include "locret-plan.h"

#include "llama-kv-cache.h"

#include <memory>
#include <vector>

class locret_group_caches {
public:
    // group 0's cache (not owned: the memory's evicting cache) and the caches of groups 1.. (owned)
    void init(llama_kv_cache * cache0, std::vector<std::unique_ptr<llama_kv_cache>> rest);
    // per group: its layers (indices into the memory's layer list), once the layers are known
    void set_layers(std::vector<std::vector<size_t>> layers_of_group) { group_layers = std::move(layers_of_group); }

    size_t size() const { return 1 + caches.size(); }
    llama_kv_cache * cache(size_t g) const { return g == 0 ? cache0 : caches[g - 1].get(); }
    const std::vector<size_t> & layers_of(size_t g) const { return group_layers[g]; }

    // the cells of stream s that group g's layers may read below the dead end: [0, live end)
    uint32_t live_end(size_t g, const locret_cells & s) const;
    uint32_t gap(size_t g, const locret_cells & s) const { return s.dead_end - live_end(g, s); }
    // cell c of stream s in group g's cache, or -1 for a cell that cache does not hold
    int64_t cell(size_t g, const locret_cells & s, uint32_t c) const;
    // the cells layer i (of group g) must not read, in its group's own cells: [*c0, *c1) below the group's live end
    void masked_cells(size_t g, size_t i, const locret_cells & s, uint32_t * c0, uint32_t * c1) const;

    // groups 1..: place a ubatch (the graph's copy) planned by `plan` in each group's cache, into one context per group
    // (out[g - 1]), the streams as they stand before the plan's parts are recorded
    void place(const locret_ubatch_plan & plan, const llama_ubatch & ubatch, const std::vector<locret_cells> & streams,
               std::vector<std::unique_ptr<llama_kv_cache_context>> & out) const;
    // every group's cells holding positions >= pos_from in stream strm become free
    void free_from(uint32_t strm, llama_pos pos_from) const;
    // after an eviction of stream strm (now s): groups 1.. free their cells past their live end
    void free_tails(uint32_t strm, const locret_cells & s) const;

    // f(cache) for the caches of groups 1.. (group 0's belongs to the model's memory)
    template <typename F> void each_own(F f) const {
        for (const auto & c : caches) {
            f(*c);
        }
    }

private:
    llama_kv_cache * cache0 = nullptr;
    std::vector<std::unique_ptr<llama_kv_cache>> caches;       // groups 1..
    std::vector<std::vector<size_t>>             group_layers; // per group: its layers
};
