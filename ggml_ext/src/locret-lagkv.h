// LagKV (the seed paper lagkv.txt): attention-free scores of KV units, from the cache itself.
//
// A sequence's units after its sinks are cut into partitions of `lag` units. Partition p is normalized channel by
// channel with the minimum and maximum of the next partition p + 1 (its lag reference):
//     Z' = (Z - min_{p+1}) / (max_{p+1} - min_{p+1} + eps),  Z in {K, V} of one KV head, per channel
// and a unit's score is softmax, over the units of its partition, of the sample standard deviation (n - 1) of Z' over
// the head's channels, for K plus the same for V. A partition without a complete successor has no score yet: the memory
// keeps those units (at most two partitions' worth) like stabilizers, and the first LLAMA_LOCRET_LAGKV_SINKS units like
// a pinned prefix, and ranks the scored ones with the same top-b selection as every policy. Keys are scored as the cache
// holds them (after RoPE), as in the paper. tests/py/test_lagkv.py checks the scores and the kept sets against numpy.
#pragma once

#include "locret-compact.h"
#include "llama-locret.h"

#include <cstdint>
#include <vector>

// added to the reference's range, so that a channel that is constant over the reference partition does not divide by 0
constexpr float LOCRET_LAGKV_EPS = 1e-6f;

// Build into gf, for every layer, the scores of cells [c0, c0 + n_part*lag) of stream strm from cells
// [c0, c0 + (n_part + 1)*lag), written into the layer's score store (layers[i].score, rows strm*kv_size + cell).
// The K and V storage of the layers is read as it is (any type a copy to F32 supports; V transposed or not).
void locret_build_lagkv(ggml_context * ctx, ggml_cgraph * gf, const std::vector<locret_kv_layer> & layers, bool v_trans,
                        uint32_t kv_size, uint32_t strm, uint32_t c0, uint32_t n_part, uint32_t lag);

// the most units a sequence keeps unscored with this lag (0: another policy): the sinks and fewer than two partitions
// waiting for their successor; the budget must hold them beside the stabilizers and a pinned query
inline uint64_t locret_lagkv_unscored(uint32_t lag) {
    return lag > 0 ? (uint64_t) LLAMA_LOCRET_LAGKV_SINKS + 2ull * lag : 0;
}

// graph nodes locret_build_lagkv needs for this many layers
size_t locret_lagkv_n_nodes(size_t n_layers);
