// The layouts (locret-layout.h): compact, in place, kept positions and kept positions at their limit.

#include "locret-layout.h"

#include "ggml.h"

#include <algorithm>

// Compact positions: the kept cells (ascending) in order at cells [0, n_live); cell k sits at physical position
// k + new_shift, and a kept cell c below live_end sat at c + old_shift (the layer's masked cells after it), others at c.
static void place_compact(const uint32_t * kept, uint32_t n_live, const int32_t * pos, int32_t * pos_new,
        uint32_t live_end, int32_t old_shift, int32_t new_shift, locret_row_moves & mv) {
    for (uint32_t k = 0; k < n_live; ++k) {
        const uint32_t c = kept[k]; // c >= k: compacting forward in place is safe
        pos_new[k] = pos[c];
        const int32_t p_old = (int32_t) c + (c < live_end ? old_shift : 0);
        const int32_t p_new = (int32_t) k + new_shift;
        if (!mv.stays(c, k) || p_new != p_old) {
            mv.add(c, k, p_new - p_old);
        }
    }
}

// The cells of the layouts with holes (kept and in-place positions): the kept cells below n_live stay; the others (the
// chunk's survivors, in cell order) fill the holes below n_live in cell order. place(c, from, stays) for each cell c
// of [0, n_live), with the cell its unit comes from. kept: ascending.
template <typename F>
static void fill_holes(const uint32_t * kept, uint32_t n_live, F && place) {
    uint32_t m = 0;
    while (m < n_live && kept[m] < n_live) {
        ++m;
    }
    uint32_t src = m;  // the next kept cell at or above n_live
    uint32_t next_kept = 0;
    for (uint32_t c = 0; c < n_live; ++c) {
        const bool stays = next_kept < m && kept[next_kept] == c;
        place(c, stays ? kept[next_kept++] : kept[src++], stays);
    }
    GGML_ASSERT(src == n_live);
}

// Kept positions: fill_holes' cells, each unit at its own position. At most the chunk's units move, as copies: none is
// re-rotated.
static void place_in_holes(const uint32_t * kept, uint32_t n_live, const int32_t * pos, const int32_t * rope,
        int32_t * pos_new, int32_t * rope_new, locret_row_moves & mv) {
    fill_holes(kept, n_live, [&](uint32_t c, uint32_t from, bool stays) {
        pos_new[c]  = pos[from];
        rope_new[c] = rope[from];
        if (!stays || !mv.stays(c, c)) {
            mv.add(from, c, 0); // into a hole, or a layer group's cache holds it lower
        }
    });
}

// In-place positions: fill_holes' cells, each unit at the position compact positions would give it: its rank among the
// kept units by RoPE position, plus shift (the layer's masked cells after it). So the model reads the units at the
// positions place_compact gives them, in other cells. A unit that stays and changes position is re-rotated where it
// is (staged in `rot`); one copied into a hole is moved and re-rotated.
static void place_in_holes_ranked(const uint32_t * kept, uint32_t n_live, int32_t shift, const int32_t * pos,
        const int32_t * rope, int32_t * pos_new, int32_t * rope_new, std::vector<int32_t> & rank,
        locret_row_moves & mv, locret_moves::in_place_rows & rot) {
    // ranks by RoPE position without a sort: a (layer, KV head)'s positions are distinct and below the cells in use
    int32_t top = -1;
    for (uint32_t k = 0; k < n_live; ++k) {
        top = std::max(top, rope[kept[k]]);
    }
    rank.assign((size_t) (top + 1), -1);
    for (uint32_t k = 0; k < n_live; ++k) {
        rank[rope[kept[k]]] = 0;
    }
    int32_t r = 0;
    for (int32_t & x : rank) {
        x = x < 0 ? -1 : r++;
    }
    GGML_ASSERT(r == (int32_t) n_live); // two kept units at one position would share a rank

    fill_holes(kept, n_live, [&](uint32_t c, uint32_t from, bool stays) {
        const int32_t p_new = rank[rope[from]] + shift;
        const int32_t dlt   = p_new - rope[from];
        pos_new[c]  = pos[from];
        rope_new[c] = p_new;
        if (!stays || !mv.stays(c, c)) {
            mv.add(from, c, dlt);
        } else if (dlt != 0) {
            mv.rotate_here(c, dlt, rot);
        }
    });
}

// Kept positions at their limit: the kept units in RoPE-position order at cells [0, n_live), re-rotated to positions
// k + shift (right before the next cell, after the layer's masked cells), as compact positions place them.
static void place_by_position(const uint32_t * kept, uint32_t n_live, int32_t shift, const int32_t * pos,
        const int32_t * rope, int32_t * pos_new, int32_t * rope_new, std::vector<uint32_t> & order,
        locret_row_moves & mv) {
    order.assign(kept, kept + n_live);
    std::sort(order.begin(), order.end(), [rope](uint32_t a, uint32_t b) { return rope[a] < rope[b]; });
    for (uint32_t k = 0; k < n_live; ++k) {
        const uint32_t c     = order[k];
        const int32_t  p_new = (int32_t) k + shift;
        pos_new[k]  = pos[c];
        rope_new[k] = p_new;
        if (!mv.stays(c, k) || p_new != rope[c]) {
            mv.add(c, k, p_new - rope[c]);
        }
    }
}

namespace {

struct layout_compact : locret_layout {
    const char * name() const override { return "compact"; }
    void place(const locret_layout_head & hd, locret_layout_scratch &, locret_row_moves & mv,
               locret_moves::in_place_rows *) const override {
        place_compact(hd.kept, hd.n_live, hd.pos, hd.pos_new, hd.live_end, hd.old_shift, hd.new_shift, mv);
    }
};

struct layout_in_place : locret_layout {
    const char * name() const override { return "inplace"; }
    void place(const locret_layout_head & hd, locret_layout_scratch & scratch, locret_row_moves & mv,
               locret_moves::in_place_rows * rot) const override {
        GGML_ASSERT(rot != nullptr && "in-place positions stage their re-rotations");
        place_in_holes_ranked(hd.kept, hd.n_live, hd.new_shift, hd.pos, hd.rope, hd.pos_new, hd.rope_new, scratch.rank,
                mv, *rot);
    }
};

struct layout_keep : locret_layout {
    const char * name() const override { return "keep"; }
    void place(const locret_layout_head & hd, locret_layout_scratch &, locret_row_moves & mv,
               locret_moves::in_place_rows *) const override {
        place_in_holes(hd.kept, hd.n_live, hd.pos, hd.rope, hd.pos_new, hd.rope_new, mv);
    }
};

struct layout_by_position : locret_layout {
    const char * name() const override { return "keep, repositioned"; }
    void place(const locret_layout_head & hd, locret_layout_scratch & scratch, locret_row_moves & mv,
               locret_moves::in_place_rows *) const override {
        place_by_position(hd.kept, hd.n_live, hd.new_shift, hd.pos, hd.rope, hd.pos_new, hd.rope_new, scratch.order,
                mv);
    }
};

} // namespace

locret_layout_kind locret_layout_of(bool keep_positions, bool rotate_in_place, bool reposition) {
    if (rotate_in_place) {
        return LOCRET_LAYOUT_IN_PLACE;
    }
    if (keep_positions) {
        return reposition ? LOCRET_LAYOUT_BY_POSITION : LOCRET_LAYOUT_KEEP;
    }
    return LOCRET_LAYOUT_COMPACT;
}

const locret_layout & locret_layout_get(locret_layout_kind kind) {
    static const layout_compact     compact;
    static const layout_in_place    in_place;
    static const layout_keep        keep;
    static const layout_by_position by_position;
    switch (kind) {
        case LOCRET_LAYOUT_IN_PLACE:    return in_place;
        case LOCRET_LAYOUT_KEEP:        return keep;
        case LOCRET_LAYOUT_BY_POSITION: return by_position;
        case LOCRET_LAYOUT_COMPACT:     break;
    }
    return compact;
}
