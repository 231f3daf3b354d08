// Top-b selection on the host: O(n) partition, then the kept cells sorted back into cell order.

#include "locret-select.h"

#include <algorithm>
#include <cmath>

void locret_select(const float * score, uint32_t n_used, uint32_t n_keep, uint32_t n_stab, std::vector<uint32_t> & keep) {
    const uint32_t n_cand = n_used - n_stab;
    const uint32_t n_top  = n_keep - n_stab;
    keep.resize(n_cand);
    for (uint32_t c = 0; c < n_cand; ++c) {
        keep[c] = c;
    }
    auto better = [score](uint32_t a, uint32_t b) {
        const float sa = std::isnan(score[a]) ? -INFINITY : score[a];
        const float sb = std::isnan(score[b]) ? -INFINITY : score[b];
        return sa > sb || (sa == sb && a < b);
    };
    if (n_top < n_cand) {
        std::nth_element(keep.begin(), keep.begin() + n_top, keep.end(), better);
        keep.resize(n_top);
    }
    std::sort(keep.begin(), keep.end());
    for (uint32_t c = n_cand; c < n_used; ++c) {
        keep.push_back(c);
    }
}
