// One sequence's cells (locret-cells.h): the bookkeeping's changes and its invariants.

#include "locret-cells.h"

#include "ggml.h"
#include "llama-impl.h" // format

#include <algorithm>
#include <cstdio>
#include <cstdlib>

void locret_cells::restore(const marks & m) {
    n_used       = m.n_used;
    uniform_from = m.uniform_from;
    prev_output  = m.prev_output;
    logical_next = m.logical_next;
    rope_next    = m.rope_next;
    policy_state = m.policy_state;
}

void locret_cells::init(const std::vector<uint32_t> & heads, uint32_t cells, bool with_rope) {
    n_cells   = cells;
    n_head_kv = heads;
    live_end.assign(heads.size(), 0);
    pos.resize(heads.size());
    for (size_t i = 0; i < heads.size(); ++i) {
        pos[i].assign((size_t) heads[i] * cells, -1);
    }
    rope.clear();
    if (with_rope) {
        rope = pos;
    }
    reset();
}

void locret_cells::reset() {
    for (auto & p : pos) {
        std::fill(p.begin(), p.end(), -1);
    }
    for (auto & r : rope) {
        std::fill(r.begin(), r.end(), -1);
    }
    n_used       = 0;
    rope_next    = 0;
    uniform_from = 0;
    prev_output  = true;
    logical_next = 0;
    n_pinned     = 0;
    long_prompt  = false;
    policy_state = {};
    dead_end     = 0;
    std::fill(live_end.begin(), live_end.end(), 0);
    undo.valid   = false;
    n_evictions     = 0;
    n_units_evicted = 0;
}

void locret_cells::place_part(uint32_t first_cell, uint32_t first_rope, uint32_t n_tokens, bool output,
                              llama_pos first_logical) {
    GGML_ASSERT(first_cell == n_used && first_cell + n_tokens <= n_cells);
    undo.valid         = true;
    undo.first_logical = first_logical;
    undo.before        = snapshot();
    n_used      = first_cell + n_tokens;
    rope_next   = first_rope + n_tokens;
    prev_output = output;
}

void locret_cells::set_unit(uint32_t cell, llama_pos logical, uint32_t rope_pos) {
    for (size_t i = 0; i < pos.size(); ++i) {
        for (uint32_t h = 0; h < n_head_kv[i]; ++h) {
            pos_row(i, h)[cell] = logical;
            if (!rope.empty()) {
                rope_row(i, h)[cell] = (int32_t) rope_pos;
            }
        }
    }
    logical_next = std::max(logical_next, logical + 1);
}

void locret_cells::truncate(uint32_t first, uint32_t rope_first, llama_pos p0) {
    GGML_ASSERT(first >= uniform_from && first <= n_used);
    for (size_t i = 0; i < pos.size(); ++i) {
        for (uint32_t h = 0; h < n_head_kv[i]; ++h) {
            std::fill(pos_row(i, h) + first, pos_row(i, h) + n_used, -1);
            if (!rope.empty()) {
                std::fill(rope_row(i, h) + first, rope_row(i, h) + n_used, -1);
            }
        }
    }
    if (undo.valid && undo.first_logical == p0 && undo.before.n_used == first) {
        // exactly the last part placed (a failed ubatch taken back): the state before it
        restore(undo.before);
    } else {
        n_used       = first;
        rope_next    = rope_first;
        logical_next = p0;
        prev_output  = true;
    }
    undo.valid = false;
}

void locret_cells::relabel(llama_pos p0, llama_pos p1, llama_pos shift) {
    for (size_t i = 0; i < pos.size(); ++i) {
        for (uint32_t h = 0; h < n_head_kv[i]; ++h) {
            int32_t * p = pos_row(i, h);
            for (uint32_t c = 0; c < n_used; ++c) {
                if (p[c] >= p0 && p[c] < p1) {
                    p[c] += shift;
                }
            }
        }
    }
    if (logical_next >= p0 && logical_next <= p1) {
        logical_next += shift;
    }
    undo.valid = false;
}

uint64_t locret_cells::commit_eviction(uint32_t n_keep, const std::vector<uint32_t> & live_next,
                                       std::vector<std::vector<int32_t>> & pos_next,
                                       std::vector<std::vector<int32_t>> & rope_next_cells, bool restart_rope,
                                       bool evicts) {
    GGML_ASSERT(n_keep <= n_used && live_next.size() == live_end.size());
    uint64_t n_evicted = 0;
    for (size_t i = 0; i < live_end.size(); ++i) {
        const uint32_t held = n_used - (dead_end - live_end[i]);
        n_evicted += (uint64_t) n_head_kv[i] * (held - live_next[i]);
    }
    pos.swap(pos_next);
    if (!rope.empty()) {
        rope.swap(rope_next_cells);
    }
    if (restart_rope) {
        rope_next = n_keep;
    }
    live_end         = live_next;
    dead_end         = n_keep;
    n_used           = n_keep;
    uniform_from     = n_keep;
    undo.valid       = false;
    n_evictions     += evicts;
    n_units_evicted += n_evicted;
    return n_evicted;
}

uint32_t locret_cells::pinned_cells() const {
    if (n_pinned == 0 || pos.empty()) {
        return 0;
    }
    const int32_t * p = pos[0].data();
    uint32_t n = 0;
    while (n < n_used && p[n] >= 0 && p[n] < (int32_t) n_pinned) { // (-1: a cell a schedule masks)
        ++n;
    }
    return n;
}

std::string locret_cells::check() const {
    if (!(uniform_from <= n_used && n_used <= n_cells && dead_end <= uniform_from)) {
        return format("ends out of order: dead_end %u, uniform_from %u, n_used %u, n_cells %u",
                dead_end, uniform_from, n_used, n_cells);
    }
    if (live_end.size() != pos.size() || n_head_kv.size() != pos.size() || (!rope.empty() && rope.size() != pos.size())) {
        return format("shape: %zu layers of positions, %zu live ends, %zu head counts, %zu of RoPE",
                pos.size(), live_end.size(), n_head_kv.size(), rope.size());
    }
    if (undo.valid && undo.before.n_used > n_used) {
        return format("the undo names %u cells in use, more than the %u now", undo.before.n_used, n_used);
    }
    std::vector<uint8_t> seen; // RoPE positions met in one (layer, KV head)
    for (size_t i = 0; i < pos.size(); ++i) {
        if (live_end[i] > dead_end) {
            return format("layer %zu: live end %u past the dead end %u", i, live_end[i], dead_end);
        }
        for (uint32_t h = 0; h < n_head_kv[i]; ++h) {
            const int32_t * p = pos_row(i, h);
            const int32_t * r = rope.empty() ? nullptr : rope_row(i, h);
            seen.assign(r != nullptr ? rope_next : 0, 0);
            for (uint32_t c = 0; c < n_used; ++c) {
                const bool masked = c >= live_end[i] && c < dead_end;
                if (masked ? p[c] != -1 : (p[c] < 0 || p[c] >= logical_next)) {
                    return format("layer %zu, KV head %u, cell %u: logical position %d out of place", i, h, c, p[c]);
                }
                if (c >= uniform_from && (p[c] != pos_row(0, 0)[c] || (c > uniform_from && p[c] <= p[c - 1]))) {
                    return format("layer %zu, KV head %u, cell %u: logical position %d breaks the uniform part",
                            i, h, c, p[c]);
                }
                if (r == nullptr || masked) {
                    continue;
                }
                const bool uniform_ok = c < uniform_from || r[c] == (int32_t) rope_next - (int32_t) (n_used - c);
                if (r[c] < 0 || r[c] >= (int32_t) rope_next || seen[r[c]] || !uniform_ok) {
                    return format("layer %zu, KV head %u, cell %u: RoPE position %d out of place", i, h, c, r[c]);
                }
                seen[r[c]] = 1;
            }
        }
    }
    return "";
}

void locret_cells_assert(const locret_cells & c) {
#ifdef NDEBUG
    // release builds check only when asked (LOCRET_CHECK_CELLS=1: the tests run every engine test so)
    static const bool on = getenv("LOCRET_CHECK_CELLS") != nullptr && atoi(getenv("LOCRET_CHECK_CELLS")) != 0;
    if (!on) {
        return;
    }
#endif
    const std::string why = c.check();
    if (!why.empty()) {
        fprintf(stderr, "Locret: the cells' bookkeeping is broken: %s\n", why.c_str());
        GGML_ABORT("locret_cells invariant");
    }
}
