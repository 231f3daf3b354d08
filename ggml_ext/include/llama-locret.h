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
    LLAMA_LOCRET_POLICY_LAGKV     = 3, // LagKV: each partition of `lag` units scored against the next partition's
                                       // per-channel min/max of K and V, from the cache itself (no heads); the first
                                       // 16 units (sinks) and the units without a complete next partition are kept
    LLAMA_LOCRET_POLICY_SAGE      = 4, // SAGE-KV: the whole prompt is kept while it is read (the cache is sized for
                                       // n_ctx, not the budget); at the first ubatch after a prompt's end, one
                                       // selection per KV head by the attention of the prompt's last token (post-RoPE
                                       // query, max over the KV head's query heads): b/4 sinks, b/2 chosen units, b/4
                                       // recent units; generation then slides the recent window over that fixed set
};

// Units LagKV always keeps at the start of a sequence (its attention sinks; the paper's S = 16).
#define LLAMA_LOCRET_LAGKV_SINKS 16
// LagKV's default partition (lag) size: the paper's L = 128.
#define LLAMA_LOCRET_LAGKV_LAG 128
// SAGE-KV's split of the budget b (the paper's appendix): b/4 sink units, b/4 recent units, the rest chosen by score.
#define LLAMA_LOCRET_SAGE_SINK_DIV   4
#define LLAMA_LOCRET_SAGE_RECENT_DIV 4

// "heads", "random", "streaming", "lagkv" or "sage" (NULL for a value that is not a policy).
LLAMA_API const char * llama_locret_policy_name(enum llama_locret_policy policy);

// Parse a policy name into *out. Returns 0, or -1 for an unknown name (llama_locret_last_error() says which
// names are valid).
LLAMA_API int32_t llama_locret_policy_from_name(const char * name, enum llama_locret_policy * out);

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
    int32_t lag;         // LAGKV policy: units per partition (>= 2); 0 or -1 = default (LLAMA_LOCRET_LAGKV_LAG). The budget
                         // must hold the sinks, two partitions and the stabilizers.
};

// heads NULL, budget 0, stabilizers, local, pool and lag -1, policy HEADS. Defaults, resolved when a context is created: the
// heads file's recommended values (else the paper's n_s = 2500 and n_loc = 100), clamped to n_ubatch, and n_s to b/2.
LLAMA_API struct llama_locret_params llama_locret_params_default(void);

// Contexts created from `model` after this call (llama_init_from_model) use these settings: with a budget, their
// memory is a Locret memory wrapping the model's own KV cache, which holds b + n_ubatch cells (padded to 256) per
// sequence whatever n_ctx is; n_ctx becomes the limit on logical positions. Several sequences (n_seq_max > 1) need a
// non-unified cache: each sequence gets its own stream, budget and evictions. Models with sliding-window layers (iSWA)
// evict their full-attention layers; the window layers keep their own cache. NULL (or budget 0 without heads) removes
// the settings. Settings that cannot work for the context (stabilizers > n_ubatch, an embeddings context, a recurrent
// model, ...) make context creation fail with the reason in llama_locret_last_error(). Returns 0, or -1 on invalid
// settings.
LLAMA_API int32_t llama_locret_model_configure(struct llama_model * model, const struct llama_locret_params * params);

// The way the llama.cpp tools choose (--locret-heads, --locret-budget, --locret-stabilizers, --locret-local,
// --locret-policy, --locret-pool, --locret-lag): heads from `heads_path` when it is non-empty, else the ones embedded
// in `model_path`'s model, else none; budget -1 means no eviction (heads, if any, only score), stabilizers/local/pool/lag
// -1 their defaults.
// The RANDOM, STREAMING and LAGKV policies need a budget and no heads: heads given or embedded are then not loaded
// (a warning says so). Registers the result with llama_locret_model_configure for the contexts created next
// from `model`. The heads found are returned in *out (NULL when none); the caller frees them after those contexts.
// Returns 0, or -1 on error (see llama_locret_last_error()).
LLAMA_API int32_t llama_locret_configure_default(struct llama_model * model, const char * model_path,
                                                 const char * heads_path, int32_t budget, int32_t stabilizers,
                                                 int32_t local, enum llama_locret_policy policy, int32_t pool,
                                                 int32_t lag, struct llama_locret_heads ** out);

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

// The budget layer il of a context keeps (its schedule's entry, or b), or -1 when the context does not evict that
// layer.
LLAMA_API int32_t llama_locret_layer_budget(const struct llama_context * ctx, int32_t il);

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
    uint32_t pool;             // score pooling window (0: none)
    uint32_t lag;              // LagKV's partition size (0: another policy)
    uint64_t n_compactions;    // compaction graphs this context ran since it was made, for all its sequences
                               // (sequences evicting in the same ubatch share one, up to 4 per graph); not in states
};

// Statistics of sequence 0 (n_cells_used, pos_logical, n_evictions and n_units_evicted are per sequence; kv_bytes is
// the whole cache). All zero when the context does not evict.
LLAMA_API struct llama_locret_stats llama_locret_get_stats(const struct llama_context * ctx);

// The same for sequence seq_id (all zero when the context does not evict or has no such sequence).
LLAMA_API struct llama_locret_stats llama_locret_get_seq_stats(const struct llama_context * ctx, llama_seq_id seq_id);

// Locret-Q: positions [0, n_tokens) of sequence seq_id (the query, placed at the start of the prompt) are never
// evicted; they count in the budget. Call it before the sequence's first eviction (typically before decoding the
// prompt); it lasts until the sequence is emptied (llama_memory_seq_rm of all of it, or clear). 0 removes the pin.
// Returns 0, or -1 (llama_locret_last_error) when the context does not evict, the sequence has already evicted units
// (with another pin), or n_tokens plus the stabilizers leave no unit of the budget to choose by score.
LLAMA_API int32_t llama_locret_pin_query(struct llama_context * ctx, llama_seq_id seq_id, int32_t n_tokens);

// Locret-Q's layout, for tools: the query, a blank line ("\n\n"), then the prompt's own text (in a chat: at the start
// of the first user turn, before the template is applied). The heads trained for Locret-Q saw that layout.
#define LLAMA_LOCRET_QUERY_SEPARATOR "\n\n"

// How many leading tokens of a prompt to pin for a query placed in it: through the end of the query's first occurrence
// in the prompt's text (found in the detokenized text, since a tokenizer may split the query differently inside the
// prompt). Searches the first `limit` tokens. Returns the count, or -1 (llama_locret_last_error) when the query is
// empty or not there.
LLAMA_API int32_t llama_locret_query_tokens(const struct llama_vocab * vocab, const llama_token * tokens, int32_t n_tokens,
                                           const char * query, int32_t limit);

// KV cells per sequence that a budget and a ubatch need: b + n_ubatch padded to 256 (0 for a budget or ubatch < 1).
// Tools size their memory plans with it (-fit).
LLAMA_API uint32_t llama_locret_kv_cells_per_seq(int32_t budget, int32_t n_ubatch);

// Debug: logical positions of the units that layer il, KV head ih holds in sequence 0, in cell order (cell c has
// physical position c). Copies them into logical_pos when it is not NULL (n_max must be large enough).
// Returns the number of units, or -1 (see llama_locret_last_error()); -1 too for a window layer of an iSWA model,
// which is not evicted.
LLAMA_API int32_t llama_locret_retained(const struct llama_context * ctx, int32_t il, int32_t ih,
                                        int32_t * logical_pos, int32_t n_max);

// The same for sequence seq_id.
LLAMA_API int32_t llama_locret_retained_seq(const struct llama_context * ctx, llama_seq_id seq_id, int32_t il, int32_t ih,
                                            int32_t * logical_pos, int32_t n_max);

// Debug: layer il's K (read_v false) or V cache of sequence 0 for cells [0, n_cells), dequantized to F32 as
// [n_cells][n_embd_gqa] (keys as stored: after RoPE at their physical positions). Returns n_embd_gqa, or -1.
LLAMA_API int32_t llama_locret_debug_read_kv(struct llama_context * ctx, int32_t il, bool read_v, float * out, int32_t n_cells);

// The same for sequence seq_id.
LLAMA_API int32_t llama_locret_debug_read_kv_seq(struct llama_context * ctx, llama_seq_id seq_id, int32_t il, bool read_v,
                                                 float * out, int32_t n_cells);

// Debug (tests of budget schedules): write k_value into every K element and v_value into every V element of the cells
// that a budget schedule masks in each layer of sequence seq_id, so that a test can show attention never reads them.
// F16 or F32 caches only. Returns the cells written summed over layers, or -1.
LLAMA_API int32_t llama_locret_debug_fill_masked(struct llama_context * ctx, llama_seq_id seq_id, float k_value,
                                                 float v_value);

// Debug: the scores that eviction ranks layer il's units of sequence seq_id by, for cells [0, n_cells), as
// [n_cells][n_head_kv] (the heads' scores, pooled when the context pools; LagKV's scores, meaningless for the units
// still waiting for their partition's successor, which the sequence keeps unscored).
// Returns n_head_kv, or -1 when the context does not evict, evicts by a policy that keeps no scores (random,
// streaming), or the layer, sequence or cell count is wrong.
LLAMA_API int32_t llama_locret_debug_read_scores(struct llama_context * ctx, llama_seq_id seq_id, int32_t il, float * out,
                                                 int32_t n_cells);

// Debug: the post-RoPE query of the last token placed for sequence seq_id in layer il, as the SAGE policy holds it
// (F32, [d_head_k * n_head], query head h at out[h * d_head_k]), and the layer's attention scale in *kq_scale. Returns
// d_head_k * n_head (copies only when n_max holds it), or -1 when the context does not evict with the SAGE policy, or
// the sequence or layer is wrong.
LLAMA_API int32_t llama_locret_debug_read_query(struct llama_context * ctx, llama_seq_id seq_id, int32_t il, float * out,
                                                int32_t n_max, float * kq_scale);

// Debug: the window cache of an evicting iSWA model (Gemma 3): for each cell of sequence seq_id that holds a token, in
// cell order, the client's position of that token and the token itself, as the cache records them. Returns the number
// of such cells (copies at most n_max), or -1 when the context does not evict an iSWA model.
LLAMA_API int32_t llama_locret_debug_window(const struct llama_context * ctx, llama_seq_id seq_id, int32_t * logical_pos,
                                            llama_token * tokens, int32_t n_max);

// Debug: bytes of the compute buffers of the context's scheduler (its graphs) and of an evicting memory's own
// scheduler (the selection and compaction graphs), summed over backends. Both are sized when the context is made; a
// size that changes later means a graph outgrew its reservation.
LLAMA_API void llama_locret_debug_compute_buffers(struct llama_context * ctx, size_t * ctx_bytes, size_t * evict_bytes);

// Test only: make the next matching operation of an evicting context fail, to check that every failure leaves the
// context consistent and usable.
enum llama_locret_fault {
    LLAMA_LOCRET_FAULT_NONE          = 0,
    LLAMA_LOCRET_FAULT_EVICT_ALLOC   = 1, // the next compaction graph cannot be allocated
    LLAMA_LOCRET_FAULT_EVICT_COMPUTE = 2, // the next compaction graph fails to start
    LLAMA_LOCRET_FAULT_UBATCH        = 3, // the next ubatch fails after it was placed in the cache and computed
    LLAMA_LOCRET_FAULT_STATE_READ    = 4, // the next state load fails after the KV cells were restored
};
LLAMA_API int32_t llama_locret_debug_inject_fault(struct llama_context * ctx, enum llama_locret_fault fault);

#ifdef __cplusplus
}
#endif
