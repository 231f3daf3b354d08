// Entry points that the hook patches in llama.cpp call. Everything behind them lives in ggml_ext/; the patches only
// forward. Without Locret settings every hook is a null check or returns at once, so llama.cpp behaves and performs
// as unpatched.
#pragma once

#include "llama-memory.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

struct ggml_backend_sched;
struct ggml_cgraph;
struct ggml_context;
struct ggml_tensor;
struct llama_context;
struct llama_cparams;
class  llama_io_read_i;
class  llama_io_write_i;
class  llama_kv_cache;
struct llama_locret_context;
struct llama_locret_heads;
struct llama_memory_params;
struct llama_model;
struct llama_ubatch;
class  llm_graph_result;

// llama_model_loader (patches/0002): true for tensor names that belong to embedded retaining heads, which the model
// loader leaves to llama_locret_heads_load
bool llama_locret_is_heads_tensor(const std::string & name);

// llm_graph_context::build_qkv (patches/0003, 0009): add the CIS of this layer's tokens to the graph, and, when mctx
// belongs to an evicting memory, write them into its score store beside the cache (pooled over the sequence's tokens
// of the ubatch when the memory pools scores).
// q: [d_head_k, n_head, n_tokens] (or [d_head_k*n_head, n_tokens]), k and v likewise for the KV heads.
void llama_locret_graph_add_cis(ggml_context * ctx, ggml_cgraph * gf, llm_graph_result * res,
                                const llama_locret_heads * heads, const llama_memory_context_i * mctx,
                                ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, const llama_ubatch & ubatch, int il);

// llm_graph_context::build_attn with a KV cache (patches/0010): when mctx belongs to a memory whose policy reads
// queries (locret_policy::query_rows: SAGE-KV, SnapKV), write the post-RoPE queries of the last tokens of each
// sequence's run in the ubatch (SAGE-KV: the last one; SnapKV: its window, and a pinned question's tokens when read)
// into the memory's query store, and remember the layer's attention scale (locret-sage.h, locret-policy-snapkv.cpp).
// q: [d_head_k, n_head, n_tokens].
void llama_locret_graph_add_query(ggml_context * ctx, ggml_cgraph * gf, llm_graph_result * res,
                                  const llama_memory_context_i * mctx, ggml_tensor * q, float kq_scale,
                                  const llama_ubatch & ubatch, int il);

// llm_graph_context::build_attn with a KV cache (patches/0011): the attention input of layer il. When mctx belongs to a
// memory whose budget schedule holds its layers in groups of caches (locret_layer_groups), the input of layer il's
// group: llama.cpp's own input (cell indices, mask from the cells) bound to that group's cache, made once per graph
// and group; otherwise `inp` itself.
llm_graph_input_attn_kv * llama_locret_graph_attn_input(ggml_context * ctx, llm_graph_result * res,
                                                        const llama_memory_context_i * mctx, const llama_ubatch & ubatch,
                                                        llm_graph_input_attn_kv * inp, int il);

// llm_graph_context::build_attn with a KV cache (patches/0011): the attention mask of layer il, given its input's mask
// (its group's). When mctx belongs to a memory whose budget schedule holds every layer in one cache
// (locret_layer_groups: an iSWA or ALiBi model, or LOCRET_DEBUG_ALLOC=masked), kq_mask with the cells this layer no
// longer reads blocked (one add per distinct layer budget below the largest, shared by its layers); otherwise (no
// schedule, or a cache per budget) kq_mask itself. kq_mask: [n_kv, n_tokens/n_stream, 1, n_stream].
ggml_tensor * llama_locret_graph_layer_mask(ggml_context * ctx, llm_graph_result * res,
                                            const llama_memory_context_i * mctx, ggml_tensor * kq_mask, int il);

// llama_context::graph_max_nodes (patches/0004): graph nodes to reserve for Locret, whether or not heads are attached
// yet (they may be attached after the context made its scheduler)
uint32_t llama_locret_graph_n_nodes(uint32_t n_layer);

// llama_context constructor (patches/0007; patches/0004 adds the member that holds it): its Locret state (NULL when
// the model has no Locret settings; llama_locret_set_heads makes one later), freed with the context
// (llama_locret_context_deleter, patches/0004)
llama_locret_context * llama_locret_context_create(const llama_model & model);

// heads that score this context's ubatches: the attached heads when an eviction or the recorder reads the scores, else
// NULL (nothing is computed for scores nobody reads); passed into the graph parameters
const llama_locret_heads * llama_locret_context_heads(const llama_locret_context * lctx);

// llama_context::graph_reserve and process_ubatch (patches/0004), after a graph was built: false (with the reason
// logged and in llama_locret_last_error) if heads are attached but the model's graph did not score every layer
bool llama_locret_check_graph(const llama_locret_context * lctx, const llm_graph_result * res, int32_t n_layer);

// llama_context::process_ubatch (patches/0004), after the graph was computed (perhaps asynchronously on a GPU: the
// scheduler is passed so that reading results can wait for it): records the scores and hands them to an evicting
// memory. false when the ubatch must count as failed.
bool llama_locret_after_ubatch(llama_locret_context * lctx, ggml_backend_sched * sched, const llm_graph_result * res,
                               const llama_ubatch & ubatch, const llama_memory_context_i * mctx);

// llama_context constructor (patches/0007), instead of model.create_memory: a Locret memory wrapping the model's own
// cache when the model was configured with a budget (else NULL). The cache then holds b + n_ubatch cells per
// sequence whatever n_ctx is, and n_ctx stays the limit on logical positions; cparams.n_ctx_rope is set to the cells
// RoPE sees. n_ubatch_requested is the ubatch asked for, before clamping. Throws std::runtime_error for settings that
// cannot work.
llama_memory_i * llama_locret_memory_create(const llama_model & model, const llama_memory_params & params,
                                            llama_cparams & cparams, uint32_t n_ubatch_requested);

// llama_context::process_ubatch (patches/0007), before the memory context places the ubatch: runs the eviction that
// the split planned for it (on the memory's own scheduler; nothing when mctx is NULL or not a Locret one). When the
// context's scheduler was used too, or may have been (a failure), *prev_graph becomes NULL: the context's previous
// graph cannot be reused. false on failure.
bool llama_locret_before_ubatch(llama_context * ctx, llama_memory_context_i * mctx, llm_graph_result *& prev_graph);

// llama_context::sched_reserve (patches/0007), after the context reserved its graphs: an evicting memory makes the
// scheduler and compute buffers of its eviction graphs for their worst case, so that no eviction allocates later.
// Throws std::runtime_error when that fails.
void llama_locret_reserve(llama_context * ctx);

// llama_model destructor (patches/0007): forget the model's settings
void llama_locret_model_forget(const llama_model * model);

// llama_kv_cache::state_write and state_read (patches/0021, a fix of llama.cpp's, not of Locret's): a whole-cache save
// (whole) writes the stream's cell count with its top bit set, then where its cells are (ranges of cells, ascending)
// and the slot search's head; every other save writes the count alone. A restore reads the count and, when flagged,
// that layout, checked like any other field of a file (a corrupt one throws); `at` gets each cell's saved place when
// use_places (a whole restore, not a mirrored pair) and they fit in n_cells, else stays empty (cells from 0, as before).
// So a sliding-window cache (a ring) is restored in the same layout and a reloaded context continues bit for bit.
void llama_locret_kv_state_write_count(llama_io_write_i & io, uint32_t cell_count, bool whole,
                                       const std::vector<std::pair<uint32_t, uint32_t>> & ranges, uint32_t head);
uint32_t llama_locret_kv_state_read_count(llama_io_read_i & io, bool use_places, uint32_t n_cells,
                                          std::vector<uint32_t> & at, uint32_t & head_saved);

// llama_kv_cache::state_write (patches/0024): a sequence's save leaves out the cells its sliding window no longer
// attends (SWA-masked) unless this returns true, which it does for the window cache of an evicting memory
// (locret_kv_state_keep_masked). llama-server continues a restored prompt only when the window cache still holds a
// position older than the window before the next token, and otherwise from a context checkpoint, which an evicting
// memory cannot take: without the held cells, every follow-up restored from its prompt cache read the whole
// conversation again. Saved whole, the cache comes back as it was, masked cells masked as before.
bool llama_locret_kv_state_keeps_masked(const llama_kv_cache * kv);
// an evicting memory registers its window cache for that while it lives (keep true), and leaves (keep false)
void locret_kv_state_keep_masked(const llama_kv_cache * kv, bool keep);

// that registration as a member of the memory: kept from keep() until the memory goes
struct locret_kv_state_keep_masked_scope {
    const llama_kv_cache * kv = nullptr;

    locret_kv_state_keep_masked_scope() = default;
    locret_kv_state_keep_masked_scope(const locret_kv_state_keep_masked_scope &) = delete;
    locret_kv_state_keep_masked_scope & operator=(const locret_kv_state_keep_masked_scope &) = delete;
    ~locret_kv_state_keep_masked_scope() {
        if (kv != nullptr) {
            locret_kv_state_keep_masked(kv, false);
        }
    }

    void keep(const llama_kv_cache * cache) {
        kv = cache;
        locret_kv_state_keep_masked(kv, true);
    }
};
