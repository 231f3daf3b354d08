// Budget schedules in the model's graph: each evicting layer's attention mask with the cells that layer no longer
// reads (locret_stream::live_end .. dead_end) blocked, from one bias input shared by the layers of equal budget.

#include "locret-hooks.h"
#include "locret-memory.h"

#include "llama-batch.h"
#include "llama-graph.h"

#include "ggml.h"

#include <cmath>
#include <memory>
#include <vector>

namespace {

// bias: F32 [n_kv, n_groups, 1, n_stream]: 0 where a group's layers read a cell, -INF where they do not
class locret_layer_mask_input : public llm_graph_input_i {
public:
    locret_layer_mask_input(const llama_locret_memory * mem, ggml_tensor * bias, std::vector<size_t> first_layer)
        : mem(mem), bias(bias), first_layer(std::move(first_layer)) {}

    void set_input(const llama_ubatch * ubatch) override {
        const int64_t n_kv     = bias->ne[0];
        const int64_t n_groups = bias->ne[1];
        const int64_t n_stream = bias->ne[3];
        GGML_ASSERT(ubatch != nullptr && ubatch->n_tokens % n_stream == 0);
        const int64_t n_tps = ubatch->n_tokens / n_stream;
        data.assign((size_t) ggml_nelements(bias), 0.0f);
        for (int64_t k = 0; k < n_stream; ++k) {
            // the ubatch's tokens come stream by stream; a sequence's stream is its id
            const uint32_t strm = (uint32_t) ubatch->seq_id[k * n_tps][0];
            for (int64_t g = 0; g < n_groups; ++g) {
                uint32_t c0 = 0;
                uint32_t c1 = 0;
                mem->masked_cells(first_layer[g], strm, &c0, &c1);
                float * row = data.data() + (k * n_groups + g) * n_kv;
                for (int64_t c = c0; c < std::min<int64_t>(c1, n_kv); ++c) {
                    row[c] = -INFINITY;
                }
            }
        }
        ggml_backend_tensor_set(bias, data.data(), 0, ggml_nbytes(bias));
    }

    bool can_reuse(const llm_graph_params & params) override {
        // the mask this bias is added to decides on n_kv; the streams must match here
        const int64_t n_stream = params.cparams.kv_unified ? 1 : params.ubatch.n_seqs_unq;
        return bias->ne[3] == n_stream;
    }

    const llama_locret_memory * mem;
    ggml_tensor *               bias;
    std::vector<size_t>         first_layer; // per group: a layer of it (they all mask the same cells)
    std::vector<float>          data;
};

} // namespace

ggml_tensor * llama_locret_graph_layer_mask(ggml_context * ctx, llm_graph_result * res,
        const llama_memory_context_i * mctx, ggml_tensor * kq_mask, int il) {
    llama_locret_memory * mem = locret_memory_of_context(mctx);
    if (mem == nullptr || !mem->has_schedule() || il < 0 || kq_mask == nullptr) {
        return kq_mask;
    }
    const int32_t i = mem->layer_index((uint32_t) il);
    if (i < 0) {
        return kq_mask; // a window layer of an iSWA model: its own cache, its own mask
    }
    // groups: the distinct budgets, in the order of their first layer (layers of equal budget mask the same cells)
    std::vector<size_t>   first_layer;
    std::vector<uint32_t> budgets;
    size_t group = 0;
    for (size_t j = 0; j < mem->get_layers().size(); ++j) {
        size_t g = 0;
        while (g < budgets.size() && budgets[g] != mem->layer_budget(j)) {
            ++g;
        }
        if (g == budgets.size()) {
            budgets.push_back(mem->layer_budget(j));
            first_layer.push_back(j);
        }
        if (j == (size_t) i) {
            group = g;
        }
    }
    if (res->t_locret_mask_bias == nullptr) {
        // kq_mask: [n_kv, n_tokens/n_stream, 1, n_stream]
        ggml_tensor * bias = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, kq_mask->ne[0], (int64_t) budgets.size(), 1,
                kq_mask->ne[3]);
        ggml_set_input(bias);
        ggml_set_name(bias, "locret_layer_mask_bias");
        res->add_input(std::make_unique<locret_layer_mask_input>(mem, bias, first_layer));
        res->t_locret_mask_bias = bias;
        res->t_locret_layer_masks.assign(budgets.size(), nullptr);
    }
    ggml_tensor * bias = res->t_locret_mask_bias;
    GGML_ASSERT(group < res->t_locret_layer_masks.size());
    if (res->t_locret_layer_masks[group] == nullptr) {
        // the group's row of every stream, broadcast over the tokens: [n_kv, 1, 1, n_stream]
        ggml_tensor * row = ggml_view_4d(ctx, bias, bias->ne[0], 1, 1, bias->ne[3], bias->nb[1], bias->nb[2], bias->nb[3],
                group * bias->nb[1]);
        ggml_tensor * mask = ggml_add(ctx, kq_mask, row); // the mask's type (F16 for flash attention)
        ggml_format_name(mask, "locret_layer_mask-%zu", group);
        res->t_locret_layer_masks[group] = mask;
    }
    return res->t_locret_layer_masks[group];
}
