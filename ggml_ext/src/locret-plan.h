// Ubatch planning of the Locret memory, as pure functions: which sequences evict before a ubatch, how many units they
// keep, and the cells and RoPE (physical) positions the ubatch's tokens go to.
//
// The memory (locret-memory.cpp, init_batch) scans a batch (locret_plan_scan), splits it into ubatches with llama.cpp's
// splitter, taking locret_plan_take tokens of a sequence at a time, and plans every ubatch in turn (locret_plan_ubatch)
// from a copy of its streams' state that each plan advances. Nothing here touches a context, a cache, a backend or a
// model: the rules can be tested with hand-computed expectations (tests/cpp/test-locret-plan.cpp).
#pragma once

#include "llama.h"

#include <cstdint>
#include <string>
#include <vector>

// one sequence's part of a ubatch: the eviction due before it and the cells it goes to (decided when the batch is split)
struct locret_step {
    uint32_t  strm          = 0;    // the sequence's KV stream (== its seq_id)
    uint32_t  n_keep        = 0;    // units per (layer, KV head) after the eviction before this part (== n_used: none)
    uint32_t  n_stab        = 0;    // of which the last n_stab are kept as stabilizers
    uint32_t  first_cell    = 0;    // the part goes to cells [first_cell, first_cell + n_tokens)
    uint32_t  n_tokens      = 0;
    llama_pos first_logical = 0;    // the client's position of its first token
    bool      output        = false; // the part asks for an output (a prompt end, or generation)
    uint32_t  first_rope    = 0;    // the RoPE position of its first token (== first_cell unless positions are kept)
    bool      reposition    = false; // kept positions: the eviction before it compacts positions too (the part would
                                     // pass the limit); it may then keep every unit (n_keep == n_used)
    bool      evict         = false; // the eviction before it drops units in some layer: with a budget schedule the
                                     // smaller layers may evict while the largest keeps all (n_keep == n_used)
};

struct locret_ubatch_plan {
    std::vector<locret_step> steps;   // one per sequence of the ubatch, in the order of the ubatch's streams
    std::vector<llama_pos>   logical; // per token: the client's position
    std::vector<uint32_t>    strm;    // per token: its stream
    std::vector<uint32_t>    cell;    // per token: its cell
    std::vector<uint32_t>    rope;    // per token: its RoPE (physical) position (== its cell unless positions are kept)
};

// the settings planning reads (from locret_config; a budget schedule plans with its largest layer budget)
struct locret_plan_params {
    uint32_t budget       = 0;     // b
    uint32_t stabilizers  = 0;     // n_s (a policy that selects once: its recent window)
    uint32_t local        = 0;     // n_loc: a prompt end's last n_loc tokens form their own ubatch (0: none)
    uint32_t n_ubatch     = 0;     // B
    uint32_t capacity     = 0;     // b + B (selects_once: the context per sequence, which a prompt must fit)
    uint32_t n_cells      = 0;     // KV cells per sequence
    bool     selects_once = false; // the policy reads the prompt whole (locret_policy::reads_prompt_whole): one
                                   // selection after the prompt's end, then a sliding recent window
    bool     keep_positions = false; // kept units keep their RoPE positions (locret_config::keep_positions)
    uint32_t position_limit = 0;     // ... which stay below this
};

// what planning needs of a stream, advanced by each planned part as placed() and evict() will advance the stream
struct locret_plan_stream {
    uint32_t  n_used      = 0;     // units held (cells [0, n_used))
    bool      prev_output = true;  // the last part placed asked for an output
    uint32_t  rope_next   = 0;     // the RoPE position of the next token (== n_used unless positions are kept)
    llama_pos offset      = 0;     // logical_next - rope_next at the batch's start: a token's position in the window
                                   // cache's frame is its logical one minus this (constant over a batch)
    bool      selection_due  = false; // selects_once: a prompt ended and its one selection has not run yet
    // a budget schedule: how far the layer nearest its own budget is ahead of the largest layer, max over layers of
    // (b_max - b_l) - (its masked cells); 0 without a schedule. That layer holds n_used + lead - b_max units over its
    // budget (negative: under it), and Algorithm 1's rules apply to it: the memory evicts when any layer would.
    uint32_t  lead        = 0;
};

// one ubatch as llama.cpp's splitter made it: a sequence's tokens are consecutive
struct locret_plan_tokens {
    uint32_t                     n_tokens = 0;
    const llama_pos            * pos      = nullptr; // [n_tokens] the client's (logical) positions
    const llama_seq_id * const * seq_id   = nullptr; // [n_tokens] a token's sequence is seq_id[i][0]
    const int8_t               * output   = nullptr; // [n_tokens] != 0: the token asks for an output
};

enum locret_plan_status {
    LOCRET_PLAN_OK = 0,
    LOCRET_PLAN_MULTI_SEQ,       // a token belongs to several sequences (or none)
    LOCRET_PLAN_SEQ_RANGE,       // a sequence id outside [0, n_streams)
    LOCRET_PLAN_EMPTY,           // a ubatch without tokens
    LOCRET_PLAN_PROMPT_TOO_LONG, // selects_once: a prompt would pass the context per sequence (a user error)
    LOCRET_PLAN_NO_ROOM,         // a part does not fit after the retained units in the stream's cells
    LOCRET_PLAN_NOT_CONSECUTIVE, // a ubatch's sequences are not consecutive streams (one slot_info cannot hold them)
};

struct locret_plan_error {
    locret_plan_status status = LOCRET_PLAN_OK;
    std::string        msg;    // why, without a prefix (empty when OK)

    bool ok() const { return status == LOCRET_PLAN_OK; }
};

// a batch's sequences, from its tokens
struct locret_batch_seqs {
    std::vector<uint32_t> count;            // per stream: the batch's tokens of that sequence
    std::vector<bool>     ends_with_output; // per stream: its last token in the batch asks for an output (a prompt end)
    uint32_t              n_seqs   = 0;     // sequences with tokens in the batch
    bool                  one_each = false; // several sequences, one token each (generation): one ubatch for them all
};

// scans a batch of n_tokens (llama_batch's n_seq_id, seq_id and logits; logits may be NULL: no outputs) for n_streams
// streams; an error for a token of several sequences or a sequence out of range (out is then incomplete)
locret_plan_error locret_plan_scan(uint32_t n_tokens, const int32_t * n_seq_id, const llama_seq_id * const * seq_id,
                                   const int8_t * logits, uint32_t n_streams, locret_batch_seqs & out);

// whether a batch that ends stream s's prompt with n_tokens of it must place the prompt's last `local` tokens in a
// ubatch of their own: only when something may be evicted (or positions compacted) before them. A prompt that fits
// in the budget with what the stream holds evicts nothing in any split, so it is split as llama.cpp splits it (one
// ubatch fewer: a short chat turn paid a whole extra pass over the weights for nothing). A policy that selects once
// always splits (its one selection comes after the prompt's end).
bool locret_plan_tail_alone(const locret_plan_params & p, const locret_plan_stream & s, uint32_t n_tokens);

// how many of a sequence's `remaining` tokens its next ubatch takes: at most n_ubatch, and when its prompt's local
// tail goes alone (tail_alone: locret_plan_tail_alone), never the last `local` tokens together with others
uint32_t locret_plan_take(uint32_t n_ubatch, uint32_t local, uint32_t remaining, bool tail_alone);

// Algorithm 1's rule for a part of n_tokens placed after a stream of n_used units whose last part asked for an output
// (prev_output): the units kept per (layer, KV head) by the eviction before it (== n_used: none), and in *n_stab how
// many of them are stabilizers. With a budget schedule it is the rule of the layer nearest its budget: n_used is then
// n_used + lead (locret_plan_due).
uint32_t locret_plan_eviction(const locret_plan_params & p, uint32_t n_used, bool prev_output, bool selection_due,
                              uint32_t n_tokens, bool output, uint32_t * n_stab);

// The eviction due before a part of n_tokens after stream s (the rule of the layer nearest its own budget): whether
// one is due (any layer then keeps min(its budget, what it holds)), the units per (layer, KV head) of the largest layer
// after it (*n_keep; s.n_used when none is due) and the stabilizers (*n_stab). Without the position limit.
bool locret_plan_due(const locret_plan_params & p, const locret_plan_stream & s, uint32_t n_tokens, bool output,
                     uint32_t * n_keep, uint32_t * n_stab);
// the lead (locret_plan_stream::lead) after an eviction that left n_keep units of a stream of n_used with that lead:
// every layer over its budget is then at it
uint32_t locret_plan_lead_after(const locret_plan_params & p, uint32_t n_used, uint32_t lead, uint32_t n_keep);
// Speculative decoding: the most tokens a generation part (every token asking for an output: the sampled token and
// its draft) may hold so that the cache ends up as a token-by-token run leaves it once the rejected tokens are removed
// (llama_memory_seq_rm of the part's tail). No eviction or repositioning may fall inside the part: it comes before the
// part only where it would come before a single token too, and the part then fits the room after it. With selects_once 1
// (a part of several tokens would read as a prompt's end). Never 0.
uint32_t locret_plan_room(const locret_plan_params & p, const locret_plan_stream & s);

// selects_once: a part ends a prompt (its last token asks for an output, and it is more than one token or follows a part
// without one)
static inline bool locret_plan_prompt_end(bool prev_output, uint32_t n_tokens, bool output) {
    return output && (n_tokens > 1 || !prev_output);
}

// Plans one ubatch after `streams` (one per sequence, the state the batch's earlier ubatches leave) and advances the
// streams it touches. On success fills `plan` (its steps, and per token: logical position, stream, cell) and `frame`
// (per token: its position in the window cache's frame). On an error `plan`, `frame` and `streams` may be partly
// written: the caller discards them.
locret_plan_error locret_plan_ubatch(const locret_plan_params & p, const locret_plan_tokens & ub,
                                     std::vector<locret_plan_stream> & streams, locret_ubatch_plan & plan,
                                     std::vector<llama_pos> & frame);
