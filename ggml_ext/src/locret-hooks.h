// Entry points that the hook patches in llama.cpp call. Everything behind them lives in ggml_ext/;
// the patches only forward. Each hook is a no-op (and costs a null check) when no heads are set,
// so llama.cpp without Locret settings behaves and performs as unpatched.
#pragma once

#include "llama-memory.h"

#include <cstdint>
#include <map>
#include <string>

struct ggml_backend_sched;
struct ggml_context;
struct ggml_cgraph;
struct ggml_tensor;
struct llama_context;
struct llama_locret_heads;
struct llama_tensor_weight;
struct llama_ubatch;
struct llama_cparams;
struct llama_model;
class  llama_batch_allocr;
class  llama_kv_cache;
class  llama_io_read_i;
class  llama_io_write_i;
class  llm_graph_result;

// llama_context owns one of these (patches/0004); created lazily, freed with the context.
struct llama_locret_context;
void llama_locret_context_free(llama_locret_context * lctx);

// heads attached to the context (NULL when none): passed into the graph parameters
const llama_locret_heads * llama_locret_context_heads(const llama_locret_context * lctx);

// llm_graph_context::build_qkv (patches/0003): add the CIS of this layer's tokens to the graph.
// q: [d_head_k, n_head, n_tokens] (or [d_head_k*n_head, n_tokens]), k and v likewise for the KV heads.
void llama_locret_graph_add_cis(ggml_context * ctx, ggml_cgraph * gf, llm_graph_result * res,
                                const llama_locret_heads * heads,
                                ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, int64_t n_tokens, int il);

// llama_context::graph_max_nodes (patches/0004): graph nodes to reserve for Locret, whether or not
// heads are attached yet (they may be attached after the context made its scheduler)
uint32_t llama_locret_graph_n_nodes(uint32_t n_layer);

// llama_context::process_ubatch (patches/0004), after the graph was built: false (with a logged
// error) if heads are attached but the model's graph did not produce CIS for every layer.
bool llama_locret_check_graph(const llama_locret_context * lctx, const llm_graph_result * res, int32_t n_layer);

// llama_context::process_ubatch (patches/0004), after the graph was computed (perhaps asynchronously
// on a GPU backend: the scheduler is passed so that reading results can wait for it).
void llama_locret_after_ubatch(llama_locret_context * lctx, ggml_backend_sched * sched, const llm_graph_result * res,
                               const llama_ubatch & ubatch);

// llama_model_loader (patches/0002): true for tensor names that belong to embedded retaining heads,
// which the model loader leaves to llama_locret_heads_load.
bool llama_locret_is_heads_tensor(const std::string & name);

//
// eviction (locret-evict.cpp)
//

// llama_context constructor (patches/0004), before the memory module is made: the Locret state for the
// context from the settings registered for the model (NULL when none). *kv_cells receives the KV cache size
// to allocate instead of n_ctx when eviction is on (else 0). Throws std::runtime_error for settings that
// cannot work.
llama_locret_context * llama_locret_context_create(const llama_model & model, const llama_cparams & cparams,
                                                   uint32_t n_ubatch_requested, uint32_t * kv_cells);

// ... and after it was made: ties the state to the KV cache. Throws for a memory module that cannot evict.
void llama_locret_context_bind(llama_locret_context * lctx, llama_context * ctx, llama_memory_i * mem);

// llama_context::process_ubatch, before the memory context places the ubatch: runs the eviction that the
// ubatch split planned. Returns 1 after an eviction (the scheduler was used: the previous graph cannot be
// reused), 0 when none was due, -1 on failure.
int llama_locret_before_ubatch(llama_locret_context * lctx, llama_context * ctx, const llama_ubatch & ubatch);

// llama_model destructor (patches/0004): forget the model's settings
void llama_locret_model_forget(const llama_model * model);

// llama_kv_cache (patches/0007), each called only when the cache evicts (kv->locret != NULL)
llama_memory_context_ptr llama_locret_kv_init_batch(llama_locret_context * lctx, llama_kv_cache * kv,
                                                    llama_batch_allocr & balloc, uint32_t n_ubatch);
void      llama_locret_kv_apply_ubatch(llama_locret_context * lctx, uint32_t first_cell, uint32_t n, const llama_ubatch & ubatch);
void      llama_locret_kv_scores      (llama_locret_context * lctx, uint32_t il, const float * cis, uint32_t n_tokens);
void      llama_locret_kv_clear       (llama_locret_context * lctx);
bool      llama_locret_kv_seq_rm      (llama_locret_context * lctx, llama_kv_cache * kv, llama_seq_id seq_id, llama_pos p0, llama_pos p1);
void      llama_locret_kv_seq_add     (llama_locret_context * lctx, llama_seq_id seq_id, llama_pos p0, llama_pos p1, llama_pos shift);
void      llama_locret_kv_unsupported (const char * what);
llama_pos llama_locret_kv_seq_pos_min (const llama_locret_context * lctx, llama_seq_id seq_id);
llama_pos llama_locret_kv_seq_pos_max (const llama_locret_context * lctx, llama_seq_id seq_id);
void      llama_locret_kv_state_write (const llama_locret_context * lctx, llama_io_write_i & io);
void      llama_locret_kv_state_read  (llama_locret_context * lctx, llama_kv_cache * kv, llama_io_read_i & io);
