// Debug and test API of the Locret extension: what tests and inspection tools read out of an evicting context (kept
// units, cached K/V, scores, captured queries, the window cache, buffer sizes) and fault injection. Users need only
// llama-locret.h; these calls may change with the memory's internals.
#pragma once

#include "llama-locret.h"

#ifdef __cplusplus
extern "C" {
#endif

// Debug: logical positions of the units that layer il, KV head ih holds in sequence 0, in cell order (with compact
// positions cell c has physical position c; see llama_locret_debug_rope_positions). Copies them into logical_pos when it is not NULL (n_max must be large enough).
// Returns the number of units, or -1 (see llama_locret_last_error()); -1 too for a window layer of an iSWA model,
// which is not evicted.
LLAMA_API int32_t llama_locret_retained(const struct llama_context * ctx, int32_t il, int32_t ih,
                                        int32_t * logical_pos, int32_t n_max);

// The same for sequence seq_id.
LLAMA_API int32_t llama_locret_retained_seq(const struct llama_context * ctx, llama_seq_id seq_id, int32_t il, int32_t ih,
                                            int32_t * logical_pos, int32_t n_max);

// Debug: the RoPE positions the keys of the units llama_locret_retained_seq lists were rotated at, in the same order
// (compact positions: the cell, after the cells a budget schedule masks in the layer for the units before them; kept
// positions: the position each unit was read at, or given when positions were last compacted). Returns the number of
// units (copies when rope_pos is not NULL and n_max holds them), or -1.
LLAMA_API int32_t llama_locret_debug_rope_positions(const struct llama_context * ctx, llama_seq_id seq_id, int32_t il,
                                                   int32_t ih, int32_t * rope_pos, int32_t n_max);

// Debug: layer il's K (read_v false) or V cache of sequence 0 for cells [0, n_cells), dequantized to F32 as
// [n_cells][n_embd_gqa] (keys as stored: after RoPE at their physical positions). Returns n_embd_gqa, or -1.
LLAMA_API int32_t llama_locret_debug_read_kv(struct llama_context * ctx, int32_t il, bool read_v, float * out, int32_t n_cells);

// The same for sequence seq_id.
LLAMA_API int32_t llama_locret_debug_read_kv_seq(struct llama_context * ctx, llama_seq_id seq_id, int32_t il, bool read_v,
                                                 float * out, int32_t n_cells);

// Debug (tests of budget schedules): write k_value into every K element and v_value into every V element of the cells
// of each layer's cache that sequence seq_id's attention must not read (those a budget schedule masks in the layer,
// and those past the cells in use), so that a test can show attention never reads them. F16 or F32 caches only.
// Returns the cells written summed over layers, or -1.
LLAMA_API int32_t llama_locret_debug_fill_masked(struct llama_context * ctx, llama_seq_id seq_id, float k_value,
                                                 float v_value);

// Debug: the scores that eviction ranks layer il's units of sequence seq_id by, for cells [0, n_cells), as
// [n_cells][n_head_kv] (the heads' scores, pooled when the context pools; LagKV's scores, meaningless for the units
// still waiting for their partition's successor, which the sequence keeps unscored).
// Returns n_head_kv, or -1 when the context does not evict, evicts by a policy that keeps no scores (random,
// streaming), or the layer, sequence or cell count is wrong.
LLAMA_API int32_t llama_locret_debug_read_scores(struct llama_context * ctx, llama_seq_id seq_id, int32_t il, float * out,
                                                 int32_t n_cells);

// Debug: the post-RoPE queries the policy captured for sequence seq_id in layer il (SAGE-KV: the last token placed;
// SnapKV: its question rows for a pinned question's last tokens, zero when none, then its window's rows, the last
// tokens of the last ubatch), F32 [rows][d_head_k * n_head], the newest row last, query head h of a
// row at h * d_head_k; and the layer's attention scale in *kq_scale. Returns rows * d_head_k * n_head (copies only when
// n_max holds it), or -1 when the context's policy captures no queries, or the sequence or layer is wrong.
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

// Bytes of an evicting context's own buffers, for memory plans (locret plan): the eviction graphs' compute buffers, the
// compaction's move tables, the score store, and the most sequences one compaction moves, then the query store
// (policies that capture queries). All zero when the context does not evict.
struct llama_locret_buffers {
    size_t   evict_compute;
    size_t   move_tables;
    size_t   score_store;
    uint32_t compact_seq;
    size_t   query_store;
};
LLAMA_API struct llama_locret_buffers llama_locret_debug_buffers(const struct llama_context * ctx);

// The context's compute buffers by buffer type, as llama.cpp's memory breakdown counts them (the expected sizes when the
// model was loaded with no_alloc): entry i's buffer type name (copied into name, at most name_size bytes with the NUL)
// and *bytes. Returns the number of entries (0 when there is none and i is 0), or -1 when i is not one of them.
LLAMA_API int32_t llama_locret_debug_compute_buffer(struct llama_context * ctx, int32_t i, char * name, size_t name_size,
                                                   size_t * bytes);

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
