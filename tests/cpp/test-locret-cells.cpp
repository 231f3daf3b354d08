// A sequence's cells (locret-cells.h) and the layouts that evict them (locret-layout.h), without a model: the
// invariants and the words check() finds for each broken one, undo of a failed part, and each layout's moves, by hand
// and replayed on simulated keys.
//
//   test-locret-cells
#include "locret-cells.h"
#include "locret-layout.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "test-checks.h"

static bool contains(const std::string & s, const char * what) {
    return s.find(what) != std::string::npos;
}

// two evicting layers of 2 and 1 KV heads, 16 cells each
static locret_cells make_cells(bool with_rope) {
    locret_cells c;
    c.init({ 2, 1 }, 16, with_rope);
    return c;
}

// places tokens at logical positions [p0, p0 + n) as one part at the cells after those in use
static void place(locret_cells & c, llama_pos p0, uint32_t n, bool output) {
    const uint32_t first = c.n_used;
    const uint32_t rope0 = c.rope_next;
    c.place_part(first, rope0, n, output, p0);
    for (uint32_t k = 0; k < n; ++k) {
        c.set_unit(first + k, p0 + (llama_pos) k, rope0 + k);
    }
}

static void test_invariants() {
    locret_cells c = make_cells(true);
    CHECK(c.check().empty(), "an empty sequence: %s", c.check().c_str());
    place(c, 0, 6, false);
    place(c, 6, 4, true);
    CHECK(c.check().empty(), "two parts placed: %s", c.check().c_str());
    CHECK_EQ(c.n_used, 10);
    CHECK_EQ(c.logical_next, 10);
    CHECK_EQ(c.rope_next, 10);

    // each invariant broken alone is named
    locret_cells b = c;
    b.uniform_from = 11;
    CHECK(contains(b.check(), "ends out of order"), "uniform_from past n_used: '%s'", b.check().c_str());
    b = c;
    b.pos_row(1, 0)[3] = 4; // one layer's head no longer holds the uniform part's token
    CHECK(contains(b.check(), "uniform part"), "a head that differs in the uniform part: '%s'", b.check().c_str());
    b = c;
    b.pos_row(0, 1)[9] = 10; // a unit at or past logical_next
    CHECK(contains(b.check(), "out of place"), "a position past logical_next: '%s'", b.check().c_str());
    b = c;
    b.pos_row(0, 0)[2] = -1; // a cell in use that holds nothing, no schedule masking it
    CHECK(contains(b.check(), "logical position -1"), "an empty cell in use: '%s'", b.check().c_str());
    b = c;
    b.rope_row(0, 0)[1] = 7; // two cells at one RoPE position (and off the uniform part's)
    CHECK(contains(b.check(), "RoPE position"), "a RoPE position off its cell: '%s'", b.check().c_str());
    b = c;
    b.dead_end = 4; // dead end past uniform_from
    CHECK(contains(b.check(), "ends out of order"), "dead end past uniform_from: '%s'", b.check().c_str());
    b = c;
    b.live_end = { 0 };
    CHECK(contains(b.check(), "shape"), "live ends of the wrong count: '%s'", b.check().c_str());
}

// a failed ubatch is taken back exactly: truncating the last part restores the state before it
static void test_undo() {
    locret_cells c = make_cells(false);
    place(c, 0, 6, false);
    const locret_cells::marks before = c.snapshot();
    c.policy_state.word[0] = 7; // what the policy changed while placing (taken back too)
    place(c, 6, 4, true);
    c.truncate(6, 6, 6);
    CHECK_EQ(c.n_used, before.n_used);
    CHECK_EQ(c.rope_next, before.rope_next);
    CHECK_EQ(c.logical_next, before.logical_next);
    CHECK(c.prev_output == before.prev_output, "prev_output restored");
    CHECK_EQ(c.policy_state.word[0], 7); // the undo holds the state right before the last part
    CHECK(!c.undo.valid, "the undo is spent");
    for (uint32_t h = 0; h < 2; ++h) {
        CHECK_EQ(c.pos_row(0, h)[6], -1);
        CHECK_EQ(c.pos_row(0, h)[9], -1);
    }
    CHECK(c.check().empty(), "after the undo: %s", c.check().c_str());

    // a suffix that is not the last part: the next token goes where the caller says
    place(c, 6, 4, true);
    c.truncate(8, 8, 8);
    CHECK_EQ(c.n_used, 8);
    CHECK_EQ(c.logical_next, 8);
    CHECK(c.prev_output, "a truncated sequence expects a new prompt");
    CHECK(c.check().empty(), "after a truncation: %s", c.check().c_str());
}

struct moves_buf {
    std::vector<int32_t> src, delta;
    std::vector<int64_t> dst;
    locret_moves::in_place_rows rot;
    explicit moves_buf(size_t cap) : src(cap), delta(cap), dst(cap) {
        rot.row.resize(cap);
        rot.kv_row.resize(cap);
        rot.delta.resize(cap);
    }
    locret_row_moves rows(uint32_t n_head_kv, uint32_t h) {
        return { src.data(), dst.data(), delta.data(), 0, 0, n_head_kv, h, 0, 0 };
    }
};

struct move_row { int32_t from; int64_t to; int32_t delta; };

static std::vector<move_row> rows_of(const moves_buf & b, const locret_row_moves & mv) {
    std::vector<move_row> out;
    for (size_t k = 0; k < mv.n; ++k) {
        out.push_back({ b.src[k], b.dst[k], b.delta[k] });
    }
    return out;
}

static void check_rows(const char * what, const std::vector<move_row> & got, const std::vector<move_row> & want) {
    CHECK_EQ(got.size(), want.size());
    for (size_t k = 0; k < std::min(got.size(), want.size()); ++k) {
        CHECK(got[k].from == want[k].from && got[k].to == want[k].to && got[k].delta == want[k].delta,
              "%s, move %zu: %d -> %lld by %d, expected %d -> %lld by %d", what, k, got[k].from,
              (long long) got[k].to, got[k].delta, want[k].from, (long long) want[k].to, want[k].delta);
    }
}

// each layout's moves for one KV head, worked out by hand (one head, stream 0: a row is its cell)
static void test_layout_moves() {
    const int32_t pos[10]  = { 100, 101, 102, 103, 104, 105, 106, 107, 108, 109 };
    const int32_t rope[10] = { 0, 1, 2, 3, 4, 5, 6, 7, 8, 9 };
    int32_t pos_new[10], rope_new[10];
    locret_layout_scratch scratch;

    { // compact: kept cells in order at cells 0..3, positions 0..3
        const uint32_t kept[4] = { 1, 4, 5, 9 };
        moves_buf b(16);
        locret_row_moves mv = b.rows(1, 0);
        const locret_layout_head hd = { kept, 4, pos, nullptr, pos_new, nullptr, 0, 0, 0 };
        locret_layout_get(LOCRET_LAYOUT_COMPACT).place(hd, scratch, mv, nullptr);
        check_rows("compact", rows_of(b, mv), { { 1, 0, -1 }, { 4, 1, -3 }, { 5, 2, -3 }, { 9, 3, -6 } });
        CHECK(pos_new[0] == 101 && pos_new[1] == 104 && pos_new[2] == 105 && pos_new[3] == 109, "compact's positions");
        CHECK_EQ(mv.moved, 4);
        CHECK_EQ(mv.rotated, 4);
    }
    const uint32_t kept[4] = { 0, 2, 5, 7 };
    { // in place: cells 0 and 2 stay (2 re-rotated where it is, to rank 1), 5 and 7 fill the holes 1 and 3
        moves_buf b(16);
        locret_row_moves mv = b.rows(1, 0);
        const locret_layout_head hd = { kept, 4, pos, rope, pos_new, rope_new, 0, 0, 0 };
        locret_layout_get(LOCRET_LAYOUT_IN_PLACE).place(hd, scratch, mv, &b.rot);
        check_rows("in place", rows_of(b, mv), { { 5, 1, -3 }, { 7, 3, -4 } });
        CHECK(b.rot.n == 1 && b.rot.row[0] == 2 && b.rot.delta[0] == -1, "in place: cell 2 re-rotated by -1 where it is");
        CHECK(pos_new[1] == 105 && pos_new[2] == 102 && rope_new[1] == 2 && rope_new[2] == 1 && rope_new[3] == 3,
              "in place's positions");
    }
    { // kept positions: the same cells, every unit at its own position: copies only
        moves_buf b(16);
        locret_row_moves mv = b.rows(1, 0);
        const locret_layout_head hd = { kept, 4, pos, rope, pos_new, rope_new, 0, 0, 0 };
        locret_layout_get(LOCRET_LAYOUT_KEEP).place(hd, scratch, mv, nullptr);
        check_rows("keep", rows_of(b, mv), { { 5, 1, 0 }, { 7, 3, 0 } });
        CHECK(rope_new[0] == 0 && rope_new[1] == 5 && rope_new[2] == 2 && rope_new[3] == 7, "keep's RoPE positions");
        CHECK_EQ(mv.rotated, 0);
    }
    { // kept positions at their limit: by RoPE position at cells 0..3, re-rotated to 0..3
        const int32_t rope_mixed[10] = { 3, -1, 0, -1, -1, 9, -1, 4, -1, -1 };
        moves_buf b(16);
        locret_row_moves mv = b.rows(1, 0);
        const locret_layout_head hd = { kept, 4, pos, rope_mixed, pos_new, rope_new, 0, 0, 0 };
        locret_layout_get(LOCRET_LAYOUT_BY_POSITION).place(hd, scratch, mv, nullptr);
        check_rows("by position", rows_of(b, mv), { { 2, 0, 0 }, { 0, 1, -2 }, { 7, 2, -2 }, { 5, 3, -6 } });
        CHECK(pos_new[0] == 102 && pos_new[1] == 100 && pos_new[2] == 107 && pos_new[3] == 105, "by position's positions");
    }
    CHECK(locret_layout_of(false, false, false) == LOCRET_LAYOUT_COMPACT, "compact by default");
    CHECK(locret_layout_of(false, true, false) == LOCRET_LAYOUT_IN_PLACE, "in place");
    CHECK(locret_layout_of(true, false, false) == LOCRET_LAYOUT_KEEP, "kept positions");
    CHECK(locret_layout_of(true, false, true) == LOCRET_LAYOUT_BY_POSITION, "kept positions at their limit");
}

// An eviction of a sequence of two layers, replayed on simulated keys: every row holds (logical, RoPE) position; the
// moves are applied as the compaction applies them (every source read before any row is written, then the in-place
// re-rotations), and each kept cell must then hold the unit and RoPE position the cells record. Then the commit, and
// the invariants after it.
static void test_eviction_replayed(locret_layout_kind kind) {
    const bool with_rope = kind != LOCRET_LAYOUT_COMPACT;
    locret_cells c = make_cells(with_rope);
    place(c, 0, 12, false);
    const uint32_t n_keep = 5;
    // per (layer, head): the kept cells, ascending; the last two are the stabilizers (cells 10, 11)
    const std::vector<std::vector<uint32_t>> kept = { { 0, 3, 4, 10, 11 }, { 1, 2, 7, 10, 11 }, { 0, 5, 6, 10, 11 } };
    std::vector<std::vector<int32_t>> pos_next(2), rope_next(with_rope ? 2 : 0);
    const locret_layout & layout = locret_layout_get(kind);
    locret_layout_scratch scratch;
    uint64_t moved = 0;
    size_t row = 0;
    for (size_t i = 0; i < 2; ++i) {
        pos_next[i].assign(c.pos[i].size(), -1);
        if (with_rope) {
            rope_next[i].assign(c.rope[i].size(), -1);
        }
        for (uint32_t h = 0; h < c.n_head_kv[i]; ++h, ++row) {
            moves_buf b(32);
            locret_row_moves mv = b.rows(c.n_head_kv[i], h);
            const locret_layout_head hd = { kept[row].data(), n_keep, c.pos_row(i, h),
                with_rope ? c.rope_row(i, h) : nullptr, pos_next[i].data() + (size_t) h * c.n_cells,
                with_rope ? rope_next[i].data() + (size_t) h * c.n_cells : nullptr, 0, 0, 0 };
            layout.place(hd, scratch, mv, &b.rot);
            moved += mv.moved;
            // the simulated keys of this head: cell -> (logical, RoPE) before the eviction
            std::vector<std::pair<int32_t, int32_t>> key(c.n_cells);
            for (uint32_t x = 0; x < c.n_used; ++x) {
                key[x] = { c.pos_row(i, h)[x], with_rope ? c.rope_row(i, h)[x] : (int32_t) x };
            }
            std::vector<std::pair<int32_t, int32_t>> read(mv.n);
            for (size_t k = 0; k < mv.n; ++k) {
                read[k] = key[(size_t) b.src[k] / c.n_head_kv[i]];
            }
            for (size_t k = 0; k < mv.n; ++k) {
                key[(size_t) b.dst[k] / c.n_head_kv[i]] = { read[k].first, read[k].second + b.delta[k] };
            }
            for (size_t k = 0; k < b.rot.n; ++k) {
                key[(size_t) b.rot.row[k] / c.n_head_kv[i]].second += b.rot.delta[k];
            }
            for (uint32_t x = 0; x < n_keep; ++x) {
                const int32_t want_pos  = pos_next[i][(size_t) h * c.n_cells + x];
                const int32_t want_rope = with_rope ? rope_next[i][(size_t) h * c.n_cells + x] : (int32_t) x;
                CHECK(key[x].first == want_pos && key[x].second == want_rope,
                      "%s, layer %zu head %u cell %u: holds (%d, %d), the cells say (%d, %d)", layout.name(), i, h, x,
                      key[x].first, key[x].second, want_pos, want_rope);
            }
            // the kept units, no other
            std::vector<int32_t> got(pos_next[i].begin() + (size_t) h * c.n_cells,
                                     pos_next[i].begin() + (size_t) h * c.n_cells + n_keep);
            std::sort(got.begin(), got.end());
            for (uint32_t x = 0; x < n_keep; ++x) {
                CHECK_EQ(got[x], (int32_t) kept[row][x]); // logical position == cell before (placed from 0)
            }
        }
    }
    CHECK(moved > 0, "%s moved nothing", layout.name());
    const std::vector<uint32_t> live = { n_keep, n_keep };
    const bool restart = kind != LOCRET_LAYOUT_KEEP;
    const uint64_t evicted = c.commit_eviction(n_keep, live, pos_next, rope_next, restart, true);
    CHECK_EQ(evicted, (12 - n_keep) * 3);
    CHECK_EQ(c.n_used, n_keep);
    CHECK_EQ(c.uniform_from, n_keep);
    CHECK_EQ(c.dead_end, n_keep);
    CHECK_EQ(c.rope_next, restart ? n_keep : 12);
    CHECK_EQ(c.n_evictions, 1);
    CHECK(c.check().empty(), "%s: after the eviction: %s", layout.name(), c.check().c_str());
    // the next part continues from the cells and positions the eviction left
    place(c, 12, 3, true);
    CHECK(c.check().empty(), "%s: a part after the eviction: %s", layout.name(), c.check().c_str());
}

int main() {
    test_invariants();
    test_undo();
    test_layout_moves();
    test_eviction_replayed(LOCRET_LAYOUT_COMPACT);
    test_eviction_replayed(LOCRET_LAYOUT_IN_PLACE);
    test_eviction_replayed(LOCRET_LAYOUT_KEEP);
    test_eviction_replayed(LOCRET_LAYOUT_BY_POSITION);
    if (g_failures > 0) {
        fprintf(stderr, "test-locret-cells: %d checks failed\n", g_failures);
        return 1;
    }
    printf("test-locret-cells: all checks passed\n");
    return 0;
}
