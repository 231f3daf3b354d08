// The score store and the query store (locret-stores.h).

#include "locret-stores.h"

#include <stdexcept>

void locret_score_store::make(const std::vector<locret_store_layer> & layers, uint32_t n_cells_, uint32_t n_seq,
        ggml_backend_buffer_type_t buft) {
    bool uniform = true;
    for (const auto & L : layers) {
        uniform = uniform && L.n_head_kv == layers[0].n_head_kv;
    }
    n_cells = n_cells_;
    const int64_t n_rows = (int64_t) n_cells * n_seq;
    ggml_init_params ip = { ggml_tensor_overhead() * (layers.size() + 1), nullptr, /*.no_alloc =*/ true };
    ctx.reset(ggml_init(ip));
    of_layer.resize(layers.size());
    heads.resize(layers.size());
    if (uniform) {
        all_layers = ggml_new_tensor_3d(ctx.get(), GGML_TYPE_F32, layers[0].n_head_kv, n_rows, (int64_t) layers.size());
        ggml_set_name(all_layers, "locret_scores");
    }
    for (size_t i = 0; i < layers.size(); ++i) {
        of_layer[i] = uniform
            ? ggml_view_2d(ctx.get(), all_layers, layers[i].n_head_kv, n_rows, all_layers->nb[1], i * all_layers->nb[2])
            : ggml_new_tensor_2d(ctx.get(), GGML_TYPE_F32, layers[i].n_head_kv, n_rows);
        ggml_format_name(of_layer[i], "locret_scores-%u", layers[i].il);
        heads[i] = layers[i].n_head_kv;
    }
    buf.reset(ggml_backend_alloc_ctx_tensors_from_buft(ctx.get(), buft));
    if (!buf) {
        throw std::runtime_error("failed to allocate the Locret score store");
    }
    ggml_backend_buffer_clear(buf.get(), 0);
}

size_t locret_score_store::offset(size_t i, uint32_t strm) const {
    return (size_t) strm * n_cells * of_layer[i]->nb[1];
}

void locret_score_store::get(size_t i, uint32_t strm, uint32_t n_used, float * out) const {
    ggml_backend_tensor_get(of_layer[i], out, offset(i, strm), sizeof(float) * n_used * heads[i]);
}

void locret_score_store::set(size_t i, uint32_t strm, uint32_t n_used, const float * in) {
    ggml_backend_tensor_set(of_layer[i], in, offset(i, strm), sizeof(float) * n_used * heads[i]);
}

void locret_score_store::copy(uint32_t src, uint32_t dst, uint32_t n_used) {
    std::vector<float> tmp;
    for (size_t i = 0; i < of_layer.size(); ++i) {
        tmp.resize((size_t) n_used * heads[i]);
        get(i, src, n_used, tmp.data());
        set(i, dst, n_used, tmp.data());
    }
}

void locret_query_store::make(const std::vector<locret_store_layer> & layers, uint32_t n_rows_, uint32_t n_pin_rows_,
        uint32_t n_seq, ggml_backend_buffer_type_t buft) {
    n_rows     = n_rows_;
    n_pin_rows = n_pin_rows_;
    ggml_init_params ip = { ggml_tensor_overhead() * layers.size(), nullptr, /*.no_alloc =*/ true };
    ctx.reset(ggml_init(ip));
    of_layer.resize(layers.size());
    scale.assign(layers.size(), NAN);
    for (size_t i = 0; i < layers.size(); ++i) {
        of_layer[i] = ggml_new_tensor_2d(ctx.get(), GGML_TYPE_F32, layers[i].q_width, (int64_t) n_rows * n_seq);
        ggml_format_name(of_layer[i], "locret_query-%u", layers[i].il);
    }
    buf.reset(ggml_backend_alloc_ctx_tensors_from_buft(ctx.get(), buft));
    if (!buf) {
        throw std::runtime_error("failed to allocate the Locret query store");
    }
    ggml_backend_buffer_clear(buf.get(), 0);
}
