// Ubatch planning of the Locret memory (see locret-plan.h): pure functions of the streams' state and the batch.

#include "locret-plan.h"

#include <algorithm>
#include <cstdarg>
#include <cstdio>

static std::string plan_format(const char * fmt, ...) {
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    return buf;
}

static locret_plan_error plan_fail(locret_plan_status status, std::string msg) {
    locret_plan_error e;
    e.status = status;
    e.msg    = std::move(msg);
    return e;
}

locret_plan_error locret_plan_scan(uint32_t n_tokens, const int32_t * n_seq_id, const llama_seq_id * const * seq_id,
                                   const int8_t * logits, uint32_t n_streams, locret_batch_seqs & out) {
    out.count.assign(n_streams, 0);
    out.ends_with_output.assign(n_streams, false);
    out.n_seqs   = 0;
    out.one_each = false;
    for (uint32_t i = 0; i < n_tokens; ++i) {
        if (n_seq_id[i] != 1) {
            return plan_fail(LOCRET_PLAN_MULTI_SEQ, plan_format("a token belongs to %d sequences; an evicting cache keeps "
                    "each sequence on its own", n_seq_id[i]));
        }
        const llama_seq_id s = seq_id[i][0];
        if (s < 0 || (uint32_t) s >= n_streams) {
            return plan_fail(LOCRET_PLAN_SEQ_RANGE, plan_format("sequence %d is out of range (%u sequences)", s, n_streams));
        }
        out.n_seqs += out.count[s] == 0;
        out.count[s]++;
        // the last token of the sequence decides: a batch ends a prompt when that token asks for an output
        out.ends_with_output[s] = logits != nullptr && logits[i] != 0;
    }
    out.one_each = out.n_seqs > 1 && std::all_of(out.count.begin(), out.count.end(), [](uint32_t c) { return c <= 1; });
    return {};
}

bool locret_plan_tail_alone(const locret_plan_params & p, const locret_plan_stream & s, uint32_t n_tokens) {
    if (p.local == 0) {
        return false;
    }
    if (p.selects_once) {
        return true;
    }
    // no rule of Algorithm 1 fires while the layer nearest its budget stays within it (after a chunk: more than b;
    // before a part: past b + B), nor a repositioning while positions stay below the limit
    const bool may_evict      = (uint64_t) s.n_used + s.lead + n_tokens > p.budget;
    const bool may_reposition = p.keep_positions && (uint64_t) s.rope_next + n_tokens > p.position_limit;
    return may_evict || may_reposition;
}

uint32_t locret_plan_take(uint32_t n_ubatch, uint32_t local, uint32_t remaining, bool tail_alone) {
    uint32_t take = std::min(n_ubatch, remaining);
    if (local > 0 && tail_alone && remaining > local) {
        // the prompt's local tail goes alone, after the compression of what precedes it
        take = std::min(take, remaining - local);
    }
    return take;
}

uint32_t locret_plan_eviction(const locret_plan_params & p, uint32_t n_used, bool prev_output, bool selection_due,
                              uint32_t n_tokens, bool output, uint32_t * n_stab) {
    *n_stab = 0;
    if (p.selects_once) {
        // a policy that selects once: never while a prompt is read; its one selection at the first part after the prompt's end; then the
        // recent window slides when generation would pass the budget by a ubatch (evict() splits what stays)
        if (!prev_output) {
            return n_used;
        }
        if (selection_due || n_used + n_tokens > p.budget + p.n_ubatch) {
            return std::min(p.budget, n_used);
        }
        return n_used;
    }
    if (!prev_output && n_used > p.budget) {
        // after a prefill chunk; the chunk before the prompt's tail is the final one: no stabilizers
        *n_stab = output ? 0 : std::min(p.stabilizers, n_used);
        return p.budget;
    }
    if (n_used + n_tokens > p.capacity) {
        return std::min(p.budget, n_used);
    }
    return n_used;
}

bool locret_plan_due(const locret_plan_params & p, const locret_plan_stream & s, uint32_t n_tokens, bool output,
                     uint32_t * n_keep, uint32_t * n_stab) {
    // the rule is the one of the layer nearest its budget, which holds `fullest` units against the largest budget
    // (the uniform case: every layer holds n_used); at an eviction every layer keeps at most its own budget, so the
    // largest, which is never masked, keeps min(b_max, n_used)
    const uint32_t fullest = s.n_used + s.lead;
    const uint32_t k = locret_plan_eviction(p, fullest, s.prev_output, s.selection_due, n_tokens, output, n_stab);
    *n_stab = std::min(*n_stab, s.n_used);
    if (k >= fullest) {
        *n_keep = s.n_used;
        return false;
    }
    *n_keep = std::min(k, s.n_used);
    return true;
}

uint32_t locret_plan_lead_after(const locret_plan_params & p, uint32_t n_used, uint32_t lead, uint32_t n_keep) {
    // the most a layer holds over its budget, n_used + lead - b_max, drops to min(0, that): every layer over its budget
    // keeps its budget, the others all they hold
    const int64_t over = (int64_t) n_used + lead - p.budget;
    return (uint32_t) (std::min<int64_t>(0, over) + p.budget - n_keep);
}

uint32_t locret_plan_room(const locret_plan_params & p, const locret_plan_stream & s) {
    if (p.selects_once) {
        return 1;
    }
    // what a single generated token meets: an eviction (to n_keep units) and, with kept positions, a repositioning
    uint32_t n_stab = 0;
    uint32_t n_keep = 0;
    const bool due = locret_plan_due(p, s, 1, true, &n_keep, &n_stab);
    const bool reposition = p.keep_positions && s.rope_next + 1 > p.position_limit;
    if (reposition) {
        n_keep = std::min(n_keep, p.budget);
    }
    // a longer part meets the same eviction (the rule for a generation part depends on its size only through
    // fullest + n_tokens > capacity, true for one token already); after it, or without one, the part must stay within
    // the capacity of the layer nearest its budget, where the token-by-token run evicts next, and within the cells
    const uint32_t used  = n_keep; // == s.n_used without an eviction
    const uint32_t lead  = due || reposition ? locret_plan_lead_after(p, s.n_used, s.lead, n_keep) : s.lead;
    uint32_t room = p.capacity > used + lead ? p.capacity - used - lead : 0;
    room = std::min(room, p.n_cells > used ? p.n_cells - used : 0);
    if (p.keep_positions) {
        const uint32_t rope = reposition ? n_keep : s.rope_next;
        room = std::min(room, p.position_limit > rope ? p.position_limit - rope : 0);
    }
    return std::max(room, 1u);
}

// The part of the ubatch that starts at token i0 (tokens of one sequence are consecutive): its stream *s, its length
// *n and whether any of its tokens asks for an output (*output); an error for a sequence out of range.
static locret_plan_error plan_part(const locret_plan_tokens & ub, uint32_t i0, size_t n_streams, uint32_t * s,
                                   uint32_t * n, bool * output) {
    const llama_seq_id seq = ub.seq_id[i0][0];
    if (seq < 0 || (size_t) seq >= n_streams) {
        return plan_fail(LOCRET_PLAN_SEQ_RANGE, plan_format("sequence %d is out of range (%u sequences)", seq,
                (uint32_t) n_streams));
    }
    *s = (uint32_t) seq;
    *n = 1;
    while (i0 + *n < ub.n_tokens && ub.seq_id[i0 + *n][0] == seq) {
        ++*n;
    }
    *output = false;
    for (uint32_t i = i0; i < i0 + *n; ++i) {
        *output = *output || ub.output[i] != 0;
    }
    return {};
}

// The step of a part of n tokens of stream s after `sim`: the eviction (and repositioning) before it, which advances
// sim's lead, and its first cell and RoPE position; an error when the part does not fit.
static locret_plan_error plan_step(const locret_plan_params & p, locret_plan_stream & sim, uint32_t s, uint32_t n,
                                   llama_pos first_logical, bool output, locret_step & st) {
    st.strm          = s;
    const bool due   = locret_plan_due(p, sim, n, output, &st.n_keep, &st.n_stab);
    // kept positions: a part that would pass the position limit goes after an eviction that also compacts
    // positions; it keeps at most the budget, so that every kept cell is one a position below the budget's (the
    // cache's own cell positions stay below the next part's), and every layer at most its own
    st.reposition    = p.keep_positions && sim.rope_next + n > p.position_limit;
    if (st.reposition) {
        st.n_keep = std::min(st.n_keep, p.budget);
    }
    st.evict = due || (st.reposition && sim.n_used + sim.lead > p.budget);
    if (st.evict || st.reposition) {
        sim.lead = locret_plan_lead_after(p, sim.n_used, sim.lead, st.n_keep);
    }
    st.first_cell    = st.n_keep;
    st.n_tokens      = n;
    st.first_logical = first_logical;
    st.output        = output;
    if (p.selects_once && st.first_cell + n > p.capacity) {
        return plan_fail(LOCRET_PLAN_PROMPT_TOO_LONG, plan_format("the policy keeps the whole prompt until its end: "
                "sequence %u would hold %u units, more than the context per sequence (%u); raise -c or shorten the "
                "prompt", s, st.first_cell + n, p.capacity));
    }
    if (st.first_cell + n > p.n_cells) {
        return plan_fail(LOCRET_PLAN_NO_ROOM, plan_format("a part of %u tokens does not fit after %u retained units "
                "in %u cells", n, st.first_cell, p.n_cells));
    }
    // its RoPE positions: its cells (compact positions, or after compacting them), else on from the last part
    st.first_rope = p.keep_positions && !st.reposition ? sim.rope_next : st.first_cell;
    return {};
}

// Places the part of step st that starts at token i0: per token its stream, cell, RoPE position and position in the
// window cache's frame; then advances the stream past it.
static void plan_place(const locret_plan_params & p, const locret_plan_tokens & ub, uint32_t i0, const locret_step & st,
                       locret_plan_stream & sim, locret_ubatch_plan & plan, std::vector<llama_pos> & frame) {
    const uint32_t n = st.n_tokens;
    for (uint32_t j = 0; j < n; ++j) {
        plan.strm[i0 + j] = st.strm;
        plan.cell[i0 + j] = st.first_cell + j;
        plan.rope[i0 + j] = st.first_rope + j;
        frame[i0 + j]     = ub.pos[i0 + j] - sim.offset;
    }
    if (p.selects_once) {
        // as placed() and evict() will set it
        const bool end = locret_plan_prompt_end(sim.prev_output, n, st.output);
        sim.selection_due = end ? st.first_cell + n > p.budget : sim.selection_due && st.n_keep == sim.n_used;
    }
    sim.n_used      = st.first_cell + n;
    sim.rope_next   = st.first_rope + n;
    sim.prev_output = st.output;
}

locret_plan_error locret_plan_ubatch(const locret_plan_params & p, const locret_plan_tokens & ub,
                                     std::vector<locret_plan_stream> & streams, locret_ubatch_plan & plan,
                                     std::vector<llama_pos> & frame) {
    if (ub.n_tokens == 0) {
        return plan_fail(LOCRET_PLAN_EMPTY, "a ubatch without tokens");
    }
    plan.steps.clear();
    plan.logical.assign(ub.pos, ub.pos + ub.n_tokens);
    plan.strm.resize(ub.n_tokens);
    plan.cell.resize(ub.n_tokens);
    plan.rope.resize(ub.n_tokens);
    frame.resize(ub.n_tokens);

    // the parts of the ubatch: tokens of one sequence are consecutive (split_simple / split_seq: one part;
    // split_equal: n_seq_tokens per sequence)
    uint32_t s_min = UINT32_MAX;
    uint32_t s_max = 0;
    uint32_t i0    = 0;
    while (i0 < ub.n_tokens) {
        uint32_t s      = 0;
        uint32_t n      = 0;
        bool     output = false;
        locret_plan_error e = plan_part(ub, i0, streams.size(), &s, &n, &output);
        if (!e.ok()) {
            return e;
        }
        locret_plan_stream & sim = streams[s];

        locret_step st;
        e = plan_step(p, sim, s, n, ub.pos[i0], output, st);
        if (!e.ok()) {
            return e;
        }
        plan_place(p, ub, i0, st, sim, plan, frame);
        plan.steps.push_back(st);

        s_min = std::min(s_min, s);
        s_max = std::max(s_max, s);
        i0 += n;
    }
    // llama.cpp's slot_info holds the streams [s0, s1] of a ubatch, one part each
    if (s_max - s_min + 1 != plan.steps.size()) {
        return plan_fail(LOCRET_PLAN_NOT_CONSECUTIVE, "a ubatch's sequences are not consecutive streams");
    }
    return {};
}
