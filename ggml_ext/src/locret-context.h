// What a llama_context carries for Locret besides its memory: the retaining heads that score every ubatch in the
// graph, and the optional recorder of those scores. Eviction itself lives in the memory (locret-memory.h).
#pragma once

#include "locret-heads.h"

#include <cstddef>
#include <cstdint>
#include <vector>

struct llama_locret_context {
    const llama_locret_heads * heads = nullptr;
    bool evicts_by_heads = false; // the context's memory evicts by the heads' scores (the heads policy with a budget)

    // score recorder: token-major, [n_recorded][n_layer][n_head_kv]; the client's positions and sequences [n_recorded]
    bool record = false;
    std::vector<float>   scores;
    std::vector<int32_t> positions;
    std::vector<int32_t> seq_ids;
    std::vector<float>   staging; // one layer of one ubatch: [n_tokens][n_head_kv]
    size_t rec_n_layer   = 0;     // layout of the recorded scores (the heads may be detached later)
    size_t rec_n_head_kv = 0;
};
