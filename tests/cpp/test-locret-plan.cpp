// The Locret memory's ubatch planning (locret-plan.h) against hand-computed plans: no model, no context, no backend.
//
//   test-locret-plan
//
// Most cases use the settings of tests/py/test_eviction.py: b = 96, B = 32 (capacity b + B = 128, 256 cells), n_s = 16,
// n_loc = 8. Every expectation below was worked out by hand from Algorithm 1 as docs/memory.md states it; the
// comments show the arithmetic.
#include "locret-plan.h"

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "test-checks.h"

static locret_plan_params params_locret() {
    locret_plan_params p;
    p.budget       = 96;
    p.stabilizers  = 16;
    p.local        = 8;
    p.n_ubatch     = 32;
    p.capacity     = 128;
    p.n_cells      = 256;
    p.selects_once = false;
    return p;
}

// SAGE-KV as locret_settings_resolve makes it: n_s = b/4 (the recent window), no local tail, capacity = the context per
// sequence (-c 1024 with one sequence), cells = capacity padded to 256
static locret_plan_params params_sage() {
    locret_plan_params p;
    p.budget       = 96;
    p.stabilizers  = 24;
    p.local        = 0;
    p.n_ubatch     = 32;
    p.capacity     = 1024;
    p.n_cells      = 1024;
    p.selects_once = true;
    return p;
}

// a ubatch built token by token, as llama.cpp's splitter would give it
struct ubatch_in {
    std::vector<llama_pos>      pos;
    std::vector<llama_seq_id>   seq;
    std::vector<int8_t>         out;
    std::vector<llama_seq_id *> seq_ptr;

    // n tokens of sequence s at positions pos0.., the last one asking for an output when `output`
    ubatch_in & add(llama_seq_id s, llama_pos pos0, uint32_t n, bool output) {
        for (uint32_t j = 0; j < n; ++j) {
            pos.push_back(pos0 + (llama_pos) j);
            seq.push_back(s);
            out.push_back(output && j + 1 == n ? 1 : 0);
        }
        return *this;
    }

    locret_plan_tokens view() {
        seq_ptr.resize(seq.size());
        for (size_t i = 0; i < seq.size(); ++i) {
            seq_ptr[i] = &seq[i];
        }
        locret_plan_tokens t;
        t.n_tokens = (uint32_t) pos.size();
        t.pos      = pos.data();
        t.seq_id   = seq_ptr.data();
        t.output   = out.data();
        return t;
    }
};

static locret_plan_stream stream_at(uint32_t n_used, bool prev_output, llama_pos logical_next, bool selection_due = false) {
    locret_plan_stream s;
    s.n_used      = n_used;
    s.prev_output = prev_output;
    s.rope_next   = n_used; // compact positions: a token's RoPE position is its cell
    s.offset      = logical_next - (llama_pos) n_used;
    s.selection_due  = selection_due;
    return s;
}

// a stream with kept positions: its next RoPE position runs ahead of its cells by the units evicted so far
static locret_plan_stream stream_kept(uint32_t n_used, bool prev_output, llama_pos logical_next, uint32_t rope_next) {
    locret_plan_stream s = stream_at(n_used, prev_output, logical_next);
    s.rope_next = rope_next;
    s.offset    = logical_next - (llama_pos) rope_next;
    return s;
}

// plans ub after `streams`; CHECKs that it succeeds
static locret_ubatch_plan plan_ok(const locret_plan_params & p, ubatch_in & ub, std::vector<locret_plan_stream> & streams,
                                  std::vector<llama_pos> & frame) {
    locret_ubatch_plan plan;
    const locret_plan_error err = locret_plan_ubatch(p, ub.view(), streams, plan, frame);
    CHECK(err.ok(), "unexpected error %d: %s", (int) err.status, err.msg.c_str());
    return plan;
}

// one step's expected values
static void check_step(const locret_step & st, uint32_t strm, uint32_t n_keep, uint32_t n_stab, uint32_t first_cell,
                       uint32_t n_tokens, llama_pos first_logical, bool output) {
    CHECK_EQ(st.strm, strm);
    CHECK_EQ(st.n_keep, n_keep);
    CHECK_EQ(st.n_stab, n_stab);
    CHECK_EQ(st.first_cell, first_cell);
    CHECK_EQ(st.n_tokens, n_tokens);
    CHECK_EQ(st.first_logical, first_logical);
    CHECK_EQ(st.output, output);
}

// a prompt end's last n_loc tokens go alone; chunks are at most B
static void test_take() {
    // 136 prompt tokens ending the prompt, B = 32, n_loc = 8: 32, 32, 32, 32 and the 8-token tail
    // (at 40 remaining: min(32, 40 - 8) = 32; at 8: the tail itself)
    {
        const uint32_t expect[] = { 32, 32, 32, 32, 8 };
        uint32_t remaining = 136;
        for (uint32_t e : expect) {
            const uint32_t take = locret_plan_take(32, 8, remaining, true);
            CHECK_EQ(take, e);
            remaining -= take;
        }
        CHECK_EQ(remaining, 0);
    }
    // 44 prompt tokens ending the prompt: 32, then min(12, 12 - 8) = 4, then the tail of 8
    CHECK_EQ(locret_plan_take(32, 8, 44, true), 32);
    CHECK_EQ(locret_plan_take(32, 8, 12, true), 4);
    CHECK_EQ(locret_plan_take(32, 8, 8, true), 8);
    // fewer tokens than the tail: all together
    CHECK_EQ(locret_plan_take(32, 8, 5, true), 5);
    // no prompt end (no output on the batch's last token of the sequence): plain chunks of B
    CHECK_EQ(locret_plan_take(32, 8, 44, false), 32);
    CHECK_EQ(locret_plan_take(32, 8, 12, false), 12);
    // no local tail (n_loc = 0, SAGE-KV): plain chunks
    CHECK_EQ(locret_plan_take(32, 0, 12, true), 12);
    // generation: one token
    CHECK_EQ(locret_plan_take(32, 8, 1, true), 1);
}

// the local tail goes alone only when something may be evicted before it: whenever it is not split off, placing the
// prompt in plain chunks of B evicts nothing (checked part by part with the rule the planner applies), and a prompt
// that passes the budget keeps its tail apart
static void test_tail_alone() {
    locret_plan_params p = params_locret();
    uint32_t n_unsplit = 0;
    for (uint32_t lead : { 0u, 20u }) {
        for (uint32_t n_used = 0; n_used + lead <= 140; ++n_used) {
            for (int prev = 0; prev < 2; ++prev) {
                for (uint32_t n_tokens = 1; n_tokens <= 200; ++n_tokens) {
                    locret_plan_stream s;
                    s.n_used = n_used; s.lead = lead; s.prev_output = prev != 0; s.rope_next = n_used;
                    const bool alone = locret_plan_tail_alone(p, s, n_tokens);
                    CHECK_EQ(alone, n_used + lead + n_tokens > p.budget);
                    if (alone) {
                        continue;
                    }
                    ++n_unsplit;
                    for (uint32_t remaining = n_tokens; remaining > 0; ) {
                        const uint32_t take = locret_plan_take(p.n_ubatch, p.local, remaining, false);
                        uint32_t n_keep = 0, n_stab = 0;
                        CHECK(!locret_plan_due(p, s, take, take == remaining, &n_keep, &n_stab),
                              "an unsplit prompt evicts: n_used %u lead %u tokens %u", n_used, lead, n_tokens);
                        s.n_used += take; s.rope_next += take; s.prev_output = take == remaining;
                        remaining -= take;
                    }
                }
            }
        }
    }
    CHECK(n_unsplit > 1000, "too few unsplit cases checked: %u", n_unsplit);
    // kept positions: a prompt that would pass the position limit keeps its tail apart (a repositioning may come first)
    p.keep_positions = true;
    p.position_limit = 200;
    locret_plan_stream s;
    s.n_used = 10; s.rope_next = 190;
    CHECK(locret_plan_tail_alone(p, s, 10) == false, "within the limit");
    CHECK(locret_plan_tail_alone(p, s, 11) == true, "past the limit");
    // no local tail: nothing to split; SAGE-KV with one: always apart
    CHECK(locret_plan_tail_alone(params_sage(), s, 10) == false, "SAGE-KV without a tail");
    locret_plan_params sage = params_sage();
    sage.local = 8;
    CHECK(locret_plan_tail_alone(sage, s, 10) == true, "SAGE-KV with a tail");
}

// the batch scan: tokens per sequence, prompt ends, generation in one ubatch, and the refusals
static void test_scan() {
    // seq 0: 3 tokens, last asks; seq 2: 2 tokens, last does not (an earlier one does); seq 1 absent
    {
        const int32_t      n_seq_id[] = { 1, 1, 1, 1, 1 };
        llama_seq_id       ids[]      = { 0, 2, 0, 2, 0 };
        const llama_seq_id * seq_id[] = { &ids[0], &ids[1], &ids[2], &ids[3], &ids[4] };
        const int8_t       logits[]   = { 0, 1, 0, 0, 1 };
        locret_batch_seqs seqs;
        const locret_plan_error err = locret_plan_scan(5, n_seq_id, seq_id, logits, 4, seqs);
        CHECK(err.ok(), "%s", err.msg.c_str());
        CHECK_EQ(seqs.count.size(), 4);
        CHECK_EQ(seqs.count[0], 3);
        CHECK_EQ(seqs.count[1], 0);
        CHECK_EQ(seqs.count[2], 2);
        CHECK_EQ(seqs.count[3], 0);
        CHECK_EQ(seqs.ends_with_output[0], true);
        CHECK_EQ(seqs.ends_with_output[2], false);
        CHECK_EQ(seqs.n_seqs, 2);
        CHECK_EQ(seqs.one_each, false);

        // without logits nothing ends a prompt
        CHECK(locret_plan_scan(5, n_seq_id, seq_id, nullptr, 4, seqs).ok(), "no logits");
        CHECK_EQ(seqs.ends_with_output[0], false);
    }
    // generation: one token of each of three sequences goes in one ubatch
    {
        const int32_t      n_seq_id[] = { 1, 1, 1 };
        llama_seq_id       ids[]      = { 1, 0, 3 };
        const llama_seq_id * seq_id[] = { &ids[0], &ids[1], &ids[2] };
        const int8_t       logits[]   = { 1, 1, 1 };
        locret_batch_seqs seqs;
        CHECK(locret_plan_scan(3, n_seq_id, seq_id, logits, 4, seqs).ok(), "generation batch");
        CHECK_EQ(seqs.n_seqs, 3);
        CHECK_EQ(seqs.one_each, true);
        // a single sequence's single token is not "one each" (it needs no equal split)
        CHECK(locret_plan_scan(1, n_seq_id, seq_id, logits, 4, seqs).ok(), "one token");
        CHECK_EQ(seqs.n_seqs, 1);
        CHECK_EQ(seqs.one_each, false);
    }
    // a token of two sequences: an evicting cache keeps each on its own
    {
        const int32_t      n_seq_id[] = { 1, 2 };
        llama_seq_id       ids0[]     = { 0 };
        llama_seq_id       ids1[]     = { 0, 1 };
        const llama_seq_id * seq_id[] = { ids0, ids1 };
        locret_batch_seqs seqs;
        const locret_plan_error err = locret_plan_scan(2, n_seq_id, seq_id, nullptr, 2, seqs);
        CHECK_EQ(err.status, LOCRET_PLAN_MULTI_SEQ);
        CHECK(err.msg == "a token belongs to 2 sequences; an evicting cache keeps each sequence on its own", "%s",
              err.msg.c_str());
    }
    // sequences out of range, above and below
    {
        const int32_t      n_seq_id[] = { 1 };
        llama_seq_id       ids[]      = { 4 };
        const llama_seq_id * seq_id[] = { ids };
        locret_batch_seqs seqs;
        locret_plan_error err = locret_plan_scan(1, n_seq_id, seq_id, nullptr, 4, seqs);
        CHECK_EQ(err.status, LOCRET_PLAN_SEQ_RANGE);
        CHECK(err.msg == "sequence 4 is out of range (4 sequences)", "%s", err.msg.c_str());
        ids[0] = -1;
        err = locret_plan_scan(1, n_seq_id, seq_id, nullptr, 4, seqs);
        CHECK_EQ(err.status, LOCRET_PLAN_SEQ_RANGE);
        CHECK(err.msg == "sequence -1 is out of range (4 sequences)", "%s", err.msg.c_str());
    }
}

// Algorithm 1's eviction rule on its own
static void test_eviction_rule() {
    const locret_plan_params p = params_locret();
    uint32_t n_stab = 99;

    // prefill, within the budget: nothing evicted (96 is not above b = 96)
    CHECK_EQ(locret_plan_eviction(p, 96, false, false, 32, false, &n_stab), 96);
    CHECK_EQ(n_stab, 0);
    // prefill past the budget: back to b, the last n_s kept as stabilizers
    CHECK_EQ(locret_plan_eviction(p, 128, false, false, 32, false, &n_stab), 96);
    CHECK_EQ(n_stab, 16);
    // the chunk before the prompt's tail (the tail asks for the output) is the final one: no stabilizers
    CHECK_EQ(locret_plan_eviction(p, 128, false, false, 8, true, &n_stab), 96);
    CHECK_EQ(n_stab, 0);
    // after generation (prev_output): only when the part would pass b + B = 128
    CHECK_EQ(locret_plan_eviction(p, 127, true, false, 1, true, &n_stab), 127);
    CHECK_EQ(locret_plan_eviction(p, 128, true, false, 1, true, &n_stab), 96);
    CHECK_EQ(n_stab, 0);
    // a new prompt after generation: 100 + 32 = 132 > 128 evicts, every unit scored alike (no stabilizers)
    CHECK_EQ(locret_plan_eviction(p, 100, true, false, 32, false, &n_stab), 96);
    CHECK_EQ(n_stab, 0);
    // 90 + 40 > 128 but 90 units are within the budget: nothing to drop, min(b, n_used) = 90
    CHECK_EQ(locret_plan_eviction(p, 90, true, false, 40, false, &n_stab), 90);
}

// one sequence's prompt of 168 tokens in one batch: five chunks and the tail, cells and positions of each
static void test_prompt_chunks() {
    const locret_plan_params p = params_locret();
    std::vector<locret_plan_stream> streams = { stream_at(0, true, 0) };
    std::vector<llama_pos> frame;

    // takes: 32 x 5 (at 40 remaining min(32, 40 - 8) = 32) and the tail of 8
    // chunk k (positions 32k..32k+31) after n_used = 32k: no eviction while n_used <= 96 and n_used + 32 <= 128
    for (uint32_t k = 0; k < 4; ++k) {
        ubatch_in ub;
        ub.add(0, (llama_pos) (32*k), 32, false);
        const locret_ubatch_plan plan = plan_ok(p, ub, streams, frame);
        CHECK_EQ(plan.steps.size(), 1);
        check_step(plan.steps[0], 0, 32*k, 0, 32*k, 32, (llama_pos) (32*k), false);
        CHECK_EQ(plan.cell[0], 32*k);
        CHECK_EQ(plan.cell[31], 32*k + 31);
        CHECK_EQ(plan.logical[31], 32*k + 31);
        CHECK_EQ(frame[31], 32*k + 31);
        CHECK_EQ(streams[0].n_used, 32*(k + 1));
        CHECK_EQ(streams[0].prev_output, false);
    }
    // chunk 4 (positions 128..159): 128 > b after a prefill chunk: evict to 96 keeping 16 stabilizers, cells 96..127
    {
        ubatch_in ub;
        ub.add(0, 128, 32, false);
        const locret_ubatch_plan plan = plan_ok(p, ub, streams, frame);
        check_step(plan.steps[0], 0, 96, 16, 96, 32, 128, false);
        CHECK_EQ(plan.cell[0], 96);
        CHECK_EQ(plan.cell[31], 127);
        CHECK_EQ(plan.logical[0], 128);
        CHECK_EQ(plan.strm[0], 0);
        // the window cache's frame is the batch's start frame (offset 0): logical positions
        CHECK_EQ(frame[0], 128);
        CHECK_EQ(streams[0].n_used, 128);
    }
    // the tail (positions 160..167, the last asks): the final chunk's eviction without stabilizers, cells 96..103
    {
        ubatch_in ub;
        ub.add(0, 160, 8, true);
        const locret_ubatch_plan plan = plan_ok(p, ub, streams, frame);
        check_step(plan.steps[0], 0, 96, 0, 96, 8, 160, true);
        CHECK_EQ(plan.cell[7], 103);
        CHECK_EQ(plan.logical[7], 167);
        CHECK_EQ(frame[7], 167);
        CHECK_EQ(streams[0].n_used, 104);
        CHECK_EQ(streams[0].prev_output, true);
        CHECK_EQ(streams[0].offset, 0); // constant over a batch
    }
}

// generation after the prompt: the cache fills to b + B and evicts back to b
static void test_generation() {
    const locret_plan_params p = params_locret();
    // 127 units held for logical positions up to 190: offset 191 - 127 = 64
    std::vector<locret_plan_stream> streams = { stream_at(127, true, 191) };
    std::vector<llama_pos> frame;
    {
        ubatch_in ub;
        ub.add(0, 191, 1, true);
        const locret_ubatch_plan plan = plan_ok(p, ub, streams, frame);
        // 127 + 1 = 128 fits b + B: no eviction, cell 127
        check_step(plan.steps[0], 0, 127, 0, 127, 1, 191, true);
        CHECK_EQ(plan.cell[0], 127);
        CHECK_EQ(frame[0], 191 - 64);
    }
    {
        ubatch_in ub;
        ub.add(0, 192, 1, true);
        const locret_ubatch_plan plan = plan_ok(p, ub, streams, frame);
        // 128 + 1 > 128: evict to 96, the token goes to cell 96; its frame position is still the batch start's
        check_step(plan.steps[0], 0, 96, 0, 96, 1, 192, true);
        CHECK_EQ(plan.cell[0], 96);
        CHECK_EQ(frame[0], 192 - 64);
        CHECK_EQ(streams[0].n_used, 97);
    }
    // a new prompt after generation (no output yet): 100 + 32 > 128 evicts to 96 without stabilizers; the next chunk
    // follows a prefill chunk with 128 > 96 units: evict to 96 with 16 stabilizers
    {
        std::vector<locret_plan_stream> s2 = { stream_at(100, true, 500) };
        ubatch_in ub0;
        ub0.add(0, 500, 32, false);
        check_step(plan_ok(p, ub0, s2, frame).steps[0], 0, 96, 0, 96, 32, 500, false);
        ubatch_in ub1;
        ub1.add(0, 532, 32, false);
        const locret_ubatch_plan plan = plan_ok(p, ub1, s2, frame);
        check_step(plan.steps[0], 0, 96, 16, 96, 32, 532, false);
        // offset 500 - 100 = 400: the frame of position 532 is 132 (past the cells: the window cache's own frame)
        CHECK_EQ(frame[0], 132);
    }
}

// several sequences in one ubatch (generation, one token each) and one per ubatch (split_seq)
static void test_several_sequences() {
    const locret_plan_params p = params_locret();
    std::vector<locret_plan_stream> streams = {
        stream_at(128, true, 300), // full: evicts to 96
        stream_at( 50, true,  60), // far from full
        stream_at(127, true, 500), // exactly fills b + B
    };
    std::vector<llama_pos> frame;
    {
        ubatch_in ub;
        ub.add(0, 300, 1, true).add(1, 60, 1, true).add(2, 500, 1, true);
        const locret_ubatch_plan plan = plan_ok(p, ub, streams, frame);
        CHECK_EQ(plan.steps.size(), 3);
        check_step(plan.steps[0], 0, 96,  0, 96,  1, 300, true);
        check_step(plan.steps[1], 1, 50,  0, 50,  1,  60, true);
        check_step(plan.steps[2], 2, 127, 0, 127, 1, 500, true);
        const uint32_t cells[] = { 96, 50, 127 };
        const llama_pos frames[] = { 300 - 172, 60 - 10, 500 - 373 };
        for (int t = 0; t < 3; ++t) {
            CHECK_EQ(plan.strm[t], t);
            CHECK_EQ(plan.cell[t], cells[t]);
            CHECK_EQ(frame[t], frames[t]);
        }
        CHECK_EQ(streams[0].n_used, 97);
        CHECK_EQ(streams[1].n_used, 51);
        CHECK_EQ(streams[2].n_used, 128);
    }
    // the next ubatch: stream 2 is now at 128 and evicts; 0 and 1 do not
    {
        ubatch_in ub;
        ub.add(0, 301, 1, true).add(1, 61, 1, true).add(2, 501, 1, true);
        const locret_ubatch_plan plan = plan_ok(p, ub, streams, frame);
        check_step(plan.steps[0], 0, 97, 0, 97, 1, 301, true);
        check_step(plan.steps[1], 1, 51, 0, 51, 1,  61, true);
        check_step(plan.steps[2], 2, 96, 0, 96, 1, 501, true);
    }
    // two tokens per sequence (split_equal with n_seq_tokens = 2): two parts of two tokens
    {
        std::vector<locret_plan_stream> s2 = { stream_at(10, true, 10), stream_at(20, true, 40) };
        ubatch_in ub;
        ub.add(0, 10, 2, true).add(1, 40, 2, true);
        const locret_ubatch_plan plan = plan_ok(p, ub, s2, frame);
        CHECK_EQ(plan.steps.size(), 2);
        check_step(plan.steps[0], 0, 10, 0, 10, 2, 10, true);
        check_step(plan.steps[1], 1, 20, 0, 20, 2, 40, true);
        const uint32_t cells[] = { 10, 11, 20, 21 };
        const uint32_t strms[] = { 0, 0, 1, 1 };
        for (int t = 0; t < 4; ++t) {
            CHECK_EQ(plan.cell[t], cells[t]);
            CHECK_EQ(plan.strm[t], strms[t]);
        }
    }
}

// inputs a plan refuses, each with its reason
static void test_refusals() {
    const locret_plan_params p = params_locret();
    std::vector<llama_pos> frame;
    locret_ubatch_plan plan;

    // streams 0 and 2 in one ubatch: llama.cpp's slot_info holds consecutive streams only
    {
        std::vector<locret_plan_stream> streams(3);
        ubatch_in ub;
        ub.add(0, 0, 1, true).add(2, 0, 1, true);
        const locret_plan_error err = locret_plan_ubatch(p, ub.view(), streams, plan, frame);
        CHECK_EQ(err.status, LOCRET_PLAN_NOT_CONSECUTIVE);
        CHECK(err.msg == "a ubatch's sequences are not consecutive streams", "%s", err.msg.c_str());
    }
    // a sequence in two parts of one ubatch (0, 1, 0): three parts for two streams
    {
        std::vector<locret_plan_stream> streams(2);
        ubatch_in ub;
        ub.add(0, 0, 1, false).add(1, 0, 1, false).add(0, 1, 1, false);
        CHECK_EQ(locret_plan_ubatch(p, ub.view(), streams, plan, frame).status, LOCRET_PLAN_NOT_CONSECUTIVE);
    }
    // a sequence without a stream
    {
        std::vector<locret_plan_stream> streams(2);
        ubatch_in ub;
        ub.add(2, 0, 1, true);
        const locret_plan_error err = locret_plan_ubatch(p, ub.view(), streams, plan, frame);
        CHECK_EQ(err.status, LOCRET_PLAN_SEQ_RANGE);
        CHECK(err.msg == "sequence 2 is out of range (2 sequences)", "%s", err.msg.c_str());
    }
    // no tokens
    {
        std::vector<locret_plan_stream> streams(1);
        ubatch_in ub;
        CHECK_EQ(locret_plan_ubatch(p, ub.view(), streams, plan, frame).status, LOCRET_PLAN_EMPTY);
    }
    // a part that does not fit the cells: 128 cells, 100 units after a prefill chunk evict to 96, + 40 = 136 > 128
    {
        locret_plan_params small = p;
        small.n_cells = 128;
        std::vector<locret_plan_stream> streams = { stream_at(100, false, 100) };
        ubatch_in ub;
        ub.add(0, 100, 40, false);
        const locret_plan_error err = locret_plan_ubatch(small, ub.view(), streams, plan, frame);
        CHECK_EQ(err.status, LOCRET_PLAN_NO_ROOM);
        CHECK(err.msg == "a part of 40 tokens does not fit after 96 retained units in 128 cells", "%s", err.msg.c_str());
        // 32 tokens fit exactly (96 + 32 = 128)
        std::vector<locret_plan_stream> again = { stream_at(100, false, 100) };
        ubatch_in ub32;
        ub32.add(0, 100, 32, false);
        CHECK(locret_plan_ubatch(small, ub32.view(), again, plan, frame).ok(), "32 tokens fit");
    }
}

// SAGE-KV: capacity is the context per sequence; the whole prompt stays until its end, one selection after it, then a
// window that slides when generation passes b + B
static void test_sage() {
    const locret_plan_params p = params_sage();
    std::vector<llama_pos> frame;

    // a prompt of 512 tokens: 16 chunks, none evicts (480 units after a prefill chunk is far above b = 96)
    std::vector<locret_plan_stream> streams = { stream_at(0, true, 0) };
    for (uint32_t k = 0; k < 15; ++k) {
        ubatch_in ub;
        ub.add(0, (llama_pos) (32*k), 32, false);
        const locret_ubatch_plan plan = plan_ok(p, ub, streams, frame);
        check_step(plan.steps[0], 0, 32*k, 0, 32*k, 32, (llama_pos) (32*k), false);
    }
    CHECK_EQ(streams[0].selection_due, false);
    // the prompt's last chunk (no local tail with SAGE-KV): cells 480..511, and the prompt passes b: a selection is due
    {
        ubatch_in ub;
        ub.add(0, 480, 32, true);
        const locret_ubatch_plan plan = plan_ok(p, ub, streams, frame);
        check_step(plan.steps[0], 0, 480, 0, 480, 32, 480, true);
        CHECK_EQ(streams[0].n_used, 512);
        CHECK_EQ(streams[0].selection_due, true);
    }
    // the first generated token: the one selection, to b = 96 (evict() splits it into sinks, window and chosen); then
    // no longer fresh (96 != 512)
    {
        ubatch_in ub;
        ub.add(0, 512, 1, true);
        const locret_ubatch_plan plan = plan_ok(p, ub, streams, frame);
        check_step(plan.steps[0], 0, 96, 0, 96, 1, 512, true);
        CHECK_EQ(streams[0].selection_due, false);
        CHECK_EQ(streams[0].n_used, 97);
    }
    // generation slides when the next token would pass b + B = 128 (not the capacity of 1024)
    {
        std::vector<locret_plan_stream> s2 = { stream_at(127, true, 700) };
        ubatch_in ub0;
        ub0.add(0, 700, 1, true);
        check_step(plan_ok(p, ub0, s2, frame).steps[0], 0, 127, 0, 127, 1, 700, true);
        ubatch_in ub1;
        ub1.add(0, 701, 1, true);
        check_step(plan_ok(p, ub1, s2, frame).steps[0], 0, 96, 0, 96, 1, 701, true);
    }
    // a prompt within the budget (40 tokens in one ubatch) stays whole: not fresh, and 40 + 1 <= 128 keeps it
    {
        std::vector<locret_plan_stream> s2 = { stream_at(0, true, 0) };
        ubatch_in ub0;
        ub0.add(0, 0, 40, true);
        plan_ok(p, ub0, s2, frame);
        CHECK_EQ(s2[0].selection_due, false);
        ubatch_in ub1;
        ub1.add(0, 40, 1, true);
        check_step(plan_ok(p, ub1, s2, frame).steps[0], 0, 40, 0, 40, 1, 40, true);
    }
    // a prompt longer than the context per sequence is refused with the user's reason: 1000 + 32 > 1024
    {
        std::vector<locret_plan_stream> s2 = { stream_at(1000, false, 1000) };
        ubatch_in ub;
        ub.add(0, 1000, 32, false);
        locret_ubatch_plan plan;
        const locret_plan_error err = locret_plan_ubatch(p, ub.view(), s2, plan, frame);
        CHECK_EQ(err.status, LOCRET_PLAN_PROMPT_TOO_LONG);
        CHECK(err.msg == "the policy keeps the whole prompt until its end: sequence 0 would hold 1032 units, more than the "
                         "context per sequence (1024); raise -c or shorten the prompt", "%s", err.msg.c_str());
    }
    // the prompt-end rule: more than one token with an output, or one token with an output after a part without one
    CHECK_EQ(locret_plan_prompt_end(true,  2, true),  true);
    CHECK_EQ(locret_plan_prompt_end(false, 1, true),  true);
    CHECK_EQ(locret_plan_prompt_end(true,  1, true),  false); // generation
    CHECK_EQ(locret_plan_prompt_end(false, 9, false), false); // a prefill chunk
}

// --locret-positions keep with a position limit of 200: parts continue from the last RoPE position; a part that would
// pass the limit goes after an eviction that compacts positions, to at most the budget
static void test_kept_positions() {
    locret_plan_params p = params_locret();
    p.keep_positions = true;
    p.position_limit = 200;
    std::vector<llama_pos> frame;

    // 128 cells after a prefill chunk, 150 tokens read (22 evicted): the next chunk of 32 evicts to b = 96 with 16
    // stabilizers and goes to cells 96..127 at RoPE positions 150..181 (150 + 32 <= 200); the window frame is the
    // RoPE frame (logical 150 - offset 0)
    std::vector<locret_plan_stream> streams = { stream_kept(128, false, 150, 150) };
    ubatch_in a;
    a.add(0, 150, 32, false);
    locret_ubatch_plan plan = plan_ok(p, a, streams, frame);
    check_step(plan.steps[0], 0, 96, 16, 96, 32, 150, false);
    CHECK(!plan.steps[0].reposition, "no compaction of positions below the limit");
    CHECK_EQ(plan.steps[0].first_rope, 150);
    CHECK_EQ(plan.cell[0], 96);
    CHECK_EQ(plan.rope[0], 150);
    CHECK_EQ(plan.rope[31], 181);
    CHECK_EQ(frame[31], 181);
    CHECK_EQ(streams[0].n_used, 128);
    CHECK_EQ(streams[0].rope_next, 182);

    // the next chunk would reach 182 + 32 = 214 > 200: the eviction compacts positions and the chunk goes to cells and
    // positions 96..127
    ubatch_in b;
    b.add(0, 182, 32, false);
    plan = plan_ok(p, b, streams, frame);
    check_step(plan.steps[0], 0, 96, 16, 96, 32, 182, false);
    CHECK(plan.steps[0].reposition, "positions compacted at the limit");
    CHECK_EQ(plan.rope[0], 96);
    CHECK_EQ(plan.rope[31], 127);
    CHECK_EQ(streams[0].rope_next, 128);

    // generation: 100 cells (no eviction due below b + B = 128), RoPE at 190: the token goes to cell 100, position 190
    streams = { stream_kept(100, true, 400, 190) };
    ubatch_in c;
    c.add(0, 400, 1, true);
    plan = plan_ok(p, c, streams, frame);
    check_step(plan.steps[0], 0, 100, 0, 100, 1, 400, true);
    CHECK_EQ(plan.rope[0], 190);
    CHECK_EQ(frame[0], 190); // offset 400 - 190

    // at RoPE 200 the token would pass the limit: compacting positions evicts to the budget though no eviction was due
    streams = { stream_kept(100, true, 410, 200) };
    plan = plan_ok(p, c, streams, frame);
    check_step(plan.steps[0], 0, 96, 0, 96, 1, 400, true);
    CHECK(plan.steps[0].reposition, "positions compacted at the limit in generation");
    CHECK_EQ(plan.rope[0], 96);

    // a sequence cut below the budget (seq_rm of its end) keeps every unit when positions are compacted
    streams = { stream_kept(90, true, 410, 200) };
    plan = plan_ok(p, c, streams, frame);
    check_step(plan.steps[0], 0, 90, 0, 90, 1, 400, true);
    CHECK(plan.steps[0].reposition, "positions compacted, nothing evicted");
    CHECK_EQ(plan.rope[0], 90);

    // compact positions: a part's RoPE positions are its cells
    p.keep_positions = false;
    streams = { stream_at(128, false, 150) };
    plan = plan_ok(p, a, streams, frame);
    CHECK(!plan.steps[0].reposition, "compact positions never compact separately");
    CHECK_EQ(plan.rope[0], 96);
    CHECK_EQ(plan.rope[31], 127);
}

// speculative decoding: a generation part of at most locret_plan_room tokens (every token asking for an output) meets
// the evictions a token-by-token run of the same tokens meets, all of them before its first token; one token more
// would not (checked against the token-by-token plans for every state of a generation, both position layouts)
static void plan_generation(const locret_plan_params & p, locret_plan_stream & s, uint32_t n, locret_step * first) {
    ubatch_in ub;
    ub.pos.clear();
    for (uint32_t j = 0; j < n; ++j) {
        ub.pos.push_back(1000 + (llama_pos) j);
        ub.seq.push_back(0);
        ub.out.push_back(1);
    }
    std::vector<locret_plan_stream> streams = { s };
    std::vector<llama_pos> frame;
    const locret_ubatch_plan plan = plan_ok(p, ub, streams, frame);
    *first = plan.steps[0];
    s = streams[0];
}

// the part of n tokens and n single tokens from the same state: the same stream after it, and the single tokens meet
// no eviction or repositioning after the first (where the part meets it)
static bool part_matches_tokens(const locret_plan_params & p, const locret_plan_stream & s0, uint32_t n) {
    locret_plan_stream part = s0;
    locret_step st;
    plan_generation(p, part, n, &st);
    locret_plan_stream one = s0;
    for (uint32_t j = 0; j < n; ++j) {
        locret_step t;
        const uint32_t before = one.n_used;
        plan_generation(p, one, 1, &t);
        if (j == 0 && (t.n_keep != st.n_keep || t.reposition != st.reposition || t.evict != st.evict)) {
            return false;
        }
        if (j > 0 && (t.n_keep != before || t.reposition || t.evict)) {
            return false; // the token-by-token run evicts inside the part
        }
    }
    return one.n_used == part.n_used && one.rope_next == part.rope_next && one.lead == part.lead;
}

static void test_room() {
    locret_plan_params p = params_locret();
    // hand-computed: 100 units, capacity 128: 28 tokens without an eviction
    CHECK_EQ(locret_plan_room(p, stream_at(100, true, 400)), 28);
    // full (128): a single token evicts to b = 96 first, then 32 fit
    CHECK_EQ(locret_plan_room(p, stream_at(128, true, 400)), 32);
    // one cell left: the sampled token alone
    CHECK_EQ(locret_plan_room(p, stream_at(127, true, 400)), 1);
    // kept positions, limit 200: 100 units at RoPE 190 leave 10 positions; at RoPE 200 a token repositions to 96
    p.keep_positions = true;
    p.position_limit = 200;
    CHECK_EQ(locret_plan_room(p, stream_kept(100, true, 400, 190)), 10);
    CHECK_EQ(locret_plan_room(p, stream_kept(100, true, 400, 200)), 32);
    // SAGE-KV: one token at a time
    CHECK_EQ(locret_plan_room(params_sage(), stream_at(100, true, 400)), 1);

    // a budget schedule whose layer nearest its budget leads the largest by 36 (it holds 60 + 36 - 96 = 0 over its
    // budget): 128 - 60 - 36 = 32 tokens before it would pass its budget + B
    locret_plan_stream led = stream_at(60, true, 400);
    led.lead = 36;
    CHECK_EQ(locret_plan_room(p, led), 32);
    // 20 tokens later 12 remain; at 92 units it is full (92 + 36 = 128): a token evicts it to its budget (lead after:
    // min(0, 32) + 96 - 92 = 4), then 128 - 92 - 4 = 32
    led = stream_at(80, true, 400);
    led.lead = 36;
    CHECK_EQ(locret_plan_room(p, led), 12);
    led = stream_at(92, true, 400);
    led.lead = 36;
    CHECK_EQ(locret_plan_room(p, led), 32);

    for (int keep = 0; keep < 4; ++keep) {
        p = params_locret();
        p.keep_positions = keep % 2 != 0;
        p.position_limit = keep % 2 ? 300 : 0;
        // every state a long generation passes through (from 96 units at RoPE 96; the last two: a schedule's layer
        // 40 below the largest budget, from a short prompt of 50 units that evicted it to 56)
        locret_plan_stream s = keep % 2 ? stream_kept(96, true, 1000, 96) : stream_at(96, true, 1000);
        if (keep >= 2) {
            s = keep % 2 ? stream_kept(50, true, 1000, 50) : stream_at(50, true, 1000);
            s.lead = 40;
        }
        int n_checked = 0;
        for (int step = 0; step < 600; ++step) {
            const uint32_t room = locret_plan_room(p, s);
            CHECK(room >= 1, "room %u", room);
            CHECK(part_matches_tokens(p, s, room), "a part of the room (%u) at %u units, RoPE %u", room, s.n_used,
                  s.rope_next);
            // one more token: the token-by-token run would evict or reposition inside it
            CHECK(!part_matches_tokens(p, s, room + 1), "a part of room + 1 (%u) at %u units, RoPE %u", room + 1,
                  s.n_used, s.rope_next);
            n_checked++;
            locret_step t;
            plan_generation(p, s, 1, &t);
        }
        CHECK_EQ(n_checked, 600);
    }
}

// a budget schedule: the layer nearest its own budget decides when a stream evicts (locret_plan_stream::lead = how far
// it leads the largest layer), every layer then keeps at most its own budget and the largest min(b_max, n_used)
static void test_schedule() {
    const locret_plan_params p = params_locret(); // b_max = 96, B = 32, n_s = 16, n_loc = 8
    std::vector<llama_pos> frame;
    uint32_t n_keep = 0;
    uint32_t n_stab = 0;

    // the smallest layer keeps 56 (lead 96 - 56 = 40 before any eviction). After a prefill chunk of 64 units it holds
    // 64 > 56: due, while the largest keeps all 64; 16 stabilizers
    locret_plan_stream s = stream_at(64, false, 64);
    s.lead = 40;
    CHECK(locret_plan_due(p, s, 32, false, &n_keep, &n_stab), "due at 64 + 40 > 96");
    CHECK_EQ(n_keep, 64);
    CHECK_EQ(n_stab, 16);
    // after it the smallest layer holds 56 of the 64 cells (8 masked): lead 96 - 56 - 8 = 32 = min(0, 8) + 96 - 64
    CHECK_EQ(locret_plan_lead_after(p, 64, 40, 64), 32);
    // at 56 units it is at its budget, not over it: nothing is due
    s = stream_at(56, false, 56);
    s.lead = 40;
    CHECK(!locret_plan_due(p, s, 32, false, &n_keep, &n_stab), "not due at 56 + 40 = 96");
    CHECK_EQ(n_keep, 56);
    // past the largest budget too: the largest keeps 96, every layer its own budget (lead 0 after: all at budget)
    s = stream_at(110, false, 110);
    s.lead = 12;
    CHECK(locret_plan_due(p, s, 32, false, &n_keep, &n_stab), "due at 110");
    CHECK_EQ(n_keep, 96);
    CHECK_EQ(locret_plan_lead_after(p, 110, 12, 96), 0);
    // generation: with lead 36 the layer nearest its budget holds n_used + 36 - 96 units over it, and evicts when a
    // part would take it past its budget + B: 60 + 36 + 32 = 128 fits, 61 + 36 + 32 does not
    s = stream_at(60, true, 400);
    s.lead = 36;
    CHECK(!locret_plan_due(p, s, 32, true, &n_keep, &n_stab), "32 tokens fit");
    s.n_used = 61;
    CHECK(locret_plan_due(p, s, 32, true, &n_keep, &n_stab), "the 97th unit with 32 more passes 128");
    CHECK_EQ(n_keep, 61);
    CHECK_EQ(n_stab, 0);

    // whole plans: a 168-token prompt from empty with the smallest layer 40 below the largest budget. Chunks of 32:
    // at 64 units (64 + 40 > 96) the first eviction, before the third chunk, keeps all 64 cells (the largest layer)
    // and the smaller layers their budgets; from then on every chunk evicts, the cells growing to 96
    std::vector<locret_plan_stream> streams = { stream_at(0, true, 0) };
    streams[0].lead = 40;
    ubatch_in ub;
    ub.add(0, 0, 32, false);
    locret_ubatch_plan plan = plan_ok(p, ub, streams, frame);
    CHECK(!plan.steps[0].evict, "nothing held yet");
    const uint32_t keep_expect[]  = { 32, 64, 96, 96 }; // before chunks 2..5 (32, 64, 96 and 128 units held)
    const bool     evict_expect[] = { false, true, true, true };
    const uint32_t lead_expect[]  = { 40, 32, 0, 0 };   // after each planned chunk's eviction
    for (int k = 0; k < 4; ++k) {
        ubatch_in next;
        next.add(0, 32 * (k + 1), 32, false);
        plan = plan_ok(p, next, streams, frame);
        CHECK_EQ(plan.steps[0].n_keep, keep_expect[k]);
        CHECK_EQ(plan.steps[0].evict, evict_expect[k]);
        CHECK_EQ(plan.steps[0].first_cell, keep_expect[k]);
        CHECK_EQ(streams[0].lead, lead_expect[k]);
    }
    // the uniform case is unchanged by the lead's rule: lead 0 evicts at 96 + 32 only
    std::vector<locret_plan_stream> uni = { stream_at(96, false, 96) };
    ubatch_in more;
    more.add(0, 96, 32, false);
    plan = plan_ok(p, more, uni, frame);
    CHECK(!plan.steps[0].evict && plan.steps[0].n_keep == 96, "96 units are within b = 96");
}

int main() {
    test_take();
    test_tail_alone();
    test_scan();
    test_eviction_rule();
    test_prompt_chunks();
    test_generation();
    test_several_sequences();
    test_refusals();
    test_sage();
    test_kept_positions();
    test_room();
    test_schedule();

    if (g_failures > 0) {
        std::fprintf(stderr, "%d check(s) failed\n", g_failures);
        return 1;
    }
    std::printf("all ubatch plans match the hand-computed ones\n");
    return 0;
}
