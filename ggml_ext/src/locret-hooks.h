// Entry points that the hook patches in llama.cpp call. Everything behind them lives in ggml_ext/;
// the patches only forward. Each hook is a no-op (and costs a null check) when no heads are set,
// so llama.cpp without Locret settings behaves and performs as unpatched.
#pragma once

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
