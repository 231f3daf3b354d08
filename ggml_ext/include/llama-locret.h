// Public C API of the Locret extension compiled into libllama.
//
// Declared with LLAMA_API so the symbols are exported from the shared libllama exactly like the
// rest of llama.h; clients (C/C++ tools, llama-cpp-python through ctypes) reach them the same way.
#pragma once

#include "llama.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Version of the Locret extension compiled into this libllama, e.g. "0.1.0".
// A client calls it to prove that the library it loaded is ours and not a stock libllama.
LLAMA_API const char * llama_locret_version(void);

// Fingerprint (64 hex chars) of the patch series applied to the llama.cpp tree this library was
// built from; scripts/llama_tree.py computes the same value from patches/, so a stale build can be
// detected.
LLAMA_API const char * llama_locret_patch_series(void);

// Message of the last failed call of this API on this thread ("" if none).
LLAMA_API const char * llama_locret_last_error(void);

//
// Retaining heads (format: convert/HEADS-FORMAT.md)
//

struct llama_locret_heads;

// 1 if the GGUF file at `path` carries retaining heads (a heads file or a model with embedded
// heads), 0 if it does not, -1 if it cannot be read as GGUF.
LLAMA_API int32_t llama_locret_file_has_heads(const char * path);

// Load the retaining heads in the GGUF file at `path` (a standalone heads file or a model GGUF with
// embedded heads) for `model`. Every layer's tensors are placed on the same backend as that layer.
// Returns NULL if the file cannot be read or does not match the model; the reason is logged and
// available from llama_locret_last_error().
LLAMA_API struct llama_locret_heads * llama_locret_heads_load(const struct llama_model * model, const char * path);

LLAMA_API void llama_locret_heads_free(struct llama_locret_heads * heads);

// d_R, the width of the heads' hidden layer.
LLAMA_API int32_t llama_locret_heads_hidden_size(const struct llama_locret_heads * heads);

// Recommended inference settings stored in the file (0 where the file has none).
struct llama_locret_settings {
    uint32_t budget;      // retained units per layer and KV head (b)
    uint32_t chunk;       // prefill chunk (B)
    uint32_t stabilizers; // n_s
    uint32_t local;       // n_loc
    uint32_t pool;        // score pooling window the heads were measured with (odd; 0: none), the default of
                          // --locret-pool with these heads ("locret.recommended.pool")
    uint32_t query_auto;  // 1: Locret-Q heads: the question found at the end of a prompt is pinned by default
                          // (--locret-query auto; "locret.recommended.query" = "auto")
    uint32_t positions;   // where kept units sit by default with these heads: 0 none (the model's and policy's
                          // default), else 1 + enum llama_locret_positions ("locret.recommended.positions":
                          // "compact", "inplace", "keep" or "keep:N"); skipped where the policy or model refuses it
    uint32_t position_limit; // keep:N's N; 0: the model's trained context
    uint32_t pool_from;   // the pooling above applies to a sequence whose prompt is at least this many budgets long
                          // (llama_locret_seq_prompt; 0: to every sequence) ("locret.recommended.pool_from")
};
LLAMA_API struct llama_locret_settings llama_locret_heads_recommended(const struct llama_locret_heads * heads);

// Attach heads to a context (NULL detaches them); the heads must outlive the context or be
// detached first. From the next decode on, every ubatch computes the causal importance scores
// (CIS) of its tokens in the graph, from each layer's pre-RoPE Q, K and V.
// Returns 0, or -1 if the heads were loaded for another model.
LLAMA_API int32_t llama_locret_set_heads(struct llama_context * ctx, const struct llama_locret_heads * heads);

// Heads the way the llama.cpp tools choose them (--locret-heads): loaded from `heads_path` when it
// is non-empty, else from the model file `model_path` when the model embeds heads, else none.
// The heads found are attached to `ctx` and returned in *out (NULL when none apply); the caller
// frees them after the context. Returns 0, or -1 on error (see llama_locret_last_error()).
LLAMA_API int32_t llama_locret_attach_default(struct llama_context * ctx, const char * model_path,
                                              const char * heads_path, struct llama_locret_heads ** out);

// The heads attached to a context, or NULL.
LLAMA_API const struct llama_locret_heads * llama_locret_get_heads(const struct llama_context * ctx);

//
// Reading the scores back (tests, retention heatmaps)
//

// Start (enable = true) or stop recording the CIS of every ubatch decoded on this context.
// Starting clears what was recorded before. Recording copies the scores to host memory after
// each ubatch, so leave it off when the scores are not read.
LLAMA_API void llama_locret_record_scores(struct llama_context * ctx, bool enable);

// Number of tokens recorded since recording started.
LLAMA_API int32_t llama_locret_recorded_n_tokens(const struct llama_context * ctx);

// Copy the recorded scores, in decode order:
//   scores:    float  [n_layer][n_head_kv][n_tokens] (may be NULL)
//   positions: int32  [n_tokens], each token's position as given in its batch (may be NULL)
// `n_tokens` must equal llama_locret_recorded_n_tokens(). Returns n_tokens, or -1 on error.
LLAMA_API int32_t llama_locret_recorded_scores(const struct llama_context * ctx, float * scores,
                                               int32_t * positions, int32_t n_tokens);

// Copy the sequence of each recorded token, in decode order: seq_ids int32 [n_tokens] (the first sequence of a token
// that belongs to several). `n_tokens` must equal llama_locret_recorded_n_tokens(). Returns n_tokens, or -1.
LLAMA_API int32_t llama_locret_recorded_sequences(const struct llama_context * ctx, int32_t * seq_ids, int32_t n_tokens);

//
// Eviction (Locret Algorithm 1 inside llama.cpp's KV cache)
//

// Where the score of each unit comes from. Every policy runs the same eviction (top-b per layer and KV head,
// stabilizers, local tail, compaction); only the scores differ.
enum llama_locret_policy {
    LLAMA_LOCRET_POLICY_HEADS     = 0, // the causal importance scores of the retaining heads (Locret)
    LLAMA_LOCRET_POLICY_RANDOM    = 1, // a fixed pseudo-random number in [0, 1) per (layer, KV head, logical position)
    LLAMA_LOCRET_POLICY_STREAMING = 2, // StreamingLLM: the first 4 logical positions (attention sinks), then recency
    LLAMA_LOCRET_POLICY_LAGKV     = 3, // LagKV: each partition of units scored against the next partition's
                                       // per-channel min/max of K and V, from the cache itself (no heads); the first
                                       // 16 units (sinks) and the units without a complete next partition are kept
    LLAMA_LOCRET_POLICY_SAGE      = 4, // SAGE-KV: the whole prompt is kept while it is read (the cache is sized for
                                       // n_ctx, not the budget); at the first ubatch after a prompt's end, one
                                       // selection per KV head by the attention of the prompt's last token (post-RoPE
                                       // query, max over the KV head's query heads): b/4 sinks, b/2 chosen units, b/4
                                       // recent units; generation then slides the recent window over that fixed set
    LLAMA_LOCRET_POLICY_SNAPKV    = 5, // SnapKV per chunk: at each eviction the queries of the last part's last
                                       // tokens (its observation window; post-RoPE, causal) score every cached unit
                                       // by their attention, averaged over the window and the KV head's query heads,
                                       // pooled over neighbouring units; the window is kept; with a pinned query
                                       // (Locret-Q) the question's last tokens are the window instead, read as if
                                       // after the cache
};
// A policy's own knobs (LagKV's partition, SnapKV's window) are its settings: a string "key=value[,key=value...]"
// that the policy parses (llama_locret_params.policy_settings; the tools' --locret-policy NAME:SETTINGS).
// llama_locret_policy_settings_help() lists each policy's settings and docs/policies.md says what they do.

// Units LagKV always keeps at the start of a sequence (its attention sinks; the paper's S = 16).
#define LLAMA_LOCRET_LAGKV_SINKS 16
// SAGE-KV's split of the budget b (the paper's appendix): b/4 sink units, b/4 recent units, the rest chosen by score.
#define LLAMA_LOCRET_SAGE_SINK_DIV   4
#define LLAMA_LOCRET_SAGE_RECENT_DIV 4

// The policies are 0 .. llama_locret_policy_count() - 1, in this enum's order.
LLAMA_API int32_t llama_locret_policy_count(void);

// "heads", "random", "streaming", "lagkv", "sage" or "snapkv" (NULL for a value that is not a policy).
LLAMA_API const char * llama_locret_policy_name(enum llama_locret_policy policy);

// One line saying what scores the units under a policy (the tools' help); NULL for a value that is not a policy.
LLAMA_API const char * llama_locret_policy_help(enum llama_locret_policy policy);

// The help of --locret-policy: one line per policy, from the same registry.
LLAMA_API const char * llama_locret_policies_help(void);

// Parse a policy name into *out. Returns 0, or -1 for an unknown name (llama_locret_last_error() says which
// names are valid).
LLAMA_API int32_t llama_locret_policy_from_name(const char * name, enum llama_locret_policy * out);

// What a policy is, for planners and tools that must not know policies by name (the same answers the rule book
// reads when it checks settings).
struct llama_locret_policy_traits {
    bool needs_heads;          // its scores come from retaining heads: a budget without heads is refused
    bool per_layer_budgets;    // a budget schedule may give each layer its own budget
    bool reads_prompt_whole;   // it reads each prompt whole before it evicts: its cache holds the context per sequence
                               // (a prompt must fit in it), no chunk is compressed (the ubatch may exceed the budget)
    bool sets_own_stabilizers; // it sets the stabilizers (and local tail) itself and refuses them
    bool pools_scores;         // --locret-pool averages its scores
    bool reads_cells_in_order; // --locret-positions keep and inplace are refused with it
    bool takes_pinned_query;   // a pinned query (Locret-Q) applies to it
    bool has_settings;         // it has settings of its own (NAME:key=value)
};

// The traits of a policy into *out. Returns 0, or -1 for a value that is not a policy.
LLAMA_API int32_t llama_locret_policy_get_traits(enum llama_locret_policy policy, struct llama_locret_policy_traits * out);

// Parse a policy with its settings, "NAME" or "NAME:SETTINGS" (--locret-policy NAME:key=value), into *out and *settings
// (a pointer into `spec` after the ':', or to "" when there is none). The settings are checked against the policy's
// own: returns 0, or -1 for an unknown name or a setting the policy refuses (llama_locret_last_error() names the key).
LLAMA_API int32_t llama_locret_policy_from_spec(const char * spec, enum llama_locret_policy * out, const char ** settings);

// One line listing a policy's settings ("key=VALUE: what it sets (range; default)", "; " between them); "" for a
// policy without settings; NULL for a value that is not a policy.
LLAMA_API const char * llama_locret_policy_settings_help(enum llama_locret_policy policy);

// Where the units an eviction keeps sit in RoPE's positions (docs/memory.md, "Cells, positions and compaction").
enum llama_locret_positions {
    LLAMA_LOCRET_POSITIONS_COMPACT = 0, // the paper's: the kept units get positions 0..n-1 in their order, so every
                                        // eviction re-rotates (and moves) nearly every key; positions never pass b + B
    LLAMA_LOCRET_POSITIONS_KEEP    = 1, // the kept units keep the positions they were read at; the chunk's survivors
                                        // are copied into the holes the eviction left (no rotation, at most B rows per
                                        // layer and KV head); positions grow with the input and are compacted as above
                                        // only when the next part would pass the position limit. Policies that read
                                        // units in position order (lagkv, sage, snapkv) and rope-less models refuse it
    LLAMA_LOCRET_POSITIONS_INPLACE = 2, // COMPACT's positions (0..n-1 in the kept units' order after every eviction)
                                        // without COMPACT's moves: kept units stay in their cells, the chunk's
                                        // survivors are copied into the holes (as KEEP), and every key whose position
                                        // changes is re-rotated where it is; values never move but for the copies.
                                        // The model reads what COMPACT gives it; refused where KEEP is
};

// Settings for the contexts created from a model. The chunk is the context's ubatch (n_ubatch).
struct llama_locret_params {
    const struct llama_locret_heads * heads; // scores the units; required when budget > 0 and policy is HEADS
    int32_t budget;      // b: units kept per layer and KV head; 0 = no eviction (heads only score)
    int32_t stabilizers; // n_s: last units of a prefill chunk always kept (<= n_ubatch, < b); -1 = default
    int32_t local;       // n_loc: last prompt tokens processed after compression (<= n_ubatch); -1 = default
    enum llama_locret_policy policy; // what scores the units for eviction; with RANDOM or STREAMING the heads,
                                     // if any, only score for llama_locret_record_scores
    int32_t pool;        // score pooling (HEADS policy): each unit's score becomes the mean of the heads' scores over a
                         // window of `pool` tokens centred on it (odd, <= n_ubatch), within its ubatch and sequence
                         // (clipped at their edges), so that the neighbours of a high-scoring token (the rest of its
                         // sentence or number) are kept with it. 0 or 1 = none; -1 = default (none: the paper's Locret)
    const char * policy_settings; // the policy's own settings, "key=value[,key=value...]"; NULL or "": its
                                  // defaults (llama_locret_policy_settings_help). Copied by configure.
    const char * budget_schedule; // how the budget is spread over the layers: NULL or "uniform", "pyramid", or a file of
                                  // per-layer budgets (see llama_locret_model_set_budget_schedule)
    struct llama_locret_settings defaults; // the recommended values that settings left at -1 take when `heads` is NULL
                                           // (a tool that has not loaded the heads yet fills them with
                                           // llama_locret_file_recommended); zeros: the paper's
    int32_t positions;      // enum llama_locret_positions; -1 = default (the heads' recommendation where the policy
                            // and the model take it, else INPLACE where they take it, else COMPACT)
    int32_t position_limit; // KEEP: positions stay below this (>= b + n_ubatch); 0 or -1 = the model's trained
                            // context (n_ctx_train)
};

// heads NULL, budget 0, stabilizers, local, pool, positions and position_limit -1, policy HEADS and its default settings, no schedule, no
// defaults. Defaults, resolved
// when a context is created: the heads file's recommended values (else the paper's n_s = 2500 and n_loc = 100), clamped
// to n_ubatch, and n_s to b/2.
LLAMA_API struct llama_locret_params llama_locret_params_default(void);

// The settings recommended by the retaining heads in the GGUF file at `path` (a heads file or a model with embedded
// heads), read from its metadata without loading anything. Returns 1 and fills *out, 0 when the file has no heads
// (*out zeroed), -1 when it cannot be read (llama_locret_last_error).
LLAMA_API int32_t llama_locret_file_recommended(const char * path, struct llama_locret_settings * out);

//
// The rule book: every refusal and every size is decided here, once; context creation, the tools (-fit), locret plan,
// the evaluation runner and locret.Llama call these functions and keep no copy of the rules.
//

// 0 when a context created from `model` with `cparams` and these settings can evict (or params->budget is 0: nothing
// to check), else -1 with the reason in llama_locret_last_error(), the same message context creation would give.
// `model` may be loaded with no_alloc (its hyperparameters are all the rules read; vocab_only stops before them).
// Heads are not required: a tool checks before it loads them (llama_locret_model_configure refuses a heads policy
// without heads).
LLAMA_API int32_t llama_locret_check_params(const struct llama_model * model, const struct llama_locret_params * params,
                                            const struct llama_context_params * cparams);

// KV cells per sequence that a context evicting with these settings allocates in its cache, for a context of n_ctx_seq
// positions per sequence and a ubatch of n_ubatch: (largest layer budget) + n_ubatch padded to 256 (SAGE-KV: n_ctx_seq,
// which its whole prompt must fit). -fit and locret plan size KV memory with it. -1 (llama_locret_last_error) for
// settings that llama_locret_check_params refuses.
LLAMA_API int64_t llama_locret_kv_cells(const struct llama_model * model, const struct llama_locret_params * params,
                                        uint32_t n_ctx_seq, uint32_t n_ubatch);

// Contexts created from `model` after this call (llama_init_from_model) use these settings: with a budget, their
// memory is a Locret memory wrapping the model's own KV cache, which holds b + n_ubatch cells (padded to 256) per
// sequence whatever n_ctx is; n_ctx becomes the limit on logical positions. Several sequences (n_seq_max > 1) need a
// non-unified cache: each sequence gets its own stream, budget and evictions. Models with sliding-window layers (iSWA)
// evict their full-attention layers; the window layers keep their own cache. NULL (or budget 0 without heads) removes
// the settings. Settings that cannot work for the context (stabilizers > n_ubatch, an embeddings context, a recurrent
// model, ...) make context creation fail with the reason in llama_locret_last_error(). Returns 0, or -1 on invalid
// settings.
LLAMA_API int32_t llama_locret_model_configure(struct llama_model * model, const struct llama_locret_params * params);

// The way the llama.cpp tools configure, with all of their settings in one object given once (no order between
// calls): heads from `heads_path` when it is non-empty, else the ones embedded in `model_path`'s model, else none; a
// policy that does not use heads (random, streaming, lagkv, sage, snapkv) needs a budget, and heads given or embedded
// are then not loaded (a warning says so). params->heads must be NULL (the heads are found here); params->budget -1
// means no --locret-budget (no eviction; heads, if any, only score) and another value below 1 is refused;
// stabilizers, local and pool -1 their defaults; the policy's settings, budget schedule and positions as
// llama_locret_model_configure takes them, checked with the rest. Registers the result for the contexts created next
// from `model`. The heads found are returned in *out (NULL when none); the caller frees them after those contexts.
// The llama.cpp tools and the Python package configure through this one call. Returns 0, or -1 with nothing
// registered (see llama_locret_last_error()).
LLAMA_API int32_t llama_locret_configure_default(struct llama_model * model, const char * model_path,
                                                 const char * heads_path, const struct llama_locret_params * params,
                                                 struct llama_locret_heads ** out);

// What the rule book resolves for a context before its model is loaded (llama_locret_resolve_file).
struct llama_locret_resolved {
    uint32_t n_cells;     // KV cells per sequence the cache allocates
    uint32_t n_seq;       // sequences (one KV stream each)
    uint32_t budget_max;  // the largest layer budget (the budget without a schedule)
    uint32_t stabilizers; // n_s as resolved (SAGE-KV: its recent window, b/4)
    uint32_t local;       // n_loc as resolved
    uint32_t n_ubatch;    // the chunk
    // the memory it allocates, per sequence (bytes; llama_locret_budget_for_mib fits their sum to a size)
    uint32_t n_cells_window; // cells of the sliding-window layers' own cache (iSWA; 0 without)
    uint64_t kv_bytes;       // K and V of the evicting layers (n_cells each; with a budget schedule's layer groups,
                             // each layer its group's cells: b_g + B, the largest budget's group n_cells)
    uint64_t window_bytes;   // K and V of the window layers (n_cells_window each)
    uint64_t store_bytes;    // the F32 score store (a score per evicting layer, KV head and cell) and query store
};

// For tools that plan memory before they load the model (-fit, locret plan): the settings a context created with
// `cparams` and these settings resolves to, read from the model file's hyperparameters (a no_alloc load) and, when
// params->heads is NULL and the policy scores with heads, the recommended settings of the heads in `heads_path` (else
// the model's embedded ones). The same rules as llama_locret_check_params. Returns 0, or -1 (llama_locret_last_error)
// for settings they refuse.
LLAMA_API int32_t llama_locret_resolve_file(const char * model_path, const char * heads_path,
                                            const struct llama_locret_params * params,
                                            const struct llama_context_params * cparams,
                                            struct llama_locret_resolved * out);

// llama_locret_resolve_file (into *out, when not NULL) and, in the same metadata load, per layer of the model: the K
// and V bytes per sequence (n_cells or n_cells_window rows of the cache types, 0 for a layer without KV) into
// layers_out, and the units the layer keeps (a budget schedule's, else the budget; 0 for a layer that does not evict)
// into budgets_out when it is not NULL: what locret plan places and shows layer by layer. Writes
// min(n_layers_out, n_layer) entries of each and returns n_layer, or -1 (llama_locret_last_error).
LLAMA_API int32_t llama_locret_resolve_file_layers(const char * model_path, const char * heads_path,
                                                   const struct llama_locret_params * params,
                                                   const struct llama_context_params * cparams,
                                                   struct llama_locret_resolved * out, uint64_t * layers_out,
                                                   uint32_t * budgets_out, int32_t n_layers_out);

// --locret-budget-mib: the largest budget whose memory per sequence (kv_bytes + window_bytes + store_bytes of
// llama_locret_resolved: the K/V cells of the budget and the chunk, padded to 256, the window layers' cache and the
// score and query stores) is at most `mib` MiB (2^20 bytes), for the model in `model_path`, the K/V types of
// `cparams` and the schedule and policy of `params` (params->budget is ignored). Memory grows in steps of 256 cells,
// so the budget returned is the last of its step: one unit more needs 256 cells more, which do not fit (a schedule's
// layers below the largest budget sit in caches of their budget and a chunk, which grow unit by unit). *out (may be
// NULL) gets what that budget resolves to. Not counted: the eviction's compute buffers and move tables, one set per
// context (its start-up log prints them). Returns the budget, or -1 (llama_locret_last_error) when even the smallest
// budget the settings allow does not fit (the message gives its size), for a schedule file (its budgets fix b),
// SAGE-KV (its cache holds the whole prompt: -c sets its memory) or settings refused at every budget.
LLAMA_API int32_t llama_locret_budget_for_mib(const char * model_path, const char * heads_path,
                                              const struct llama_locret_params * params,
                                              const struct llama_context_params * cparams, double mib,
                                              struct llama_locret_resolved * out);

// The KV cells, over all sequences, that such a context holds: what -fit plans memory with (-1 on refused settings).
// A budget schedule whose layers are held in groups of caches of their own sizes counts the cells that, in every
// layer, hold the groups' K/V bytes (rounded up).
LLAMA_API int64_t llama_locret_fit_n_ctx(const char * model_path, const char * heads_path,
                                         const struct llama_locret_params * params,
                                         const struct llama_context_params * cparams);

// Budget schedules: how the units a context keeps are spread over the layers it evicts, for the contexts created from
// `model` next. Call it after llama_locret_model_configure / llama_locret_configure_default (a new configuration
// clears it). "uniform" (or NULL, or ""): every layer keeps b. "pyramid": PyramidKV's schedule (Cai et al., 2024), an
// arithmetic sequence from the first layer down to the last, which keeps b/20 (at least the stabilizers and one unit
// more). Anything else is a file of per-layer budgets (whole numbers separated by blanks, commas or line ends; '#'
// starts a comment), one per evicting layer in layer order. The layers' budgets always sum to b times the number of
// evicting layers (a file that does not is refused when the context is created). With the heads, random and streaming
// policies only.
// How it is kept: the cache is sized for the largest layer budget (b_max + n_ubatch cells per sequence, padded); the
// evictions run when that cache would overflow, and each layer then keeps its own budget; the rows a smaller layer
// leaves are masked out of its attention and hold nothing it reads. So the units attended per layer follow the
// schedule and sum to the uniform total, while the allocated KV memory is that of b_max in every layer.
// Returns 0, or -1 (llama_locret_last_error) for an unknown name, an unreadable or malformed file, no budget set, or a
// policy without per-layer selection (lagkv, sage).
LLAMA_API int32_t llama_locret_model_set_budget_schedule(struct llama_model * model, const char * schedule);

// Parse the tools' --locret-positions value: "compact", "inplace", "keep", or "keep:N" (N the position limit) into *mode (enum
// llama_locret_positions) and *limit (-1: the model's trained context). Returns 0, or -1 (llama_locret_last_error).
LLAMA_API int32_t llama_locret_positions_parse(const char * text, int32_t * mode, int32_t * limit);

// The name of a positions mode as --locret-positions spells it ("compact", "keep", "inplace"); NULL for a value outside the enum
LLAMA_API const char * llama_locret_positions_name(enum llama_locret_positions mode);

// Where kept units sit for the contexts created next from `model` (llama_locret_params.positions and position_limit),
// after llama_locret_model_configure (llama_locret_configure_default takes them in its settings).
// Returns 0, or -1 (llama_locret_last_error) for settings the rule book refuses, or no budget configured.
LLAMA_API int32_t llama_locret_model_set_positions(struct llama_model * model, int32_t mode, int32_t limit);

// The budget layer il of a context keeps (its schedule's entry, or b), or -1 when the context does not evict that
// layer.
LLAMA_API int32_t llama_locret_layer_budget(const struct llama_context * ctx, int32_t il);

// The KV cells per sequence that layer il's cache allocates: with a budget schedule whose layers are held in groups of
// caches, its group's (the group's largest budget plus the ubatch; the largest budget's group n_cells), else n_cells;
// -1 when the context does not evict that layer.
LLAMA_API int32_t llama_locret_layer_cells(const struct llama_context * ctx, int32_t il);

struct llama_locret_stats {
    bool     enabled;          // the context evicts
    uint64_t n_evictions;      // evictions since the sequence was last emptied (seq_rm of all, clear); a loaded state restores its own
    uint64_t n_units_evicted;  // units evicted since then, summed over layers and KV heads
    uint32_t n_cells_used;     // physical KV cells holding units
    uint32_t n_cells;          // KV cells allocated
    int64_t  pos_logical;      // logical position of the next token
    uint64_t kv_bytes;         // bytes of the K and V cache tensors
    uint32_t budget;           // resolved settings
    uint32_t stabilizers;
    uint32_t local;
    uint32_t n_ubatch;
    enum llama_locret_policy policy; // what scores the units for eviction
    uint32_t n_seq;            // sequences (KV streams) the context keeps
    // where eviction time goes, summed over the context's sequences since it was made (microseconds)
    uint64_t t_select_us;      // choosing what stays: the policy's scores, top-b per (layer, KV head), bookkeeping
    uint64_t t_compact_us;     // the compaction graphs (moving and re-rotating rows) and the window cache's shifts
    uint64_t t_readback_us;    // reading each ubatch's scores back from the backend (waiting for the graph included)
    uint32_t n_pinned;         // Locret-Q: the sequence's first n_pinned positions are never evicted (0: none)
    uint32_t pool;             // score pooling window of the sequence's scores (0: none; llama_locret_seq_prompt)
    char     policy_settings[64]; // the policy's settings as resolved, "key=value,..." ("": it has none)
    uint64_t n_compactions;    // compaction graphs this context ran since it was made, for all its sequences
                               // (sequences evicting in the same ubatch share one, up to 4 per graph); not in states
    // what evictions cost, since the context was made, for all its sequences (not in states); a row is one (layer, KV
    // head, unit)
    uint64_t n_rows_moved;     // K/V rows written to another cell by compactions
    uint64_t n_rows_rotated;   // keys re-rotated (their physical position changed)
    uint64_t n_rows_kept;      // units retained at evictions
    uint64_t n_host_syncs;     // times an eviction waited for the backend or read data back (the wait for the
                               // previous ubatch, each eviction-time graph's compute, each read-back)
    enum llama_locret_positions positions; // where kept units sit (resolved)
    uint32_t position_limit;   // KEEP: positions stay below it (0 with COMPACT and INPLACE)
    int64_t  pos_rope_next;    // the RoPE position the sequence's next token gets
    uint64_t n_repositions;    // KEEP: evictions that compacted positions because the next part would pass the limit
                               // (since the context was made, all its sequences; not in states)
    // n_evictions and n_units_evicted of all the context's sequences since it was made, never reset (not in states):
    // what a server's counters read
    uint64_t n_evictions_total;
    uint64_t n_units_evicted_total;
    uint32_t pool_window;      // the context's score pooling window (0: none); `pool` is the sequence's
    uint32_t pool_from;        // pooling applies to prompts of at least this many budgets (0: to every sequence)
};

// Whether the context evicts (was created with a Locret budget).
LLAMA_API bool llama_locret_is_evicting(const struct llama_context * ctx);

// Statistics of sequence 0 (n_cells_used, pos_logical, n_evictions and n_units_evicted are per sequence; kv_bytes is
// the whole cache). All zero when the context does not evict.
LLAMA_API struct llama_locret_stats llama_locret_get_stats(const struct llama_context * ctx);

// The same for sequence seq_id (all zero when the context does not evict or has no such sequence).
LLAMA_API struct llama_locret_stats llama_locret_get_seq_stats(const struct llama_context * ctx, llama_seq_id seq_id);

// Speculative decoding: the most tokens sequence seq_id's next generation batch (the sampled token and its draft, every
// token asking for an output) may hold so that, once the rejected tokens are removed (llama_memory_seq_rm of the
// batch's tail), the cache is what decoding the accepted tokens one by one leaves: no eviction falls inside the batch.
// At least 1; -1 when the context does not evict or has no such sequence.
LLAMA_API int32_t llama_locret_seq_room(const struct llama_context * ctx, llama_seq_id seq_id);

// Locret-Q: positions [0, n_tokens) of sequence seq_id (the query, placed at the start of the prompt) are never
// evicted; they count in the budget. Call it before the sequence's first eviction (typically before decoding the
// prompt); it lasts until the sequence is emptied (llama_memory_seq_rm of all of it, or clear). 0 removes the pin.
// Returns 0, or -1 (llama_locret_last_error) when the context does not evict, the sequence has already evicted units
// (with another pin), or n_tokens plus the stabilizers leave no unit of the budget to choose by score.
LLAMA_API int32_t llama_locret_pin_query(struct llama_context * ctx, llama_seq_id seq_id, int32_t n_tokens);

// The length of the prompt a sequence starts with, told before its first ubatch (the tools call it where they pin a
// query). Score pooling recommended by the heads for long prompts only (llama_locret_settings.pool_from) is decided
// here, once per sequence: it applies when n_tokens >= pool_from x the budget. A sequence that already holds tokens
// keeps its decision (pooled and unpooled scores are not mixed in one cache); one never told is not pooled. Pooling
// given by the caller (--locret-pool) or recommended for every prompt applies whatever is told. Returns 1 when the
// sequence pools its scores, 0 when it does not, -1 (llama_locret_last_error) when the context does not evict.
LLAMA_API int32_t llama_locret_seq_prompt(struct llama_context * ctx, llama_seq_id seq_id, int32_t n_tokens);

// Locret-Q's layout, for tools: the query, a blank line ("\n\n"), then the prompt's own text (in a chat: at the start
// of the first user turn, before the template is applied). The heads trained for Locret-Q saw that layout.
#define LLAMA_LOCRET_QUERY_SEPARATOR "\n\n"

// Locret-Q's layout, built by this one function for every tool and for Python: the query (without surrounding white
// space), the separator, the text.
// Writes at most n_out - 1 bytes and a terminating NUL into out (when not NULL); returns the layout's length in bytes
// (like snprintf: call with out NULL to size the buffer).
LLAMA_API int32_t llama_locret_query_layout(const char * query, const char * text, char * out, int32_t n_out);

// How many leading tokens of a prompt to pin for a query placed in it: through the end of the query's first occurrence
// in the prompt's text (found in the detokenized text, since a tokenizer may split the query differently inside the
// prompt). Searches the first `limit` tokens. Returns the count, or -1 (llama_locret_last_error) when the query is
// empty or not there.
LLAMA_API int32_t llama_locret_query_tokens(const struct llama_vocab * vocab, const llama_token * tokens, int32_t n_tokens,
                                           const char * query, int32_t limit);

// Locret-Q without a query given (--locret-query auto, the default with Locret-Q heads): the question a user put at the
// end of their text, found by one written rule (docs/locret-q.md#the-question-found):
//   - fenced code blocks (``` or ~~~) are left out: a question inside code belongs to the document;
//   - if a line near the end opens with "Question:", "Q:" or "Query:" (any case, after markdown emphasis), the
//     question is what follows the last such marker;
//   - else it is the text's last paragraph (after its last blank line), when that reads as a question: it holds a
//     question mark, or its first word asks or tells ("what", "which", "how", "is", "list", "find", ...); of it, the
//     closing run of sentences that ask (the document's sentences on the question's line are not the question);
//   - it ends before an answer's cue (the last sentence opening with "Answer:" or "A:", with no question mark after
//     it) and, after its question mark, before the sentences that do not ask (an answer prefix; a remark that
//     tells, "Answer with ... only.", stays);
//   - longer than LLAMA_LOCRET_AUTO_QUERY_MAX_BYTES, it keeps its trailing whole sentences that fit (none if the
//     last alone does not). Sentences start after ". ", "? ", "! " and at a line not opening in lower case.
// In a chat the text is the last user message; in a plain completion, the prompt. Writes the question (at most
// n_out - 1 bytes and a NUL) into out when not NULL; returns its length in bytes, 0 when the text has none (the tools
// then evict as plain Locret).
#define LLAMA_LOCRET_AUTO_QUERY_MAX_BYTES 320
LLAMA_API int32_t llama_locret_find_question(const char * text, char * out, int32_t n_out);

// Locret-Q on a completion prompt, which may hold a chat template written out as text by the caller
// ("<|im_start|>user\n...?<|im_end|>\n<|im_start|>assistant\n"). Its turns are its pieces between the model's control
// tokens written as text (the template's markers, llama_vocab_is_control). A piece after a marker opens with its role
// when its first line is a role's name alone ("user", "assistant", "system", "model", ...: ChatML and Gemma write
// "<marker>user\n" and the text follows the line); a piece that is a role's name alone and nothing else (Llama 3:
// "<|start_header_id|>user<|end_header_id|>\n\n") names the next piece's role, whose text starts after its leading
// white space. A prompt without markers (or vocab NULL) is one turn, with no role, whose text starts at its first byte:
// these functions then give what llama_locret_find_question and llama_locret_query_layout give.
//
// The question (Locret-Q auto): llama_locret_find_question on the last user turn's text; when no turn is a user's,
// on the last turn with text. Writes it (at most n_out - 1 bytes and a NUL) into out when not NULL; returns its length
// in bytes, 0 when there is none.
LLAMA_API int32_t llama_locret_find_prompt_question(const struct llama_vocab * vocab, const char * text, char * out,
                                                    int32_t n_out);

// Locret-Q's layout in a completion prompt: llama_locret_query_layout at the start of the first user turn's text (of
// the first turn with text when no turn is a user's), the template's markers and role lines before it left as they
// are, so the prompt reads as the chat template would have written the layout's user message. Writes at most
// n_out - 1 bytes and a NUL into out (when not NULL); returns the layout's length in bytes (snprintf's convention).
LLAMA_API int32_t llama_locret_prompt_layout(const struct llama_vocab * vocab, const char * query, const char * text,
                                             char * out, int32_t n_out);

// Locret-Q auto in a chat: which user message's question is the chat's query. `texts`: the chat's user messages whose
// content is text, in order (a message of content parts is not searched). With requery (llama-server's default), the
// last one's: a follow-up question is pinned in place of the first, and the conversation is read again for it.
// Without (--locret-requery off, locret.Llama(locret_requery=False)), the first one that ends with a question
// (llama_locret_find_question): the conversation's first question stays its query, so every later turn's prompt opens
// as the cached one did and a follow-up reads only its new tokens; the last one when none ends with a question.
// Returns the message's index, or -1 when there is none (n_texts 0).
LLAMA_API int32_t llama_locret_chat_query_message(const char * const * texts, int32_t n_texts, bool requery);

// The tokens a budget schedule keeps free for a pinned question in its smallest layer, beyond the stabilizers: a
// question of LLAMA_LOCRET_AUTO_QUERY_MAX_BYTES in Locret-Q's layout (about 70-90 tokens of English with the usual
// tokenizers). A pyramid with Locret-Q heads raises its last layer to n_s + 1 + this, and `locret calibrate` its floor.
#define LLAMA_LOCRET_PIN_ROOM 96
LLAMA_API int32_t llama_locret_pin_room(void);

#ifdef __cplusplus
}
#endif
