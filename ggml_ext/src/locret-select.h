// Top-b selection of one (layer, KV head): which cells keep their units in an eviction.
#pragma once

#include <cstdint>
#include <vector>

// The top (n_keep - n_stab) of cells [0, n_used - n_stab) by score, ties to the earlier cell, NaN scores last, plus
// the last n_stab cells; returned in cell order in `keep` (n_keep entries).
void locret_select(const float * score, uint32_t n_used, uint32_t n_keep, uint32_t n_stab, std::vector<uint32_t> & keep);
