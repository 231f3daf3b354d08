// The two stores a memory keeps beside its cache, with no model: the score store (a policy's score per layer, KV head
// and cell, written by the graph where it writes the keys and read by the selection) and the query store (the
// post-RoPE queries a policy reads at an eviction). Each is one ggml buffer in the keys' buffer type.
#pragma once

#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-cpp.h"

#include <cmath>
#include <cstdint>
#include <vector>

// the shape of one evicting layer as the stores see it
struct locret_store_layer {
    uint32_t il;        // model layer (for tensor names)
    uint32_t n_head_kv; // score store: one column per KV head
    int64_t  q_width;   // query store: d_k * n_head floats per query
};

struct locret_score_store {
    // layers[i] F32 [n_head_kv, n_cells*n_seq] in `buft`: a unit's score sits at row strm*n_cells + cell like its key.
    // When every layer has the same KV heads they are views of one F32 [n_head_kv, n_cells*n_seq, n_layers] (all()),
    // which the device's selection reads at once. Throws std::runtime_error when the buffer cannot be allocated.
    void make(const std::vector<locret_store_layer> & layers, uint32_t n_cells, uint32_t n_seq,
              ggml_backend_buffer_type_t buft);

    bool          empty()       const { return of_layer.empty(); }
    ggml_tensor * layer(size_t i) const { return of_layer.empty() ? nullptr : of_layer[i]; }
    ggml_tensor * all()         const { return all_layers; } // NULL when the layers differ in KV heads
    size_t        bytes()       const { return buf ? ggml_backend_buffer_get_size(buf.get()) : 0; }
    ggml_backend_buffer_t buffer() const { return buf.get(); }

    // byte offset of stream strm's first row in layer i
    size_t offset(size_t i, uint32_t strm) const;
    // the scores of stream strm's first n_used cells in layer i, out/in [n_used * n_head_kv]
    void get(size_t i, uint32_t strm, uint32_t n_used, float * out) const;
    void set(size_t i, uint32_t strm, uint32_t n_used, const float * in);
    // stream dst's first n_used cells take stream src's scores, in every layer
    void copy(uint32_t src, uint32_t dst, uint32_t n_used);

private:
    ggml_context_ptr           ctx;
    ggml_backend_buffer_ptr    buf;
    ggml_tensor              * all_layers = nullptr;
    std::vector<ggml_tensor *> of_layer;
    std::vector<uint32_t>      heads;
    uint32_t                   n_cells = 0;
};

struct locret_query_store {
    // layers[i] F32 [q_width, n_rows*n_seq] in `buft`, zeroed: sequence s's rows at [s*n_rows, (s+1)*n_rows), the
    // newest last, the first n_pin_rows of them a pinned query's; every layer's attention scale NaN until recorded.
    // Throws std::runtime_error when the buffer cannot be allocated.
    void make(const std::vector<locret_store_layer> & layers, uint32_t n_rows, uint32_t n_pin_rows, uint32_t n_seq,
              ggml_backend_buffer_type_t buft);

    bool          empty()         const { return of_layer.empty(); }
    ggml_tensor * layer(size_t i) const { return of_layer.empty() ? nullptr : of_layer[i]; }
    uint32_t      rows()          const { return n_rows; }
    uint32_t      pin_rows()      const { return n_pin_rows; }
    size_t        bytes()         const { return buf ? ggml_backend_buffer_get_size(buf.get()) : 0; }
    ggml_backend_buffer_t buffer() const { return buf.get(); }
    // bytes of one sequence's rows in a layer's tensor
    size_t block_bytes(const ggml_tensor * q) const { return q->nb[1] * n_rows; }

    // the attention scale layer i's graph applies to q.k, recorded when it captures the queries (NaN until then)
    void  set_scale(size_t i, float s) { scale[i] = s; }
    float get_scale(size_t i) const { return scale.empty() ? NAN : scale[i]; }

    const std::vector<ggml_tensor *> & tensors() const { return of_layer; }
    const std::vector<float>         & scales()  const { return scale; }

private:
    ggml_context_ptr           ctx;
    ggml_backend_buffer_ptr    buf;
    std::vector<ggml_tensor *> of_layer;
    std::vector<float>         scale;
    uint32_t                   n_rows     = 0;
    uint32_t                   n_pin_rows = 0;
};
