// Layouts: where an eviction puts the units a (layer, KV head) keeps, and the row moves that take them there. Each
// layout is a small strategy over one (layer, KV head) at a time, with no model and no tensor: it reads the kept cells
// and the positions before the eviction and writes the positions after it and the rows to move (a row is a (cell, KV
// head) of one layer, moved to another cell and re-rotated by a change of RoPE position, or re-rotated where it is).
// The eviction (locret-evictor.cpp) picks the layout of an eviction (locret_layout_of) and runs the moves on the device
// (locret-compact.h); the layouts are described at the top of locret-memory.h and tested alone in
// tests/cpp/test-locret-cells.cpp.
#pragma once

#include "locret-compact.h" // locret_moves::in_place_rows

#include <cstdint>
#include <vector>

// One (layer, KV head)'s rows an eviction moves, appended to its layer's move table: a row is (cell, KV head), moved
// from one cell to another and re-rotated by delta positions (0: a copy).
struct locret_row_moves {
    int32_t * src;
    int64_t * dst;
    int32_t * delta;
    size_t    n;          // rows appended
    int64_t   base;       // the stream's first cell
    uint32_t  n_head_kv;
    uint32_t  h;          // the KV head being placed
    uint64_t  moved;      // rows written to another cell
    uint64_t  rotated;    // keys re-rotated
    // layer groups: the K/V rows in the layer's own cache (NULL without groups), its stream's first cell there, and
    // where its cells part from the bookkeeping's: cells from `live` on sit `gap` lower (no cell is read between)
    int32_t * kv_src  = nullptr;
    int64_t * kv_dst  = nullptr;
    int64_t   kv_base = 0;
    uint32_t  live    = 0;
    uint32_t  gap     = 0;

    // cell c of the bookkeeping in the layer's own cache
    uint32_t own(uint32_t c) const { return kv_src == nullptr || c < live ? c : c - gap; }
    // a unit that goes from cell `from` to cell `to` (below every group's live end after the eviction) needs no move
    // when neither its score's row nor its K/V row changes
    bool stays(uint32_t from, uint32_t to) const { return from == to && own(from) == to; }

    void add(uint32_t from, uint32_t to, int32_t dlt) {
        src[n]   = (int32_t) ((base + from) * n_head_kv + h);
        dst[n]   = (base + to) * n_head_kv + h;
        delta[n] = dlt;
        if (kv_src != nullptr) {
            kv_src[n] = (int32_t) ((kv_base + own(from)) * n_head_kv + h);
            kv_dst[n] = (kv_base + to) * n_head_kv + h;
        }
        ++n;
        moved   += own(from) != to;
        rotated += dlt != 0;
    }

    // a key re-rotated in the cell it stays in (own(c) == c): staged apart, appended after the turn's moves
    // (locret_moves::finish), so that V and the scores, which do not change, are not copied onto themselves
    void rotate_here(uint32_t c, int32_t dlt, locret_moves::in_place_rows & r) {
        r.row[r.n]   = (base + c) * n_head_kv + h;
        r.delta[r.n] = dlt;
        if (kv_src != nullptr) {
            r.kv_row[r.n] = (kv_base + c) * n_head_kv + h;
        }
        ++r.n;
        ++rotated;
    }
};

// what a layout reads and writes for one (layer, KV head) at an eviction
struct locret_layout_head {
    const uint32_t * kept;      // [n_live] the cells it keeps, ascending
    uint32_t         n_live;
    const int32_t  * pos;       // [n_cells] each cell's logical position before the eviction
    const int32_t  * rope;      // [n_cells] each cell's RoPE position before it (NULL with compact positions)
    int32_t        * pos_new;   // [n_live] out: logical positions after it
    int32_t        * rope_new;  // [n_live] out: RoPE positions after it (NULL with compact positions)
    uint32_t         live_end;  // the layer's live end before it (compact: cells below it sat old_shift higher)
    int32_t          old_shift; // the layer's masked cells before it (a budget schedule; 0 without)
    int32_t          new_shift; // ... and after it
};

// what a layout may reuse from one eviction to the next (no allocation once grown)
struct locret_layout_scratch {
    std::vector<uint32_t> order; // kept positions at their limit: the kept cells by position
    std::vector<int32_t>  rank;  // in-place positions: each RoPE position's rank among the kept units
};

struct locret_layout {
    virtual ~locret_layout() = default;
    virtual const char * name() const = 0;
    // one (layer, KV head)'s kept set into its positions after the eviction and the rows to move (mv); keys re-rotated
    // where they stay go to rot (in-place positions only; may be NULL for the others)
    virtual void place(const locret_layout_head & hd, locret_layout_scratch & scratch, locret_row_moves & mv,
                       locret_moves::in_place_rows * rot) const = 0;
};

enum locret_layout_kind {
    LOCRET_LAYOUT_COMPACT,     // the kept units in order at cells and positions 0..n-1 (the paper's)
    LOCRET_LAYOUT_IN_PLACE,    // the same positions, a kept unit below n staying in its cell (re-rotated there)
    LOCRET_LAYOUT_KEEP,        // kept positions: units keep their cells below n and their positions
    LOCRET_LAYOUT_BY_POSITION, // kept positions at their limit: the kept units by position at cells 0..n-1
};

// the layout of an eviction: the settings' positions (locret_config), and whether kept positions reach their limit
locret_layout_kind locret_layout_of(bool keep_positions, bool rotate_in_place, bool reposition);
const locret_layout & locret_layout_get(locret_layout_kind kind);
