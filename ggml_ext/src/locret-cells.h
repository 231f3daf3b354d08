// One sequence's cells: which unit each (layer, KV head, cell) holds, at which positions, and the ends that part the
// cells a layer reads from those it does not. The role llama.cpp's llama-kv-cells.h plays for its cache: no model, no
// tensor, no backend, so its rules are written once here and tested alone (tests/cpp/test-locret-cells.cpp).
//
// Every (layer, KV head) holds its units in cells [0, n_used), less a budget schedule's masked cells (below). Cells
// [uniform_from, n_used) hold the parts placed since the last eviction: the same tokens in every layer and head, in
// order, cell c at RoPE position rope_next - (n_used - c). Cells below uniform_from hold each (layer, KV head)'s kept
// units: with compact positions in position order, cell c at position c; with in-place positions at positions
// 0..uniform_from-1 in any cell order; with kept positions at the positions they were read at, in any cell order (as
// compact after a repositioning). The layouts that put them there are in locret-layout.h, the memory that moves the
// keys and values in locret-memory.h.
//
// The invariants (check() says which one a state breaks; debug builds assert them after every change):
//   - uniform_from <= n_used <= n_cells, dead_end <= uniform_from, live_end[i] <= dead_end for every layer;
//   - a cell below n_used holds a unit (logical position in [0, logical_next)) unless a schedule masks it
//     (live_end[i] <= c < dead_end), where it holds -1;
//   - cells [uniform_from, n_used) hold the same logical position in every layer and KV head, ascending;
//   - with RoPE positions per cell (rope not empty): a unit's RoPE position is below rope_next, distinct within its
//     (layer, KV head), and cells [uniform_from, n_used) sit at rope_next - (n_used - c);
//   - the undo of the last part, when valid, names a state with no more cells in use.
#pragma once

#include "locret-policy.h" // locret_policy_state

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

struct locret_cells {
    uint32_t  n_used       = 0;
    uint32_t  uniform_from = 0;     // cells >= this were placed after the last eviction: the same token in every head
    bool      prev_output  = true;  // the last part placed asked for an output
    llama_pos logical_next = 0;     // the client's position of the sequence's next token
    uint32_t  rope_next    = 0;     // the RoPE position of its next token: n_used with compact and in-place positions;
                                    // with kept positions n_used plus the units (of the largest layer) evicted since
                                    // the last repositioning
    uint32_t  n_pinned     = 0;     // Locret-Q: logical positions [0, n_pinned) are never evicted (until emptied)
    bool      long_prompt  = false; // told a prompt long enough for the heads' pooling of long prompts (the config's
                                    // pool_from; llama_locret_seq_prompt), until emptied
    locret_policy_state policy_state; // what the policy keeps per sequence (locret-policy.h)

    // A budget schedule: after an eviction the largest layers keep dead_end units (the eviction's n_keep) and layer i
    // keeps live_end[i] <= dead_end of them in cells [0, live_end[i]); cells [live_end[i], dead_end) hold nothing it
    // reads (its attention masks them out, or its layer group's cache does not hold them), and later parts go from
    // dead_end on. With compact and in-place positions layer i's kept units sit at RoPE positions
    // [dead_end - live_end[i], dead_end), right before the next part's (in cell order with compact positions, cell c
    // at c + dead_end - live_end[i]); with kept positions they keep their own until a repositioning places them so.
    // Without a schedule, or before the first eviction, live_end[i] == dead_end (0 before the first eviction).
    uint32_t              dead_end = 0;
    std::vector<uint32_t> live_end; // per evicting layer

    uint64_t n_evictions     = 0;
    uint64_t n_units_evicted = 0;   // summed over layers and KV heads

    // the shape: cells per (layer, KV head) and each evicting layer's KV heads
    uint32_t              n_cells = 0;
    std::vector<uint32_t> n_head_kv;

    // per evicting layer: [n_head_kv][n_cells] logical position of the unit in each cell (valid below n_used; -1 in a
    // cell a schedule masks); the units' scores live beside the cache, on its device (llama_locret_memory)
    std::vector<std::vector<int32_t>> pos;
    // in-place and kept positions: per evicting layer [n_head_kv][n_cells] the RoPE position each cell's key was
    // rotated at (valid below n_used; -1 in a cell a schedule masks). Empty with compact positions, where it follows
    // from the cell (and the masked cells after it).
    std::vector<std::vector<int32_t>> rope;

    // the bookkeeping a placed part changes (the units' positions are restored by freeing its cells)
    struct marks {
        uint32_t  n_used;
        uint32_t  uniform_from;
        bool      prev_output;
        llama_pos logical_next;
        uint32_t  rope_next;
        locret_policy_state policy_state;
    };
    marks snapshot() const { return { n_used, uniform_from, prev_output, logical_next, rope_next, policy_state }; }
    void restore(const marks & m);

    // the state before the last part placed, so that a failed ubatch is taken back exactly
    struct {
        bool      valid = false;
        llama_pos first_logical = 0;
        marks     before = {};
    } undo;

    // an empty sequence of this shape; with_rope: the layouts that record each cell's RoPE position
    void init(const std::vector<uint32_t> & heads, uint32_t cells, bool with_rope);
    // empties the sequence (its counters too: a new prompt in an emptied sequence counts from zero)
    void reset();

    // the row of (layer i, KV head h) in pos and rope
    int32_t       * pos_row (size_t i, uint32_t h)       { return pos[i].data() + (size_t) h * n_cells; }
    const int32_t * pos_row (size_t i, uint32_t h) const { return pos[i].data() + (size_t) h * n_cells; }
    int32_t       * rope_row(size_t i, uint32_t h)       { return rope[i].data() + (size_t) h * n_cells; }
    const int32_t * rope_row(size_t i, uint32_t h) const { return rope[i].data() + (size_t) h * n_cells; }

    // A part of n_tokens tokens goes to cells [first_cell, first_cell + n_tokens) at RoPE positions from first_rope;
    // the state before it becomes the undo. Its units are then recorded one by one with set_unit().
    void place_part(uint32_t first_cell, uint32_t first_rope, uint32_t n_tokens, bool output, llama_pos first_logical);
    // cell `cell` holds the token at logical position `logical`, RoPE position `rope_pos`, in every layer and KV head
    void set_unit(uint32_t cell, llama_pos logical, uint32_t rope_pos);

    // The sequence's suffix from cell `first` (>= uniform_from) is removed: its cells become free, the next token goes
    // to logical position p0 and RoPE position rope_first. When the suffix is exactly the last part placed (a failed
    // ubatch taken back), the state before it comes back instead (undo).
    void truncate(uint32_t first, uint32_t rope_first, llama_pos p0);
    // the units of logical positions [p0, p1) are relabelled by shift (RoPE positions do not change)
    void relabel(llama_pos p0, llama_pos p1, llama_pos shift);

    // An eviction to n_keep cells per (layer, KV head) is committed: pos_next (and rope_next_cells when the layout
    // records RoPE positions) hold the positions after it and are swapped in, live_next each layer's units after it;
    // restart_rope: the next part's RoPE position starts after the kept units (every layout but kept positions
    // without a repositioning). evicts: it counts as an eviction (a repositioning alone evicts nothing). Returns the
    // units evicted, summed over layers and KV heads.
    uint64_t commit_eviction(uint32_t n_keep, const std::vector<uint32_t> & live_next,
                             std::vector<std::vector<int32_t>> & pos_next,
                             std::vector<std::vector<int32_t>> & rope_next_cells, bool restart_rope, bool evicts);

    // the leading cells that hold pinned units (the same in every layer and KV head: they were placed before any
    // eviction and are never evicted)
    uint32_t pinned_cells() const;
    // the pinned positions whose queries the graph captures now (Locret-Q): n_pinned before the first eviction (the
    // ubatches' positions are then the logical ones), 0 after it or without a pin
    uint32_t pinned_to_capture() const { return n_evictions == 0 ? n_pinned : 0; }
    // a budget schedule: the cells layer i must not read, [*c0, *c1) (empty when *c0 == *c1)
    void masked_cells(size_t i, uint32_t * c0, uint32_t * c1) const {
        *c0 = std::min(live_end[i], dead_end);
        *c1 = dead_end;
    }

    // "" when the invariants above hold, else the first one broken, in words
    std::string check() const;
};

// debug builds: abort with check()'s words when the cells break an invariant (release builds: nothing)
void locret_cells_assert(const locret_cells & c);
