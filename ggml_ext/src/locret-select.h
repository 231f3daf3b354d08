// Top-b selection of one (layer, KV head): which cells keep their units in an eviction. On the host (a partition per
// row), or on the device (a graph over every row at once); both keep exactly the same cells.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

struct ggml_context;
struct ggml_tensor;

// The first n_pin cells (a pinned query, Locret-Q), the top (n_keep - n_pin - n_stab) of cells [n_pin, n_used - n_stab)
// by score, ties to the earlier cell, NaN scores last, and the last n_stab cells; returned in cell order in `keep`
// (n_keep entries).
void locret_select(const float * score, uint32_t n_used, uint32_t n_keep, uint32_t n_pin, uint32_t n_stab,
                   std::vector<uint32_t> & keep);

// The device's selection: the n_top best of cells [cell0, cell0 + n_cand) of stream `strm`, for every (layer, KV head)
// row of `scores` (F32 [n_head_kv, n_cells*n_streams, n_layers], a unit's score at row strm*n_cells + cell), ties to the
// earlier cell like locret_select. Returns I32 [n_top, n_head_kv*n_layers] (row (layer*n_head_kv + head)), each row's
// cells counted from cell0, in no particular order. Scores must not be NaN (a NaN competes as a tie of the threshold).
//
// Existing ops only, so that every backend runs it: a descending argsort gives each row's threshold t (its n_top-th
// score); then key = 2^25 for scores above t, 2^24 - cell for scores equal to t, 0 below (exact in F32 for fewer than
// 2^24 cells), and the n_top largest keys are exactly the cells to keep whatever order a backend's sort gives ties.
ggml_tensor * locret_build_select(ggml_context * ctx, ggml_tensor * scores, uint32_t strm, uint32_t n_cells,
                                  uint32_t cell0, uint32_t n_cand, uint32_t n_top);

// A budget schedule's device selection for one layer, whose rows keep different counts and skip the cells the layer
// masks: the n_top best of the candidates cells [c0, c0 + n0) then [c1, c1 + n1) (n1 may be 0) of stream `strm` in
// `scores` (one layer's store, F32 [n_head_kv, n_cells*n_streams]), ties to the earlier cell. Returns I32
// [n_top, n_head_kv], each row's candidates counted from the first of the first run across both runs (the second
// run's first cell is n0), in no particular order. The same key as locret_build_select.
ggml_tensor * locret_build_select_runs(ggml_context * ctx, ggml_tensor * scores, uint32_t strm, uint32_t n_cells,
                                       uint32_t c0, uint32_t n0, uint32_t c1, uint32_t n1, uint32_t n_top);

// One row of the device's result (chosen with cell0 = n_pin) in cell order, after the n_pin pinned cells and before
// the n_stab stabilizers [n_used - n_stab, n_used): keep[n_pin + n_top + n_stab]. O(n_used), with a mark per candidate
// cell in `kept` (scratch).
void locret_keep_from_top(const int32_t * top, uint32_t n_top, uint32_t n_used, uint32_t n_pin, uint32_t n_stab,
                          uint32_t * keep, std::vector<uint8_t> & kept);

// One layer's cut at an eviction: Algorithm 1 over the cells the layer reads, [0, m0) and [m0 + gap, n_used) (m0 its
// live end, m0 + gap the dead end; gap 0 without a budget schedule), as if they were consecutive ("held" order).
struct locret_layer_cut {
    uint32_t m0     = 0;
    uint32_t gap    = 0; // its masked cells
    uint32_t n_held = 0; // units the layer holds
    uint32_t n_live = 0; // ... and keeps
    uint32_t stab   = 0; // of which its last ones kept as stabilizers
    uint32_t n_cand = 0; // candidates: held [n_pin, n_held - stab)
    uint32_t n_top  = 0; // ... of which kept by score
    uint32_t c0 = 0, n0 = 0, c1 = 0, n1 = 0; // the candidates as runs of cells: [c0, c0 + n0), then [c1, c1 + n1)
    size_t   off = SIZE_MAX; // where its device selection is in the eviction's read-back (SIZE_MAX: chosen on the host)
    bool on_device() const { return n_top > 0 && n_top < n_cand; }
};

// the cut of a layer whose live end is live_end (locret_cells::live_end) in a stream of n_used cells with the given
// dead end, keeping at most n_keep units (and its own budget), n_pin pinned and n_stab stabilizers among them
locret_layer_cut locret_cut_layer(uint32_t live_end, uint32_t dead_end, uint32_t n_used, uint32_t layer_budget,
                                  uint32_t n_keep, uint32_t n_pin, uint32_t n_stab);
