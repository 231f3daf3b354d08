// Locret settings: what a model was configured with (llama_locret_model_configure) and what a context
// resolves them to when it is created.
#pragma once

#include "llama-locret.h"

#include "ggml.h"

#include <cstdint>
#include <string>
#include <vector>

struct llama_cparams;
struct llama_model;

// a policy's own settings (locret-policy.h: locret_policy_knob), in the order of its knob table
struct locret_policy_values {
    static constexpr uint32_t MAX = 8;
    int32_t  value[MAX] = {};
    uint32_t n          = 0;
    uint32_t given      = 0; // bit i: knob i was given (else it holds its default)
};

// the settings of one evicting context, resolved when the context is created
struct locret_config {
    const llama_locret_heads * heads = nullptr; // scores the units with the heads policy
    llama_locret_policy policy = LLAMA_LOCRET_POLICY_HEADS;
    locret_policy_values policy_values; // the policy's own settings (--locret-policy NAME:key=value)

    uint32_t budget      = 0; // b: units kept per layer and KV head
    uint32_t stabilizers = 0; // n_s (SAGE-KV: its recent window, b/4)
    uint32_t local       = 0; // n_loc
    uint32_t pool        = 0; // score pooling window in tokens (odd; 0: none)
    uint32_t pool_from   = 0; // pool only sequences told a prompt of at least this many budgets (the heads'
                              // recommendation, when pool is too; 0: every sequence)
    uint32_t n_ubatch    = 0; // B: the chunk
    uint32_t capacity    = 0; // b + B: generation evicts back to b when the next ubatch would pass it (SAGE-KV: the
                              // context per sequence, which a prompt must fit)
    uint32_t n_cells     = 0; // KV cells per sequence: capacity padded to 256

    // --locret-positions keep: kept units keep their RoPE positions and the chunk's survivors fill the holes; positions
    // are compacted to 0..n-1 (as always without it) only when the next part would reach position_limit
    bool     keep_positions = false;
    uint32_t position_limit = 0;
    // --locret-positions inplace: positions compacted to 0..n-1 at every eviction, as compact does, but the kept units
    // stay in their cells and the chunk's survivors fill the holes (as with keep): keys are re-rotated where they are
    bool     rotate_in_place = false;
    // kept units stay in their cells and the chunk's survivors fill the holes: cells are not in position order and
    // each (layer, KV head, cell) has its own RoPE position (the streams' rope arrays)
    bool holes_filled() const { return keep_positions || rotate_in_place; }

    // a budget schedule (--locret-budget-schedule): the units each evicting layer keeps (index into the memory's layer
    // list), summing to budget_mean times their count; `budget` is then their largest, which sizes the cache and sets
    // when evictions run. Empty: every layer keeps `budget`.
    std::vector<uint32_t> layer_budget;
    uint32_t budget_mean = 0; // b as asked for (== budget without a schedule)

    bool     has_schedule() const { return !layer_budget.empty(); }
    // the budget of evicting layer i (index into the memory's layer list): its schedule's, else `budget`
    uint32_t budget_of(size_t i) const { return layer_budget.empty() ? budget : layer_budget[i]; }
    // the smallest layer budget: what a pinned query and the stabilizers must fit in
    uint32_t min_layer_budget() const;
};

// a budget schedule as registered for a model: a name, or the per-layer budgets read from a file
struct locret_schedule_spec {
    enum kind_t { UNIFORM, PYRAMID, EXPLICIT } kind = UNIFORM;
    std::vector<uint32_t> budgets; // EXPLICIT: one per evicting layer
    std::string           source;  // the file it came from (EXPLICIT), for messages
    std::string           model;   // EXPLICIT: the model the file was made for (its "# model: NAME" line; "" when none)
    bool                  has_model = false;
};

// the schedule registered for `model` (UNIFORM when none)
locret_schedule_spec locret_schedule_find(const llama_model & model);

// The per-layer budgets of a schedule for n_layers evicting layers with mean budget b and n_s stabilizers: sum
// n_layers * b. PYRAMID is PyramidKV's arithmetic sequence (Cai et al., 2024): the last layer keeps b / 20 (raised to
// n_s + 1 + pin_room, the fewest a layer can choose from beside a pinned question of pin_room tokens), the first 2b
// minus that, the layers between on the line joining them, rounded down with the remainder given one unit each to the
// first layers. pin_room: LLAMA_LOCRET_PIN_ROOM with heads that pin the question they find (Locret-Q), else 0.
// Throws std::runtime_error (message without prefix) for a schedule that cannot work.
std::vector<uint32_t> locret_schedule_resolve(const locret_schedule_spec & spec, uint32_t n_layers, uint32_t b, uint32_t n_s,
                                              uint32_t pin_room);

struct llama_hparams;

// whether the Locret memory evicts layer il: it has a KV cache and is not a window layer of an iSWA model (those keep
// llama.cpp's own window cache)
bool locret_layer_evicts(const llama_hparams & hp, uint32_t il);

// PyramidKV's beta: the last layer's budget is b / beta
#define LOCRET_PYRAMID_BETA 20

// the settings registered for `model`; false when there are none
bool locret_settings_find(const llama_model & model, llama_locret_params & out);

// the rules that need neither a model nor a context: "" when `p` passes them, else the refusal (message without
// prefix). llama_locret_model_configure, llama_locret_check_params and every context creation call it.
std::string locret_params_problem(const llama_locret_params & p);

// a budget schedule by name or file (NULL, "" or "uniform": UNIFORM); throws std::runtime_error for a file that cannot
// be read or parsed. A file's comment line "# model: NAME" (locret calibrate writes it) names the model it was made
// for: locret_config_make refuses it for a model whose general.name differs.
locret_schedule_spec locret_schedule_parse(const char * schedule);

// "" when `schedule` may be used with `model`, else the refusal: a file made for another model (its "# model:" line)
std::string locret_schedule_model_problem(const llama_model & model, const locret_schedule_spec & schedule);

// The settings of a context that evicts, checked against the model, the context parameters and the K cache type: every
// refusal, the defaults, the schedule's per-layer budgets and the cells the cache holds, written once. n_ubatch_requested
// is the ubatch the caller asked for, before llama.cpp clamped it to n_ctx. Throws std::runtime_error (message without
// prefix) for settings that cannot work.
locret_config locret_config_make(const llama_model & model, const llama_locret_params & p, const locret_schedule_spec & schedule,
                                 const llama_cparams & cparams, uint32_t n_ubatch_requested, ggml_type type_k);

// the fields of llama_cparams the rules read, derived from a context's parameters as llama_context's constructor does
llama_cparams locret_cparams_like_context(const llama_model & model, const llama_context_params & params,
                                          uint32_t * n_ubatch_requested);

// KV cells per sequence for a budget and a ubatch: b + B padded to 256
uint32_t locret_kv_cells(uint32_t budget, uint32_t n_ubatch);
