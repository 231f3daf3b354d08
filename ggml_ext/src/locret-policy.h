// Where the score of each KV unit comes from: the policy interface and its registry. Every policy runs the same
// eviction (top-b per layer and KV head, stabilizers, local tail, compaction); only the scores and the units a policy
// protects differ. Selection (locret-select) and compaction (locret-compact) know nothing of policies, and the memory
// (locret-memory) reaches a policy only through the hooks below.
#pragma once

#include "llama-locret.h"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

struct ggml_context;
struct ggml_cgraph;
struct ggml_tensor;
struct locret_config;
struct locret_policy_values;
struct locret_kv_layer;

// One of a policy's own settings (LagKV's partition, SnapKV's window): an integer the user gives as key=value after the
// policy's name (--locret-policy NAME:key=value,key=value). The policy file holds its table; locret-policy.cpp parses,
// checks the range, prints, and compares saved settings, the same way for every policy.
struct locret_policy_knob {
    const char * key;
    const char * help; // what it sets, a few words
    int32_t      def;
    int32_t      min;
    int32_t      max;
};

// what a policy may look at when it scores one (layer, KV head) of one sequence at an eviction
struct locret_score_args {
    uint32_t        il;           // model layer
    uint32_t        ih;           // KV head
    const int32_t * pos;          // [n] logical position of the unit in each cell
    float         * score;        // [n] out: the scores
    uint32_t        n;            // cells in use
    int32_t         logical_next; // logical position of the sequence's next token
};

// A policy's per-sequence state. The memory keeps it in each sequence's bookkeeping, copies it with the rest for the
// undo of a failed ubatch, zeroes it when the sequence is emptied and writes it to state files as these words (the
// file layout is the memory's); what the words mean is the policy's own.
struct locret_policy_state {
    uint32_t word[2] = { 0, 0 };
};

// What a policy sees of the memory when it prepares an eviction: the cache's layers and stores, and a way to run a
// scoring graph on the memory's own scheduler (so that no policy includes the memory's header).
struct locret_policy_env {
    const locret_config                & cfg;
    const std::vector<locret_kv_layer> & layers;
    bool                                 v_trans;
    // the query store of each layer (policies with query_rows() > 0): F32 [d_k*n_head, query_rows*n_stream], the rows
    // of sequence s at [s*query_rows, (s+1)*query_rows), the newest last; and the scale each layer's attention applies
    // to q.k (NaN for a layer whose query was never captured)
    const std::vector<ggml_tensor *>   & queries;
    const std::vector<float>           & query_scale;
    // builds one scoring graph and runs it; false, with the reason in llama_locret_last_error, when it cannot run.
    // `title` names the method in messages, `what` what it scored (LOCRET_PROFILE). `set_inputs` (may be empty) fills
    // the graph's input tensors once they are allocated, before it runs.
    std::function<bool(const char * title, const std::string & what,
                       const std::function<void(ggml_context *, ggml_cgraph *)> & build,
                       const std::function<void()> & set_inputs)> run;
};

// for a policy that scores by attention: every layer's queries were captured (the model's attention goes through the
// hooked build_attn); false, with the reason in llama_locret_last_error naming `title`, when one was not
bool locret_queries_captured(const locret_policy_env & env, const char * title);

// one sequence's eviction, as the policy prepares it
struct locret_evict_args {
    uint32_t strm;     // the sequence's stream
    uint32_t n_used;   // cells in use
    uint32_t n_keep;   // cells it keeps
    uint32_t n_pinned; // leading cells a pinned query (Locret-Q) holds
    uint32_t n_stab;   // trailing cells the plan keeps (stabilizers)
};

// the units an eviction keeps whatever their scores: the first n_pin cells and the last n_stab
struct locret_protect {
    uint32_t n_pin;
    uint32_t n_stab;
};

// A policy: where the scores of the units come from, and what it needs of the memory for them. Every policy runs the
// same eviction (top-b per layer and KV head of the units it does not protect, compaction); the memory calls the
// hooks below at the points of a sequence's life and never asks which policy it holds.
struct locret_policy {
    virtual ~locret_policy() = default;

    virtual llama_locret_policy id() const = 0;

    //
    // settings (the rule book, locret-settings.cpp, asks these before any memory exists)
    //

    // the policy's own settings, in the order of cfg.policy_values (none by default); their layout's version, which
    // state files record beside their values (raise it when a key's meaning changes)
    virtual std::vector<locret_policy_knob> knobs() const { return {}; }
    virtual uint32_t settings_version() const { return 1; }
    // a refusal of settings that need no model ("" when they are fine); v: the policy's own settings, parsed
    virtual std::string params_problem(const llama_locret_params & p, const locret_policy_values & v) const {
        (void) p; (void) v; return "";
    }
    // the policy's part of the resolved settings: its own fields of cfg, and a capacity other than b + B; n_ctx_seq:
    // the context per sequence; cfg.policy_values holds its settings. A refusal goes to err.
    virtual void configure(const llama_locret_params & p, uint32_t n_ctx_seq, locret_config & cfg, std::string & err) const {
        (void) p; (void) n_ctx_seq; (void) cfg; (void) err;
    }
    // the policy sets the stabilizers and local tail itself (it refuses --locret-stabilizers and --locret-local)
    virtual bool sets_own_stabilizers() const { return false; }
    // the score pooling window (--locret-pool) averages this policy's scores
    virtual bool pools_scores() const { return false; }
    // the policy reads a sequence's units in position order from the cells (partitions, a recent window, pooling over
    // neighbouring cells): --locret-positions keep, which fills holes out of order, does not apply
    virtual bool reads_cells_in_order() const { return false; }
    // the units a sequence keeps unscored besides the stabilizers and a pinned query (they must fit in the budget)
    virtual uint64_t unscored_units(const locret_config & cfg) const { (void) cfg; return 0; }
    // those units in words, for messages ("" when there are none)
    virtual std::string unscored_what(const locret_config & cfg) const { (void) cfg; return ""; }
    // why a pinned query (Locret-Q) does not apply ("" when it does)
    virtual std::string pin_problem() const { return ""; }
    // the policy's settings in the memory's creation log (after the stabilizers and local length)
    virtual std::string describe(const locret_config & cfg) const { (void) cfg; return ""; }

    //
    // stores and graphs
    //

    // the scores are the retaining heads' causal importance scores, computed in the graph with the units
    virtual bool uses_heads() const { return false; }
    // the scores live in the memory's score store beside the cache (moved with the units, selected on the device);
    // otherwise score() gives them at each eviction
    virtual bool stores_scores() const { return uses_heads(); }
    // queries the model's graph captures per (layer, sequence) from the end of each ubatch, post-RoPE, into the query
    // store (0: none)
    virtual uint32_t query_rows(const locret_config & cfg) const { (void) cfg; return 0; }
    // of those rows, the first ones hold a pinned query's (Locret-Q) last tokens instead, captured when they are read
    // (before the sequence's first eviction): the last min(n, n_pinned) pinned positions, the newest last (0: none)
    virtual uint32_t query_pin_rows(const locret_config & cfg) const { (void) cfg; return 0; }
    // nodes of the policy's largest eviction-time scoring graph (0: none), and that graph for the reservation: a full
    // cache of stream 0
    virtual size_t score_graph_nodes(size_t n_layers) const { (void) n_layers; return 0; }
    virtual void build_worst_score_graph(const locret_policy_env & env, ggml_context * ctx, ggml_cgraph * gf) const {
        (void) env; (void) ctx; (void) gf;
    }

    //
    // a sequence's life
    //

    // the prompt is read whole: no eviction while it is read (its cache holds the context; ubatch planning)
    virtual bool reads_prompt_whole() const { return false; }
    // a selection is due at the next eviction whatever the cache holds (ubatch planning of reads_prompt_whole policies)
    virtual bool selection_due(const locret_policy_state & st) const { (void) st; return false; }
    // a part of n_tokens was placed; the sequence now uses n_used cells, n_pinned of them pinned (Locret-Q); prompt_end:
    // it asked for an output after a prompt (locret_plan_prompt_end)
    virtual void placed(const locret_config & cfg, locret_policy_state & st, uint32_t n_used, uint32_t n_tokens,
                        uint32_t n_pinned, bool prompt_end) const {
        (void) cfg; (void) st; (void) n_used; (void) n_tokens; (void) n_pinned; (void) prompt_end;
    }
    // before an eviction's selection: the scores it needs computed (a scoring graph through env.run), and the units it
    // protects. false, with the reason in llama_locret_last_error, when it cannot; the cache is then unchanged.
    virtual bool prepare(const locret_policy_env & env, const locret_evict_args & a, locret_policy_state & st,
                         locret_protect & out) const {
        (void) env; (void) st;
        out = { a.n_pinned, a.n_stab };
        return true;
    }
    // after the eviction's compaction: the sequence holds a.n_keep cells, `prot` as prepare() returned it
    virtual void compacted(const locret_config & cfg, const locret_evict_args & a, const locret_protect & prot,
                           locret_policy_state & st) const {
        (void) cfg; (void) a; (void) prot; (void) st;
    }
    // the sequence was cut back to n_used cells (seq_rm of its end)
    virtual void truncated(const locret_config & cfg, locret_policy_state & st, uint32_t n_used) const {
        (void) cfg; (void) st; (void) n_used;
    }
    // a state read from a file is one this policy could have made for a sequence of n_used cells
    virtual bool state_ok(const locret_config & cfg, const locret_policy_state & st, uint32_t n_used) const {
        (void) cfg; (void) st; (void) n_used;
        return true;
    }

    // fill args.score for the units about to be selected from (asked only of a policy that does not store its scores)
    virtual void score(const locret_score_args & args) const { (void) args; }
};

// One row per policy. Adding a policy is one file (its locret_policy and a factory) and one row of the table in
// locret-policy.cpp (plus its factory's declaration below and its value in the public enum); names, help, Python's list and the rules read the table.
struct locret_policy_entry {
    llama_locret_policy id;
    const char * name;       // --locret-policy NAME
    const char * help;       // one line: what scores the units (the tools' help, Python's list)
    bool needs_heads;        // the scores come from retaining heads: a budget without heads is refused
    bool per_layer_budgets;  // a budget schedule may give each layer its own budget
    std::unique_ptr<locret_policy> (*make)();
};

// the factories, one per policy file (locret-policy-NAME.cpp)
std::unique_ptr<locret_policy> locret_policy_make_heads();
std::unique_ptr<locret_policy> locret_policy_make_random();
std::unique_ptr<locret_policy> locret_policy_make_streaming();
std::unique_ptr<locret_policy> locret_policy_make_lagkv();
std::unique_ptr<locret_policy> locret_policy_make_sage();
std::unique_ptr<locret_policy> locret_policy_make_snapkv();

size_t                      locret_policy_count();
const locret_policy_entry & locret_policy_at(size_t i);
// the row of a policy, or NULL for a value from outside the enum (C callers, ctypes)
const locret_policy_entry * locret_policy_find(llama_locret_policy id);

std::unique_ptr<locret_policy> locret_policy_make(llama_locret_policy id);

// Parse a policy's settings "key=value[,key=value...]" (NULL or "": none given) into out: every knob at its default
// but those given, checked against the knob's range. false, with the reason naming the key in err, when one is not
// the policy's, not an integer in range, or given twice.
bool locret_policy_settings_parse(const locret_policy_entry & e, const char * text, locret_policy_values & out,
                                  std::string & err);
// "key=value,..." for every knob of the policy ("" for a policy without any)
std::string locret_policy_settings_str(const locret_policy_entry & e, const locret_policy_values & v);
// why settings saved by a state file (their layout's version and values) cannot continue under `cur` ("" when they
// can: the same version and values)
std::string locret_policy_settings_mismatch(const locret_policy_entry & e, uint32_t saved_version,
                                            const std::vector<int32_t> & saved, const locret_policy_values & cur);

// the random policy's score of (layer, KV head, logical position); tests/py/test_policies.py mirrors it
float locret_random_score(uint32_t il, uint32_t ih, int32_t pos);
