// SAGE-KV (the seed paper sage-kv.txt): one selection per prompt, by the attention of the prompt's last token.
//
// The prompt is read whole (the policy never evicts during a prefill; its cache is sized for n_ctx). The attention
// layers hand each ubatch's post-RoPE query of every sequence's last token to the memory (a hook in build_attn), which
// keeps it in a query store beside the cache: [d_head_k * n_head] per (layer, sequence). At the first eviction after a
// prompt's end, a graph scores every cached unit of the sequence with that query:
//     p_h = softmax_over_units(scale * q_h . k)     for each query head h of the layer
//     score(unit, KV head) = max over the query heads h of that KV head's group of p_h(unit)
// and the memory keeps the first b/4 units (sinks), the last b/4 (recent), and the best of the rest by score, per
// (layer, KV head). Later evictions keep that chosen set as it is and slide the recent window over new tokens, as the
// paper decodes. The paper keeps, per query head, its own top k = b/(2G) (G query heads per KV head) and the union of
// the group's choices; here one ranking per KV head (the group's largest probability) fills exactly b/2 units, so that
// every (layer, KV head) holds the same count and memory stays at the budget. With G = 1 the two agree.
// tests/py/test_sage.py checks the scores and the kept sets against numpy.
#pragma once

#include "locret-compact.h"
#include "llama-locret.h"

#include <cstdint>
#include <vector>

struct ggml_cgraph;
struct ggml_context;
struct ggml_tensor;

// the units at the start of a sequence that SAGE-KV keeps at its selection (sinks), for a budget
inline uint32_t locret_sage_sinks(uint32_t budget) {
    return budget / LLAMA_LOCRET_SAGE_SINK_DIV;
}

// Build into gf, for every layer, the SAGE-KV scores of cells [0, n) of stream strm, written into the layer's score
// store (layers[i].score, rows strm*kv_size + cell). queries[i]: the layer's query store F32 [d_k*n_head, n_stream];
// kq_scale[i]: the scale its attention applies to q.k.
void locret_build_sage(ggml_context * ctx, ggml_cgraph * gf, const std::vector<locret_kv_layer> & layers,
                       const std::vector<ggml_tensor *> & queries, const std::vector<float> & kq_scale,
                       uint32_t kv_size, uint32_t strm, uint32_t n);

// graph nodes locret_build_sage needs for this many layers
size_t locret_sage_n_nodes(size_t n_layers);
