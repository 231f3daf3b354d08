// The Locret memory type (see locret-memory.h): planning ubatches, evicting, the memory interface in logical positions,
// and state save/load of the eviction bookkeeping.

#include "locret-memory.h"
#include "locret-heads.h"
#include "locret-select.h"

#include "llama-batch.h"
#include "llama-context.h"
#include "llama-cparams.h"
#include "llama-impl.h"
#include "llama-io.h"
#include "llama-model.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <typeinfo>
#include <atomic>
#include <functional>
#include <thread>
#include <utility>

//
// memory contexts: llama.cpp's own (the graph reads them as such) plus the plan of each ubatch
//

namespace {

// what a Locret memory context adds to llama.cpp's: the memory and the plan of every ubatch
struct locret_batch {
    virtual ~locret_batch() = default;

    llama_locret_memory * mem = nullptr;
    std::vector<locret_ubatch_plan> plans;
    size_t i_plan = 0;
};

// llama.cpp's memory context of type Base (llama_kv_cache_context, llama_kv_cache_iswa_context: the graph reads it as
// such) carrying the plan of every ubatch; without plans, a full-cache view (graph reservation) through which the graph
// still finds the memory (its score store)
template <typename Base>
class locret_context : public Base, public locret_batch {
public:
    template <typename... Args>
    locret_context(llama_locret_memory * mem, std::vector<locret_ubatch_plan> plans, Args &&... args)
        : Base(std::forward<Args>(args)...) {
        this->mem   = mem;
        this->plans = std::move(plans);
    }

    bool next() override {
        ++i_plan;
        return Base::next();
    }

    bool apply() override {
        if (!Base::apply()) {
            return false;
        }
        if (i_plan < plans.size()) {
            mem->placed(plans[i_plan]);
        }
        return true;
    }
};

using locret_kv_context   = locret_context<llama_kv_cache_context>;
using locret_iswa_context = locret_context<llama_kv_cache_iswa_context>;

// a copy of `u` whose positions are `pos`: the graph gets physical positions, the client's batch keeps its own
llama_ubatch locret_ubatch_with_pos(const llama_ubatch & u, const std::vector<llama_pos> & pos) {
    GGML_ASSERT(u.data != nullptr && u.n_pos == 1 && pos.size() == u.n_tokens);
    auto data = std::make_shared<llama_ubatch::data_t>(*u.data);
    data->pos = pos;
    // the per-token sequence pointers point into seq_id_data: point them into the copy
    llama_seq_id * seq_ptr = data->seq_id_data.data();
    for (uint32_t i = 0; i < u.n_tokens; ++i) {
        data->seq_id[i] = seq_ptr;
        seq_ptr += data->n_seq_id[i];
    }
    llama_ubatch r = u;
    r.token      = u.token ? data->token.data() : nullptr;
    r.embd       = u.embd  ? data->embd.data()  : nullptr;
    r.pos        = data->pos.data();
    r.n_seq_id   = data->n_seq_id.data();
    r.seq_id     = data->seq_id.data();
    r.seq_id_unq = data->seq_id_unq.data();
    r.seq_idx    = data->seq_idx.data();
    r.output     = data->output.data();
    r.data       = std::move(data);
    return r;
}

} // namespace

llama_locret_memory * locret_memory_of(llama_memory_i * mem) {
    return dynamic_cast<llama_locret_memory *>(mem);
}

const llama_locret_memory * locret_memory_of(const llama_memory_i * mem) {
    return dynamic_cast<const llama_locret_memory *>(mem);
}

llama_locret_memory * locret_memory_of_context(const llama_memory_context_i * mctx) {
    const auto * b = dynamic_cast<const locret_batch *>(mctx);
    return b != nullptr ? b->mem : nullptr;
}

const locret_ubatch_plan * locret_plan_of(const llama_memory_context_i * mctx, llama_locret_memory ** mem) {
    const auto * b = dynamic_cast<const locret_batch *>(mctx);
    if (b == nullptr || b->i_plan >= b->plans.size()) {
        return nullptr;
    }
    if (mem != nullptr) {
        *mem = b->mem;
    }
    return &b->plans[b->i_plan];
}

//
// construction
//

llama_locret_memory::llama_locret_memory(const llama_model & model, const llama_cparams & cparams,
        const locret_config & cfg_in, llama_memory_ptr inner_in)
    : model(model), cfg(cfg_in), policy(locret_policy_make(cfg_in.policy)), inner(std::move(inner_in)) {
    const llama_memory_i & m = *inner;
    if (typeid(m) == typeid(llama_kv_cache)) {
        kv = static_cast<llama_kv_cache *>(inner.get());
    } else if (typeid(m) == typeid(llama_kv_cache_iswa)) {
        iswa   = static_cast<llama_kv_cache_iswa *>(inner.get());
        kv     = iswa->get_base();
        kv_swa = iswa->get_swa();
    } else {
        throw std::runtime_error(format("the '%s' model's memory is not a KV cache llama.cpp can evict per unit "
                "(a recurrent, hybrid or sparse-attention memory); Locret eviction does not support it",
                llm_arch_name(model.arch)));
    }
    const uint32_t n_seq = std::max(1u, cparams.n_seq_max);
    if (kv->get_n_stream() != n_seq || kv->get_size() < cfg.capacity) {
        throw std::runtime_error(format("the KV cache has %u cells in %u streams, expected at least %u cells in %u",
                kv->get_size(), kv->get_n_stream(), cfg.capacity, n_seq));
    }
    cfg.n_cells = kv->get_size();
    v_trans     = kv->get_v_trans();

    const auto & hp = model.hparams;
    layer_of_il.assign(hp.n_layer(), -1);
    for (uint32_t il : kv->get_layer_ids()) {
        locret_kv_layer L;
        L.il        = il;
        L.n_head_kv = hp.n_head_kv(il);
        L.d_k       = hp.n_embd_head_k(il);
        L.d_v       = hp.n_embd_head_v(il);
        L.k         = kv->get_k_storage(il);
        L.v         = kv->get_v_storage(il);
        if (L.k == nullptr || L.v == nullptr || (uint64_t) L.v->ne[0] != (uint64_t) L.d_v * L.n_head_kv ||
                (uint64_t) L.k->ne[0] != (uint64_t) L.d_k * L.n_head_kv) {
            throw std::runtime_error(format("layer %u's K/V cache layout is not supported by Locret eviction", il));
        }
        L.rot = locret_rerotation_make(model, cparams, il);
        if (il < layer_of_il.size()) {
            layer_of_il[il] = (int32_t) layers.size();
        }
        layers.push_back(std::move(L));
    }

    if (!cfg.layer_budget.empty() && cfg.layer_budget.size() != layers.size()) {
        throw std::runtime_error(format("the budget schedule was resolved for %zu layers, but the cache evicts %zu",
                cfg.layer_budget.size(), layers.size()));
    }

    streams.resize(n_seq);
    for (auto & s : streams) {
        s.live_end.assign(layers.size(), 0);
        s.pos.resize(layers.size());
        for (size_t i = 0; i < layers.size(); ++i) {
            s.pos[i].assign((size_t) layers[i].n_head_kv * cfg.n_cells, -1);
        }
    }
    if (policy->stores_scores()) {
        make_score_store(n_seq);
        // a schedule keeps a different count per layer and skips each layer's masked cells: the host selects
        select_graph = select_graph && cfg.layer_budget.empty();
    }
    n_query_rows = policy->query_rows(cfg);
    if (n_query_rows > 0) {
        make_query_store(n_seq);
    }

    const std::string pooling = (cfg.pool > 0 ? format(", score pooling %u", cfg.pool) : std::string()) +
                                policy->describe(cfg);
    std::string budget = format("budget %u", cfg.budget);
    if (!cfg.layer_budget.empty()) {
        budget = format("budget %u per layer on average, scheduled from %u (layer %u) to %u (layer %u) units (the cache "
                "is sized for the largest)", cfg.budget_mean, cfg.layer_budget.front(), layers.front().il,
                cfg.layer_budget.back(), layers.back().il);
    }
    LLAMA_LOG_INFO("%s: Locret eviction: policy %s%s, %s, stabilizers %u, local %u%s, chunk (ubatch) %u -> %u KV "
            "cells per sequence, %u sequence(s) (logical context %u)%s\n", __func__, llama_locret_policy_name(cfg.policy),
            !policy->stores_scores() ? "" : select_graph ? " (selection on the device)" : " (selection on the host)",
            budget.c_str(), cfg.stabilizers, cfg.local, pooling.c_str(), cfg.n_ubatch, cfg.n_cells, n_seq, cparams.n_ctx,
            kv_swa ? ", window layers in their own cache" : "");
    if (!cfg.layer_budget.empty()) {
        std::string list;
        for (size_t i = 0; i < layers.size(); ++i) {
            list += format("%s%u:%u", i ? " " : "", layers[i].il, cfg.layer_budget[i]);
        }
        LLAMA_LOG_INFO("%s: Locret budget schedule (layer:units): %s\n", __func__, list.c_str());
    }
}

void llama_locret_memory::make_score_store(uint32_t n_seq) {
    bool uniform = true;
    for (const auto & L : layers) {
        uniform = uniform && L.n_head_kv == layers[0].n_head_kv;
    }
    const int64_t n_rows = (int64_t) cfg.n_cells * n_seq;
    ggml_init_params ip = { ggml_tensor_overhead() * (layers.size() + 1), nullptr, /*.no_alloc =*/ true };
    scores_ctx.reset(ggml_init(ip));
    ggml_context * ctx = scores_ctx.get();
    scores_of_layer.resize(layers.size());
    if (uniform) {
        scores_all = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, layers[0].n_head_kv, n_rows, (int64_t) layers.size());
        ggml_set_name(scores_all, "locret_scores");
    }
    for (size_t i = 0; i < layers.size(); ++i) {
        scores_of_layer[i] = uniform
            ? ggml_view_2d(ctx, scores_all, layers[i].n_head_kv, n_rows, scores_all->nb[1], i * scores_all->nb[2])
            : ggml_new_tensor_2d(ctx, GGML_TYPE_F32, layers[i].n_head_kv, n_rows);
        ggml_format_name(scores_of_layer[i], "locret_scores-%u", layers[i].il);
        layers[i].score = scores_of_layer[i];
    }
    // beside the keys they rank: the graph writes them where it writes the keys, and selects there
    ggml_backend_buffer_type_t buft = ggml_backend_buffer_get_type(layers[0].k->buffer);
    scores_buf.reset(ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft));
    if (!scores_buf) {
        throw std::runtime_error("failed to allocate the Locret score store");
    }
    ggml_backend_buffer_clear(scores_buf.get(), 0);

    select_graph = uniform && !ggml_backend_buffer_is_host(scores_buf.get());
    if (const char * e = getenv("LOCRET_DEBUG_SELECT")) {
        select_graph = uniform && strcmp(e, "graph") == 0 ? true : strcmp(e, "host") == 0 ? false : select_graph;
    }
}

void llama_locret_memory::make_query_store(uint32_t n_seq) {
    const auto & hp = model.hparams;
    ggml_init_params ip = { ggml_tensor_overhead() * layers.size(), nullptr, /*.no_alloc =*/ true };
    queries_ctx.reset(ggml_init(ip));
    queries_of_layer.resize(layers.size());
    query_scale.assign(layers.size(), NAN);
    for (size_t i = 0; i < layers.size(); ++i) {
        const int64_t width = (int64_t) layers[i].d_k * hp.n_head(layers[i].il);
        queries_of_layer[i] = ggml_new_tensor_2d(queries_ctx.get(), GGML_TYPE_F32, width, (int64_t) n_query_rows * n_seq);
        ggml_format_name(queries_of_layer[i], "locret_query-%u", layers[i].il);
    }
    // beside the keys the query is compared with
    ggml_backend_buffer_type_t buft = ggml_backend_buffer_get_type(layers[0].k->buffer);
    queries_buf.reset(ggml_backend_alloc_ctx_tensors_from_buft(queries_ctx.get(), buft));
    if (!queries_buf) {
        throw std::runtime_error("failed to allocate the Locret query store");
    }
    ggml_backend_buffer_clear(queries_buf.get(), 0);
}

int32_t llama_locret_memory::layer_index(uint32_t il) const {
    return il < layer_of_il.size() ? layer_of_il[il] : -1;
}

const locret_stream * llama_locret_memory::get_stream(llama_seq_id seq_id) const {
    return seq_id >= 0 && (size_t) seq_id < streams.size() ? &streams[seq_id] : nullptr;
}

bool llama_locret_memory::take_fault(locret_fault f) {
    if (fault != f) {
        return false;
    }
    fault = LOCRET_FAULT_NONE;
    return true;
}

size_t llama_locret_memory::evict_buffer_size() const {
    size_t n = 0;
    if (evict_sched) {
        for (int i = 0; i < ggml_backend_sched_get_n_backends(evict_sched.get()); ++i) {
            n += ggml_backend_sched_get_buffer_size(evict_sched.get(), ggml_backend_sched_get_backend(evict_sched.get(), i));
        }
    }
    return n;
}

uint64_t llama_locret_memory::kv_bytes() const {
    uint64_t n = 0;
    for (const auto & L : layers) {
        n += ggml_nbytes(L.k) + ggml_nbytes(L.v);
    }
    if (kv_swa != nullptr) {
        for (uint32_t il : kv_swa->get_layer_ids()) {
            n += ggml_nbytes(kv_swa->get_k_storage(il)) + ggml_nbytes(kv_swa->get_v_storage(il));
        }
    }
    return n;
}

//
// planning
//

locret_plan_params llama_locret_memory::plan_params() const {
    locret_plan_params p;
    p.budget       = cfg.budget;
    p.stabilizers  = cfg.stabilizers;
    p.local        = cfg.local;
    p.n_ubatch     = cfg.n_ubatch;
    p.capacity     = cfg.capacity;
    p.n_cells      = cfg.n_cells;
    p.selects_once = policy->reads_prompt_whole();
    return p;
}

llama_memory_context_ptr llama_locret_memory::init_batch(llama_batch_allocr & balloc, uint32_t n_ubatch, bool embd_all) {
    GGML_UNUSED(embd_all);
    auto failed = [] { return std::make_unique<llama_kv_cache_context>(LLAMA_MEMORY_STATUS_FAILED_PREPARE); };

    const llama_batch & batch = balloc.get_batch();
    const uint32_t n_tokens = balloc.get_n_tokens();

    const locret_plan_params params = plan_params();

    // the batch's sequences: how many tokens each has and whether its last one asks for an output (a prompt end)
    locret_batch_seqs seqs;
    {
        const locret_plan_error err = locret_plan_scan(n_tokens, batch.n_seq_id, batch.seq_id, batch.logits,
                                                       (uint32_t) streams.size(), seqs);
        if (!err.ok()) {
            LLAMA_LOG_ERROR("%s: Locret: %s\n", __func__, err.msg.c_str());
            return failed();
        }
    }

    // the ubatches: a sequence's tokens in parts of at most n_ubatch, the local tail of a prompt end in a part of its
    // own; with several sequences each part holds one sequence, except that one token per sequence (generation)
    // goes in one ubatch
    balloc.split_reset();
    std::vector<llama_ubatch> ubatches;
    if (seqs.one_each) {
        while (true) {
            auto ubatch = balloc.split_equal(n_ubatch, true, 0);
            if (ubatch.n_tokens == 0) {
                break;
            }
            ubatches.push_back(std::move(ubatch));
        }
    } else {
        std::vector<bool> used(n_tokens, false);
        std::vector<uint32_t> remaining = seqs.count;
        uint32_t first = 0;
        while (true) {
            while (first < n_tokens && used[first]) {
                ++first;
            }
            if (first >= n_tokens) {
                break;
            }
            const llama_seq_id s = batch.seq_id[first][0];
            const uint32_t take = locret_plan_take(n_ubatch, cfg.local, remaining[s], seqs.ends_with_output[s]);
            auto ubatch = seqs.n_seqs == 1 ? balloc.split_simple(take) : balloc.split_seq(take);
            if (ubatch.n_tokens == 0) {
                break;
            }
            for (int32_t idx : ubatch.data->batch_idxs) {
                used[idx] = true;
            }
            remaining[s] -= ubatch.n_tokens;
            ubatches.push_back(std::move(ubatch));
        }
    }
    if (balloc.get_n_used() < n_tokens) {
        LLAMA_LOG_ERROR("%s: Locret: failed to split a batch of %u tokens\n", __func__, n_tokens);
        return failed();
    }

    // simulate the evictions and placements, per stream
    std::vector<locret_plan_stream> sim(streams.size());
    for (size_t s = 0; s < streams.size(); ++s) {
        sim[s].n_used      = streams[s].n_used;
        sim[s].prev_output = streams[s].prev_output;
        sim[s].offset      = streams[s].logical_next - (llama_pos) streams[s].n_used;
        sim[s].sage_fresh  = policy->selection_due(streams[s].policy_state);
    }

    llama_kv_cache::slot_info_vec_t sinfos;
    std::vector<locret_ubatch_plan> plans;
    std::vector<llama_ubatch> physical;
    std::vector<llama_ubatch> window_frame; // positions in the window cache's frame at the start of the batch
    for (const auto & ubatch : ubatches) {
        locret_plan_tokens toks;
        toks.n_tokens = ubatch.n_tokens;
        toks.pos      = ubatch.pos;
        toks.seq_id   = ubatch.seq_id;
        toks.output   = ubatch.output;

        locret_ubatch_plan     plan;
        std::vector<llama_pos> pos_frame;
        const locret_plan_error err = locret_plan_ubatch(params, toks, sim, plan, pos_frame);
        if (!err.ok()) {
            if (err.status == LOCRET_PLAN_SAGE_TOO_LONG) {
                locret_set_error(err.msg); // the user's to fix: the reason goes to llama_locret_last_error
            }
            LLAMA_LOG_ERROR("%s: Locret: %s\n", __func__, err.msg.c_str());
            return failed();
        }

        // the inner cache's slot: each part's stream and cells, streams [s0, s1] (consecutive: checked by the plan)
        llama_kv_cache::slot_info sinfo;
        sinfo.resize(plan.steps.size());
        for (size_t p = 0; p < plan.steps.size(); ++p) {
            const locret_step & st = plan.steps[p];
            sinfo.strm[p] = st.strm;
            sinfo.idxs[p].resize(st.n_tokens);
            for (uint32_t j = 0; j < st.n_tokens; ++j) {
                sinfo.idxs[p][j] = st.first_cell + j;
            }
        }
        sinfo.s0 = *std::min_element(sinfo.strm.begin(), sinfo.strm.end());
        sinfo.s1 = *std::max_element(sinfo.strm.begin(), sinfo.strm.end());

        // the graph's copy of the ubatch: a token's physical position is its cell
        std::vector<llama_pos> pos_phys(ubatch.n_tokens);
        for (uint32_t i = 0; i < ubatch.n_tokens; ++i) {
            pos_phys[i] = (llama_pos) plan.cell[i];
        }
        sinfos.push_back(std::move(sinfo));
        physical.push_back(locret_ubatch_with_pos(ubatch, pos_phys));
        if (kv_swa != nullptr) {
            window_frame.push_back(locret_ubatch_with_pos(ubatch, pos_frame));
        }
        plans.push_back(std::move(plan));
    }

    if (kv_swa == nullptr) {
        return std::make_unique<locret_kv_context>(this, std::move(plans), kv, std::move(sinfos), std::move(physical));
    }
    // the window cache chooses its own cells, simulated in the frame it has now; the shifts that evictions apply before
    // each ubatch move the cells and the ubatch alike, so the choice stays valid
    auto sinfos_swa = kv_swa->prepare(window_frame);
    if (sinfos_swa.empty()) {
        LLAMA_LOG_ERROR("%s: Locret: no room in the window cache\n", __func__);
        return std::make_unique<llama_kv_cache_iswa_context>(LLAMA_MEMORY_STATUS_FAILED_PREPARE);
    }
    return std::make_unique<locret_iswa_context>(this, std::move(plans), iswa, std::move(sinfos), std::move(sinfos_swa),
            std::move(physical));
}

llama_memory_context_ptr llama_locret_memory::init_full() {
    if (iswa != nullptr) {
        return std::make_unique<locret_iswa_context>(this, std::vector<locret_ubatch_plan>(), iswa);
    }
    return std::make_unique<locret_kv_context>(this, std::vector<locret_ubatch_plan>(), kv);
}

llama_memory_context_ptr llama_locret_memory::init_update(llama_context * lctx, bool optimize) {
    return inner->init_update(lctx, optimize);
}

//
// placement and scores
//

void llama_locret_memory::placed(const locret_ubatch_plan & plan) {
    for (const auto & st : plan.steps) {
        locret_stream & s = streams[st.strm];
        // the ubatch split planned this part after the same evictions that ran before it
        GGML_ASSERT(st.first_cell == s.n_used && "Locret: ubatch placement does not follow the eviction plan");
        s.undo.valid         = true;
        s.undo.first_logical = st.first_logical;
        s.undo.before        = s.snapshot();
        const bool prompt_end = locret_plan_sage_prompt_end(s.prev_output, st.n_tokens, st.output);
        s.n_used       = st.first_cell + st.n_tokens;
        s.prev_output  = st.output;
        policy->placed(cfg, s.policy_state, s.n_used, st.n_tokens, prompt_end);
    }
    for (size_t t = 0; t < plan.cell.size(); ++t) {
        locret_stream & s = streams[plan.strm[t]];
        for (size_t i = 0; i < layers.size(); ++i) {
            for (uint32_t h = 0; h < layers[i].n_head_kv; ++h) {
                s.pos[i][(size_t) h * cfg.n_cells + plan.cell[t]] = plan.logical[t];
            }
        }
        s.logical_next = std::max(s.logical_next, plan.logical[t] + 1);
    }
}

//
// eviction
//

void llama_locret_memory::free_cells(uint32_t strm, uint32_t from) {
    // cells hold their physical position: removing positions >= from frees cells [from, n_used)
    kv->seq_rm((llama_seq_id) strm, (llama_pos) from, -1);
}

bool llama_locret_memory::shift_window(llama_context * lctx, uint32_t strm, llama_pos delta) {
    if (kv_swa == nullptr || delta == 0) {
        return true;
    }
    kv_swa->seq_add((llama_seq_id) strm, -1, -1, delta);
    // apply the K-shift now: the next ubatch reads the window cache in the new frame
    return kv_swa->update(lctx, true, {});
}

bool llama_locret_memory::reserve(llama_context * lctx) {
    // the context's backends, each with its default buffer type
    ggml_backend_sched_t ctx_sched = lctx->get_sched();
    std::vector<ggml_backend_t> backends;
    std::vector<ggml_backend_buffer_type_t> bufts;
    for (int i = 0; i < ggml_backend_sched_get_n_backends(ctx_sched); ++i) {
        backends.push_back(ggml_backend_sched_get_backend(ctx_sched, i));
        bufts.push_back(ggml_backend_get_default_buffer_type(backends.back()));
    }
    const size_t max_nodes = std::max(32 * layers.size() + 64, policy->score_graph_nodes(layers.size()));
    evict_sched.reset(ggml_backend_sched_new(backends.data(), bufts.data(), (int) backends.size(), max_nodes, false, false));
    evict_res.reset(new llm_graph_result((int64_t) max_nodes));

    // the worst cases: every retained unit of every sequence of a turn moves; a selection from a full cache. The moves
    // and the selection's read-back get their host memory here, pinned when the cache is on a device. A turn takes at
    // most COMPACT_MAX_SEQ sequences, so that a server's many slots do not multiply these buffers (at 256 slots they
    // would be several hundred MiB); LOCRET_DEBUG_COMPACT_SEQ=N takes fewer (tests: turns with a few sequences).
    locret_moves & moves = evict_moves;
    evict_turn_seq = std::min<uint32_t>((uint32_t) streams.size(), COMPACT_MAX_SEQ);
    if (const char * e = getenv("LOCRET_DEBUG_COMPACT_SEQ")) {
        evict_turn_seq = std::max<uint32_t>(1, std::min<uint32_t>(evict_turn_seq, (uint32_t) atoi(e)));
    }
    std::vector<size_t> cap(layers.size());
    size_t n_rows = 0;
    for (size_t i = 0; i < layers.size(); ++i) {
        cap[i] = (size_t) evict_turn_seq * cfg.budget * layers[i].n_head_kv;
        n_rows += layers[i].n_head_kv;
    }
    try {
        moves.allocate(cap, ggml_backend_buffer_get_type(layers[0].k->buffer));
    } catch (const std::exception & e) {
        locret_set_error(e.what());
        return false;
    }
    for (auto & m : moves.layer) {
        // only the shapes matter for the reservation, but a transposed V's element indices are made from the rows
        std::fill(m.src, m.src + m.cap, 0);
        std::fill(m.dst, m.dst + m.cap, 0);
        std::fill(m.delta, m.delta + m.cap, 0);
        m.n = m.cap;
    }
    select_idx_cap = select_graph ? n_rows * cfg.budget : 0;
    select_idx = (int32_t *) select_idx_block.reserve(locret_host_buft_for(layers[0].k), select_idx_cap * sizeof(int32_t));
    evict_res->reset();
    ggml_cgraph * gf = locret_build_compact_graph(evict_res.get(), kv, v_trans, layers, moves);
    bool ok = ggml_backend_sched_reserve(evict_sched.get(), gf);
    if (ok && select_graph && cfg.budget < cfg.capacity) {
        evict_res->reset();
        gf = evict_res->get_gf();
        ggml_build_forward_expand(gf, locret_build_select(evict_res->get_ctx(), scores_all, 0, cfg.n_cells, 0, cfg.capacity, cfg.budget));
        ok = ggml_backend_sched_reserve(evict_sched.get(), gf);
    }
    if (ok && policy->score_graph_nodes(layers.size()) > 0) {
        // the policy's largest scoring graph
        evict_res->reset();
        gf = evict_res->get_gf();
        policy->build_worst_score_graph(policy_env(), evict_res->get_ctx(), gf);
        ok = ggml_backend_sched_reserve(evict_sched.get(), gf);
    }
    moves.clear();
    evict_res->reset();
    ggml_backend_sched_reset(evict_sched.get());
    if (!ok) {
        locret_set_error("failed to allocate the compute buffers of the Locret eviction graphs");
        return false;
    }
    LLAMA_LOG_INFO("%s: Locret eviction graphs: compute buffers %.2f MiB, move tables %.2f MiB, score store %.2f MiB, "
            "up to %u sequences per compaction\n", __func__,
            evict_buffer_size() / 1024.0 / 1024.0, move_tables_size() / 1024.0 / 1024.0,
            score_store_size() / 1024.0 / 1024.0, compact_seq());
    return true;
}

// f(i) for i in [0, n), spread over up to 16 threads: the host's part of an eviction is O(n) per (layer, KV head) and
// the device waits for it, so every core helps (layers are independent: each writes only its own rows and moves)
template <typename F>
static void locret_parallel_for(size_t n, unsigned max_threads, F && f) {
    const size_t n_threads = std::min<size_t>(n, std::max(1u, std::min(max_threads, std::thread::hardware_concurrency())));
    std::atomic<size_t> next { 0 };
    auto work = [&]() {
        for (size_t i = next++; i < n; i = next++) {
            f(i);
        }
    };
    std::vector<std::thread> workers;
    for (size_t t = 1; t < n_threads; ++t) {
        workers.emplace_back(work);
    }
    work();
    for (auto & w : workers) {
        w.join();
    }
}

bool llama_locret_memory::select_on_device(uint32_t strm, uint32_t cell0, uint32_t n_cand, uint32_t n_top) {
    const int64_t p0 = ggml_time_us();
    ggml_backend_sched_t sched = evict_sched.get();
    ggml_backend_sched_reset(sched);
    evict_res->reset();
    ggml_cgraph * gf = evict_res->get_gf();
    ggml_tensor * top = locret_build_select(evict_res->get_ctx(), scores_all, strm, cfg.n_cells, cell0, n_cand, n_top);
    ggml_build_forward_expand(gf, top);
    const int64_t p1 = ggml_time_us();
    if (!ggml_backend_sched_alloc_graph(sched, gf)) {
        LLAMA_LOG_ERROR("%s: Locret: the selection graph failed\n", __func__);
        return false;
    }
    const int64_t p2 = ggml_time_us();
    if (ggml_backend_sched_graph_compute(sched, gf) != GGML_STATUS_SUCCESS) {
        LLAMA_LOG_ERROR("%s: Locret: the selection graph failed\n", __func__);
        return false;
    }
    if (locret_profile()) {
        fprintf(stderr, "locret-profile: select build %.2f alloc %.2f compute %.2f ms (splits %d)\n", (p1 - p0) / 1e3,
                (p2 - p1) / 1e3, (ggml_time_us() - p2) / 1e3, ggml_backend_sched_get_n_splits(sched));
    }
    // the one read-back of an eviction: the kept cells of every (layer, KV head)
    const int64_t t0_us = ggml_time_us();
    GGML_ASSERT((size_t) ggml_nelements(top) <= select_idx_cap);
    ggml_backend_tensor_get(top, select_idx, 0, ggml_nbytes(top));
    t.readback_us += ggml_time_us() - t0_us;
    return true;
}

locret_policy_env llama_locret_memory::policy_env() {
    return { cfg, layers, v_trans, queries_of_layer, query_scale,
        [this](const char * title, const std::string & what, const std::function<void(ggml_context *, ggml_cgraph *)> & build) {
            return run_score_graph(title, what, build);
        } };
}

bool llama_locret_memory::run_score_graph(const char * policy_name, const std::string & what,
        const std::function<void(ggml_context *, ggml_cgraph *)> & build) {
    const int64_t p0 = ggml_time_us();
    ggml_backend_sched_t sched = evict_sched.get();
    ggml_backend_sched_reset(sched);
    evict_res->reset();
    ggml_cgraph * gf = evict_res->get_gf();
    build(evict_res->get_ctx(), gf);
    if (!ggml_backend_sched_alloc_graph(sched, gf) || ggml_backend_sched_graph_compute(sched, gf) != GGML_STATUS_SUCCESS) {
        locret_set_error(format("the %s scoring graph could not run; the cache is unchanged", policy_name));
        LLAMA_LOG_ERROR("%s: Locret: the %s scoring graph failed\n", __func__, policy_name);
        return false;
    }
    if (locret_profile()) {
        fprintf(stderr, "locret-profile: %s scores of %s %.2f ms (splits %d)\n", policy_name, what.c_str(),
                (ggml_time_us() - p0) / 1e3, ggml_backend_sched_get_n_splits(sched));
    }
    return true;
}

void llama_locret_memory::select_layer(size_t i, size_t row0, uint32_t n_used, uint32_t n_keep, uint32_t n_pin, uint32_t n_stab, bool from_idx, const float * block, const locret_stream & s, uint32_t * keep) const {
    const uint32_t n_head_kv = layers[i].n_head_kv;
    const uint32_t n_top     = n_keep - n_pin - n_stab;
    std::vector<uint8_t>  mark;
    std::vector<float>    row;
    std::vector<uint32_t> kept;
    for (uint32_t h = 0; h < n_head_kv; ++h) {
        uint32_t * out = keep + (row0 + h) * n_keep;
        if (from_idx) {
            locret_keep_from_top(select_idx + (row0 + h) * n_top, n_top, n_used, n_pin, n_stab, out, mark);
            continue;
        }
        row.resize(n_used);
        if (policy->stores_scores()) {
            for (uint32_t c = 0; c < n_used; ++c) {
                row[c] = block[(size_t) c * n_head_kv + h];
            }
        } else {
            policy->score({ layers[i].il, h, s.pos[i].data() + (size_t) h * cfg.n_cells, row.data(), n_used, s.logical_next });
        }
        locret_select(row.data(), n_used, n_keep, n_pin, n_stab, kept);
        std::copy(kept.begin(), kept.end(), out);
    }
}

void llama_locret_memory::select_layer_masked(size_t i, size_t row0, uint32_t n_used, uint32_t m0, uint32_t m1,
        uint32_t n_live, uint32_t n_keep, uint32_t n_pin, uint32_t n_stab, const float * block, const locret_stream & s,
        uint32_t * keep) const {
    // Algorithm 1 over the cells the layer reads, [0, m0) and [m1, n_used), as if they were consecutive: the pinned
    // ones first, its last n_stab, the best of the rest
    const uint32_t n_head_kv = layers[i].n_head_kv;
    const uint32_t gap       = m1 - m0;
    const uint32_t n_held    = n_used - gap;
    const uint32_t stab      = std::min(n_stab, n_held - n_pin);
    std::vector<float>    row(n_used);
    std::vector<float>    held(n_held);
    std::vector<uint32_t> kept;
    for (uint32_t h = 0; h < n_head_kv; ++h) {
        if (policy->stores_scores()) {
            for (uint32_t c = 0; c < n_used; ++c) {
                row[c] = block[(size_t) c * n_head_kv + h];
            }
        } else {
            policy->score({ layers[i].il, h, s.pos[i].data() + (size_t) h * cfg.n_cells, row.data(), n_used, s.logical_next });
        }
        for (uint32_t j = 0; j < n_held; ++j) {
            held[j] = row[j < m0 ? j : j + gap];
        }
        locret_select(held.data(), n_held, n_live, n_pin, stab, kept);
        uint32_t * out = keep + (row0 + h) * n_keep;
        for (uint32_t k = 0; k < n_live; ++k) {
            out[k] = kept[k] < m0 ? kept[k] : kept[k] + gap;
        }
    }
}

int llama_locret_memory::evict(llama_context * lctx, const locret_ubatch_plan & plan) {
    // the previous ubatch wrote the scores and reads the cells that move: wait for it
    ggml_backend_sched_synchronize(lctx->get_sched());
    if (evict_moves.layer.size() != layers.size()) {
        // the room for the moves is made when the context reserves its graphs
        locret_set_error("the Locret eviction graphs were not reserved; the cache is unchanged");
        return -1;
    }
    // the move tables hold one turn's sequences: more are evicted in turns, each selected, compacted and recorded
    // before the next (a batch of one token per sequence, generation on a busy server, can bring every stream at once).
    // Only the steps that evict count towards a turn, so that sequences evicting in the same ubatch share a compaction
    // however many others the ubatch holds.
    std::vector<locret_step> & evicting = evict_steps;
    evicting.clear();
    for (const locret_step & st : plan.steps) {
        if (st.n_keep < streams[st.strm].n_used) {
            evicting.push_back(st);
        }
    }
    int ret = 0;
    for (size_t first = 0; first < evicting.size(); first += evict_turn_seq) {
        const int rc = evict_turn(lctx, evicting.data() + first, std::min<size_t>(evict_turn_seq, evicting.size() - first));
        if (rc < 0) {
            if (first > 0) {
                locret_set_error(format("%s (the sequences of the eviction's %zu earlier turn(s) were evicted)",
                        llama_locret_last_error(), first / evict_turn_seq));
            }
            return -1;
        }
        ret = std::max(ret, rc);
    }
    return ret;
}

int llama_locret_memory::evict_turn(llama_context * lctx, const locret_step * steps, size_t n_steps) {
    const int64_t t_start_us = ggml_time_us();
    const uint64_t readback_before_us = t.readback_us;

    // the selections, into the pending positions: nothing changes until the compaction has run
    struct pending_t { locret_evict_args args; locret_protect prot; };
    const locret_policy_env env = policy_env();
    // a budget schedule: per pending eviction, the units each layer keeps (its live_end after the eviction)
    live_next.resize(std::max(live_next.size(), n_steps));
    std::vector<pending_t> pending;
    locret_moves & moves = evict_moves;
    moves.clear();
    std::vector<size_t> row0(layers.size() + 1, 0); // first (layer, KV head) row of each layer
    for (size_t i = 0; i < layers.size(); ++i) {
        row0[i + 1] = row0[i] + layers[i].n_head_kv;
    }
    for (size_t k_step = 0; k_step < n_steps; ++k_step) {
        const locret_step & st = steps[k_step];
        const locret_stream & s = streams[st.strm];
        if (st.n_keep >= s.n_used) {
            continue;
        }
        // a pinned query (Locret-Q) stays like the stabilizers: the rest of the budget is chosen by score; the policy
        // computes the scores it needs now and may protect more (sinks, units waiting for a score, a chosen set)
        const locret_evict_args args = { st.strm, s.n_used, st.n_keep, pinned_cells(s), st.n_stab };
        locret_protect prot;
        if (!policy->prepare(env, args, streams[st.strm].policy_state, prot)) {
            return -1;
        }
        const uint32_t n_pin  = prot.n_pin;
        const uint32_t n_stab = prot.n_stab;
        if (n_pin + n_stab > st.n_keep) {
            // only a state loaded from elsewhere could bring this: the settings checks keep room for both
            locret_set_error(format("Locret: sequence %u keeps %u leading and %u trailing units, more than the %u it may "
                    "keep; the cache is unchanged", st.strm, n_pin, n_stab, st.n_keep));
            return -1;
        }
        const uint32_t n_used = s.n_used;
        const uint32_t n_cand = n_used - n_stab - n_pin;
        const uint32_t n_top  = st.n_keep - n_stab - n_pin;

        // where the scores are: the device selects, or the host reads the store (in place when it is host memory)
        // nothing chosen by score (SAGE-KV after its selection): no score is read
        const bool ends_only = n_top == 0;
        const bool on_device = policy->stores_scores() && select_graph && n_top > 0 && n_top < n_cand;
        if (on_device && !select_on_device(st.strm, n_pin, n_cand, n_top)) {
            locret_set_error("the Locret selection graph could not run; the cache is unchanged");
            return -1;
        }
        std::vector<const float *> blocks(layers.size(), nullptr); // per layer: this stream's [n_used][n_head_kv]
        if (!on_device && !ends_only && policy->stores_scores()) {
            size_t n_floats = 0;
            for (size_t i = 0; i < layers.size(); ++i) {
                n_floats += (size_t) n_used * layers[i].n_head_kv;
            }
            select_scores.resize(n_floats);
            const int64_t t0_us = ggml_time_us();
            size_t at = 0;
            for (size_t i = 0; i < layers.size(); ++i) {
                const ggml_tensor * st_i = scores_of_layer[i];
                if (ggml_backend_buffer_is_host(st_i->buffer)) {
                    blocks[i] = (const float *) ((const char *) st_i->data + scores_offset(i, st.strm));
                } else {
                    scores_get(i, st.strm, n_used, select_scores.data() + at);
                    blocks[i] = select_scores.data() + at;
                    at += (size_t) n_used * layers[i].n_head_kv;
                }
            }
            t.readback_us += ggml_time_us() - t0_us;
        }

        if (pos_next.size() <= pending.size()) {
            pos_next.resize(pending.size() + 1);
        }
        auto & next = pos_next[pending.size()];
        next.resize(layers.size());
        evict_keep.resize(row0.back() * st.n_keep);
        const int64_t base = (int64_t) st.strm * cfg.n_cells;
        auto & live = live_next[pending.size()];
        live.assign(layers.size(), st.n_keep);
        // threads only where the work outweighs starting them (a few hundred thousand units)
        const size_t n_work = row0.back() * (size_t) n_used;
        locret_parallel_for(layers.size(), n_work < (1u << 19) ? 1 : 16, [&](size_t i) {
            // the units layer i keeps: its budget (a schedule's), at most the ones it holds outside its masked cells
            const uint32_t masked = s.dead_end - s.live_end[i];
            const uint32_t n_live = std::min({ st.n_keep, layer_budget(i), n_used - masked });
            // rows [0, live_end) moved with the last eviction sit at positions offset by the masked cells after them
            const int32_t  old_shift = (int32_t) masked;
            const int32_t  new_shift = (int32_t) (st.n_keep - n_live);
            live[i] = n_live;
            if (masked == 0 && n_live == st.n_keep) {
                select_layer(i, row0[i], n_used, st.n_keep, n_pin, n_stab, on_device || ends_only, blocks[i], s,
                        evict_keep.data());
            } else {
                select_layer_masked(i, row0[i], n_used, s.live_end[i], s.dead_end, n_live, st.n_keep, n_pin, n_stab,
                        blocks[i], s, evict_keep.data());
            }
            const uint32_t n_head_kv = layers[i].n_head_kv;
            next[i].resize(s.pos[i].size());
            // the layer's moves are written through local pointers and counted once at the end: the layers' headers
            // sit side by side, and a count updated per move from several threads would share their cache lines
            auto & m = moves.layer[i];
            GGML_ASSERT(m.n + (size_t) n_head_kv * st.n_keep <= m.cap);
            int32_t * p_src = m.src   + m.n;
            int64_t * p_dst = m.dst   + m.n;
            int32_t * p_dlt = m.delta + m.n;
            size_t n = 0;
            for (uint32_t h = 0; h < n_head_kv; ++h) {
                const int32_t  * pos     = s.pos[i].data() + (size_t) h * cfg.n_cells;
                int32_t        * pos_new = next[i].data()  + (size_t) h * cfg.n_cells;
                const uint32_t * kept    = evict_keep.data() + (row0[i] + h) * st.n_keep;
                for (uint32_t k = 0; k < n_live; ++k) {
                    const uint32_t c = kept[k]; // c >= k: compacting forward in place is safe
                    pos_new[k] = pos[c];
                    // its physical position: before, after, and the rotation between them
                    const int32_t p_old = (int32_t) c + (c < s.live_end[i] ? old_shift : 0);
                    const int32_t p_new = (int32_t) k + new_shift;
                    if (c != k || p_new != p_old) {
                        p_src[n] = (int32_t) ((base + c) * n_head_kv + h);
                        p_dst[n] = (base + k) * n_head_kv + h;
                        p_dlt[n] = p_new - p_old;
                        ++n;
                    }
                }
                std::fill(pos_new + n_live, pos_new + st.n_keep, -1); // masked in this layer until the next eviction
            }
            m.n += n;
        });
        pending.push_back({ args, prot });
        if (locret_profile()) {
            fprintf(stderr, "locret-profile: selected by %s, %.2f ms since the start\n", on_device ? "device" : "host",
                    (ggml_time_us() - t_start_us) / 1e3);
        }
    }
    if (pending.empty()) {
        return 0;
    }
    const int64_t t_selected_us = ggml_time_us();
    // the device selection accounted for its own time; the host's (and the bookkeeping) is the rest
    t.select_us += (uint64_t) (t_selected_us - t_start_us) - (t.readback_us - readback_before_us);

    const locret_compact_status status = moves.empty() ? LOCRET_COMPACT_OK :
        locret_compact(evict_sched.get(), evict_res.get(), kv, v_trans, layers, moves,
                take_fault(LOCRET_FAULT_EVICT_ALLOC), take_fault(LOCRET_FAULT_EVICT_COMPUTE));
    t.n_compactions += !moves.empty() && status != LOCRET_COMPACT_NOT_RUN;
    if (status == LOCRET_COMPACT_NOT_RUN) {
        locret_set_error("the Locret compaction graph could not run; the cache is unchanged");
        return -1;
    }
    bool ok = status == LOCRET_COMPACT_OK;
    if (locret_profile()) {
        const size_t n_moves = moves.count();
        fprintf(stderr, "locret-profile: compaction of %zu rows %.2f ms\n", n_moves, (ggml_time_us() - t_selected_us) / 1e3);
    }

    bool shifted = false;
    for (size_t p = 0; p < pending.size() && ok; ++p) {
        const locret_evict_args & pd = pending[p].args;
        locret_stream & s = streams[pd.strm];
        const uint32_t n_used = s.n_used;
        free_cells(pd.strm, pd.n_keep);
        s.pos.swap(pos_next[p]);
        uint64_t n_evicted = 0;
        for (size_t i = 0; i < layers.size(); ++i) {
            const uint32_t held = n_used - (s.dead_end - s.live_end[i]);
            n_evicted += (uint64_t) layers[i].n_head_kv * (held - live_next[p][i]);
        }
        s.live_end         = live_next[p];
        s.dead_end         = pd.n_keep;
        s.n_used           = pd.n_keep;
        s.uniform_from     = pd.n_keep;
        policy->compacted(cfg, pd, pending[p].prot, s.policy_state);
        s.undo.valid       = false;
        s.n_evictions     += 1;
        s.n_units_evicted += n_evicted;
        shifted = shifted || kv_swa != nullptr;
        if (!shift_window(lctx, pd.strm, -(llama_pos) (n_used - pd.n_keep))) {
            LLAMA_LOG_ERROR("%s: Locret: the window cache could not follow the compaction\n", __func__);
            ok = false;
        }
        LLAMA_LOG_DEBUG("%s: Locret eviction %llu of sequence %u: %u -> %u units per head (%u stabilizers), logical position %d\n",
                __func__, (unsigned long long) s.n_evictions, pd.strm, n_used, pd.n_keep, pending[p].prot.n_stab, s.logical_next);
    }
    if (!ok) {
        // the cache may be half moved: empty the sequences involved, so that nothing inconsistent is ever read
        for (const auto & pd : pending) {
            kv->seq_rm((llama_seq_id) pd.args.strm, -1, -1);
            if (kv_swa != nullptr) {
                kv_swa->seq_rm((llama_seq_id) pd.args.strm, -1, -1);
            }
            reset_stream(streams[pd.args.strm]);
        }
        locret_set_error("the Locret compaction failed part-way; the sequences it touched were emptied");
        return -1;
    }
    t.compact_us += ggml_time_us() - t_selected_us;
    // the eviction graphs have their own scheduler: the context's last graph stays reusable, unless the window cache
    // was shifted (llama.cpp's K-shift runs on the context's scheduler)
    return shifted ? 1 : 0;
}

//
// the memory interface in logical positions
//

void llama_locret_memory::reset_stream(locret_stream & s) {
    for (size_t i = 0; i < layers.size(); ++i) {
        std::fill(s.pos[i].begin(), s.pos[i].end(), -1);
    }
    s.n_used       = 0;
    s.uniform_from = 0;
    s.prev_output  = true;
    s.logical_next = 0;
    s.n_pinned     = 0;
    s.policy_state = {};
    s.dead_end     = 0;
    std::fill(s.live_end.begin(), s.live_end.end(), 0);
    s.undo.valid   = false;
    // the counters describe what the sequence now holds: a new prompt in an emptied sequence counts from zero
    s.n_evictions     = 0;
    s.n_units_evicted = 0;
}

uint32_t llama_locret_memory::min_layer_budget() const {
    return cfg.layer_budget.empty() ? cfg.budget : *std::min_element(cfg.layer_budget.begin(), cfg.layer_budget.end());
}

void llama_locret_memory::masked_cells(size_t i, uint32_t strm, uint32_t * c0, uint32_t * c1) const {
    const locret_stream & s = streams[strm];
    *c0 = std::min(s.live_end[i], s.dead_end);
    *c1 = s.dead_end;
}

uint32_t llama_locret_memory::pinned_cells(const locret_stream & s) const {
    if (s.n_pinned == 0 || layers.empty()) {
        return 0;
    }
    const int32_t * pos = s.pos[0].data();
    uint32_t n = 0;
    while (n < s.n_used && pos[n] >= 0 && pos[n] < (int32_t) s.n_pinned) { // (-1: a cell a schedule masks)
        ++n;
    }
    return n;
}

bool llama_locret_memory::pin_prefix(llama_seq_id seq_id, uint32_t n_tokens) {
    if (seq_id < 0 || (size_t) seq_id >= streams.size()) {
        locret_set_error(format("Locret: no sequence %d to pin a query in (%zu sequences)", seq_id, streams.size()));
        return false;
    }
    locret_stream & s = streams[seq_id];
    if (n_tokens == s.n_pinned) {
        return true;
    }
    if (!policy->pin_problem().empty()) {
        locret_set_error(policy->pin_problem());
        return false;
    }
    if (s.uniform_from > 0) {
        // after an eviction the heads hold different units: a new pin could name units some heads no longer have
        locret_set_error(format("Locret: sequence %d has already evicted units; pin its query before its first eviction "
                "(or empty it first)", seq_id));
        return false;
    }
    // the pinned units, the stabilizers and at least one unit chosen by score must fit in the budget (with what the
    // policy keeps unscored, LagKV's sinks and partitions)
    const uint64_t unscored = policy->unscored_units(cfg);
    if ((uint64_t) n_tokens + cfg.stabilizers + unscored >= min_layer_budget()) {
        locret_set_error(format("Locret: a pinned query of %u tokens leaves no room in the budget (%u units per head%s, "
                "%u stabilizers%s): shorten the query or raise the budget", n_tokens, min_layer_budget(),
                has_schedule() ? " in the smallest layer budget of the schedule" : "", cfg.stabilizers,
                unscored > 0 ? format(", LagKV's %d sinks and 2 partitions of %u", LLAMA_LOCRET_LAGKV_SINKS, cfg.lag).c_str() : ""));
        return false;
    }
    s.n_pinned = n_tokens;
    return true;
}

void llama_locret_memory::clear(bool data) {
    inner->clear(data);
    for (auto & s : streams) {
        reset_stream(s);
    }
}

bool llama_locret_memory::seq_rm(llama_seq_id seq_id, llama_pos p0, llama_pos p1) {
    if (seq_id < 0) {
        bool ok = true;
        for (size_t s = 0; s < streams.size(); ++s) {
            ok = seq_rm((llama_seq_id) s, p0, p1) && ok;
        }
        return ok;
    }
    if ((size_t) seq_id >= streams.size()) {
        return false;
    }
    locret_stream & s = streams[seq_id];
    p0 = std::max(p0, 0);
    if (p1 < 0) {
        p1 = std::numeric_limits<llama_pos>::max();
    }
    if (s.n_used == 0 || p0 >= p1 || p0 >= s.logical_next) {
        return true;
    }
    if (p0 <= seq_pos_min(seq_id) && p1 >= s.logical_next) {
        inner->seq_rm(seq_id, -1, -1);
        reset_stream(s);
        return true;
    }
    if (p1 < s.logical_next) {
        LLAMA_LOG_DEBUG("%s: Locret: cannot remove positions [%d, %d) from the middle of sequence %d\n", __func__, p0, p1, seq_id);
        return false;
    }
    // a suffix placed after the last eviction sits in the same cells of every head: it can go
    const int32_t * pos = s.pos.empty() ? nullptr : s.pos[0].data();
    if (pos == nullptr || s.uniform_from >= s.n_used || pos[s.uniform_from] > p0) {
        // positions inside the compressed part differ per head: they cannot be removed one by one
        LLAMA_LOG_DEBUG("%s: Locret: cannot remove positions from %d: sequence %d is compressed there\n", __func__, p0, seq_id);
        return false;
    }
    uint32_t first = s.uniform_from;
    while (first < s.n_used && pos[first] < p0) {
        ++first;
    }
    const llama_pos offset = s.logical_next - (llama_pos) s.n_used; // logical - physical of the uniform part
    if (kv_swa != nullptr) {
        // the window layers continue from p0 only if their cache still holds the window before it
        const llama_pos swa_min = kv_swa->seq_pos_min(seq_id);
        if (first > 0 && (swa_min < 0 || swa_min + offset > std::max(0, p0 - (llama_pos) model.hparams.n_swa))) {
            LLAMA_LOG_DEBUG("%s: Locret: the window cache of sequence %d no longer holds the window before %d\n", __func__, seq_id, p0);
            return false;
        }
        kv_swa->seq_rm(seq_id, (llama_pos) first, -1);
    }
    free_cells((uint32_t) seq_id, first);
    for (size_t i = 0; i < layers.size(); ++i) {
        for (uint32_t h = 0; h < layers[i].n_head_kv; ++h) {
            std::fill(s.pos[i].begin() + (size_t) h * cfg.n_cells + first, s.pos[i].begin() + (size_t) h * cfg.n_cells + s.n_used, -1);
        }
    }
    if (s.undo.valid && s.undo.first_logical == p0 && s.undo.before.n_used == first) {
        // exactly the last part placed (a failed ubatch taken back): the state before it
        s.restore(s.undo.before);
    } else {
        s.n_used       = first;
        s.logical_next = p0;
        s.prev_output  = true;
    }
    policy->truncated(cfg, s.policy_state, s.n_used);
    s.undo.valid = false;
    return true;
}

void llama_locret_memory::seq_cp(llama_seq_id seq_id_src, llama_seq_id seq_id_dst, llama_pos p0, llama_pos p1) {
    if (seq_id_src == seq_id_dst || seq_id_src < 0 || seq_id_dst < 0 ||
            (size_t) seq_id_src >= streams.size() || (size_t) seq_id_dst >= streams.size()) {
        return;
    }
    const locret_stream & src = streams[seq_id_src];
    if (p0 > 0 || (p1 >= 0 && p1 < src.logical_next)) {
        LLAMA_LOG_ERROR("%s: Locret: a compressed sequence can only be copied whole; sequence %d was not copied\n",
                __func__, seq_id_src);
        return;
    }
    // the streams' cells are copied at the next update (llama.cpp's stream copy), the bookkeeping now
    inner->seq_cp(seq_id_src, seq_id_dst, -1, -1);
    streams[seq_id_dst] = src;
    copy_scores((uint32_t) seq_id_src, (uint32_t) seq_id_dst);
    for (ggml_tensor * q : queries_of_layer) {
        // the copy's next selection reads the same captured queries
        std::vector<uint8_t> rows(query_block_bytes(q));
        ggml_backend_tensor_get(q, rows.data(), (size_t) seq_id_src * rows.size(), rows.size());
        ggml_backend_tensor_set(q, rows.data(), (size_t) seq_id_dst * rows.size(), rows.size());
    }
    streams[seq_id_dst].undo.valid = false;
}

size_t llama_locret_memory::scores_offset(size_t i, uint32_t strm) const {
    return (size_t) strm * cfg.n_cells * scores_of_layer[i]->nb[1];
}

void llama_locret_memory::scores_get(size_t i, uint32_t strm, uint32_t n_used, float * out) const {
    ggml_backend_tensor_get(scores_of_layer[i], out, scores_offset(i, strm), sizeof(float) * n_used * layers[i].n_head_kv);
}

void llama_locret_memory::scores_set(size_t i, uint32_t strm, uint32_t n_used, const float * in) {
    ggml_backend_tensor_set(scores_of_layer[i], in, scores_offset(i, strm), sizeof(float) * n_used * layers[i].n_head_kv);
}

void llama_locret_memory::copy_scores(uint32_t strm_src, uint32_t strm_dst) {
    const uint32_t n_used = streams[strm_src].n_used;
    std::vector<float> buf;
    for (size_t i = 0; i < scores_of_layer.size(); ++i) {
        buf.resize((size_t) n_used * layers[i].n_head_kv);
        scores_get(i, strm_src, n_used, buf.data());
        scores_set(i, strm_dst, n_used, buf.data());
    }
}

void llama_locret_memory::seq_keep(llama_seq_id seq_id) {
    inner->seq_keep(seq_id);
    for (size_t s = 0; s < streams.size(); ++s) {
        if ((llama_seq_id) s != seq_id) {
            reset_stream(streams[s]);
        }
    }
}

void llama_locret_memory::seq_add(llama_seq_id seq_id, llama_pos p0, llama_pos p1, llama_pos shift) {
    // logical positions are labels: RoPE uses the physical ones, so a shift only relabels units
    if (seq_id < 0 || (size_t) seq_id >= streams.size() || shift == 0) {
        return;
    }
    locret_stream & s = streams[seq_id];
    p0 = std::max(p0, 0);
    if (p1 < 0) {
        p1 = std::numeric_limits<llama_pos>::max();
    }
    for (size_t i = 0; i < layers.size(); ++i) {
        for (uint32_t h = 0; h < layers[i].n_head_kv; ++h) {
            int32_t * pos = s.pos[i].data() + (size_t) h * cfg.n_cells;
            for (uint32_t c = 0; c < s.n_used; ++c) {
                if (pos[c] >= p0 && pos[c] < p1) {
                    pos[c] += shift;
                }
            }
        }
    }
    if (s.logical_next >= p0 && s.logical_next <= p1) {
        s.logical_next += shift;
    }
    s.undo.valid = false;
}

void llama_locret_memory::seq_div(llama_seq_id seq_id, llama_pos p0, llama_pos p1, int d) {
    GGML_UNUSED(seq_id); GGML_UNUSED(p0); GGML_UNUSED(p1); GGML_UNUSED(d);
    LLAMA_LOG_WARN("%s: Locret eviction: seq_div is not supported on a compressed cache; ignored\n", __func__);
}

llama_pos llama_locret_memory::seq_pos_min(llama_seq_id seq_id) const {
    const locret_stream * s = get_stream(seq_id);
    if (s == nullptr || s->n_used == 0) {
        return -1;
    }
    llama_pos res = std::numeric_limits<llama_pos>::max();
    for (size_t i = 0; i < layers.size(); ++i) {
        for (uint32_t h = 0; h < layers[i].n_head_kv; ++h) {
            res = std::min(res, s->pos[i][(size_t) h * cfg.n_cells]); // cells are in position order
        }
    }
    if (kv_swa != nullptr) {
        // like llama.cpp's iSWA cache: the positions every layer can still attend from
        const llama_pos swa_min = kv_swa->seq_pos_min(seq_id);
        if (swa_min >= 0) {
            res = std::max(res, swa_min + s->logical_next - (llama_pos) s->n_used);
        }
    }
    return res;
}

llama_pos llama_locret_memory::seq_pos_max(llama_seq_id seq_id) const {
    const locret_stream * s = get_stream(seq_id);
    if (s == nullptr || s->n_used == 0) {
        return -1;
    }
    return s->logical_next - 1;
}

std::map<ggml_backend_buffer_type_t, size_t> llama_locret_memory::memory_breakdown() const {
    auto res = inner->memory_breakdown();
    if (scores_buf) {
        res[ggml_backend_buffer_get_type(scores_buf.get())] += ggml_backend_buffer_get_size(scores_buf.get());
    }
    if (queries_buf) {
        res[ggml_backend_buffer_get_type(queries_buf.get())] += ggml_backend_buffer_get_size(queries_buf.get());
    }
    return res;
}

//
// state save/load: the bookkeeping follows llama.cpp's own cells and K/V data
//

// Variable-length parts of the state (a schedule, a sequence's rows) may be empty; an empty std::vector's data()
// may be null, and llama.cpp's buffer readers and writers memcpy it, which is undefined for a null pointer even
// at size 0 (UBSan reports it). These skip empty spans.
static void locret_write_span(llama_io_write_i & io, const void * src, size_t size) {
    if (size > 0) {
        io.write(src, size);
    }
}

static void locret_read_span(llama_io_read_i & io, void * dst, size_t size) {
    if (size > 0) {
        io.read(dst, size);
    }
}

static const uint32_t LOCRET_STATE_MAGIC   = 0x5443524c; // "LRCT"
// 6: the budget schedule after the header (its count of layers, 0 for none, then their budgets), and per sequence the
// cells each layer masks (dead_end, then live_end per layer) after its fields; 5: SAGE-KV's pending selection per
// sequence, and its captured query after the layers' units; 4: LagKV's scored_to per sequence; 3: a sequence's pinned
// query (Locret-Q). 5, 4, 3 and 2 (read as unpinned) load too, into a context without a schedule.
static const uint32_t LOCRET_STATE_VERSION = 6;

// what a saved state must agree on with the context that loads it
struct locret_state_header {
    uint32_t magic;
    uint32_t version;
    uint32_t n_layers;   // evicting layers
    uint32_t n_cells;    // cells per sequence
    uint32_t budget;
    uint32_t policy;
    uint32_t n_streams;  // streams that follow
    uint32_t window;     // the policy's window: score pooling (heads; 0: none) or the partition (lagkv); a zero
                         // "reserved" field before pooling existed
    uint64_t heads_fingerprint;
};

void llama_locret_memory::state_write(llama_io_write_i & io, llama_seq_id seq_id, llama_state_seq_flags flags) const {
    if (flags & LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) {
        throw std::runtime_error("Locret: a partial (window-only) state cannot be saved from an evicting cache");
    }
    inner->state_write(io, seq_id, flags);

    std::vector<uint32_t> ids;
    for (size_t s = 0; s < streams.size(); ++s) {
        if (seq_id < 0 || (size_t) seq_id == s) {
            ids.push_back((uint32_t) s);
        }
    }
    locret_state_header h = {};
    h.magic             = LOCRET_STATE_MAGIC;
    h.version           = LOCRET_STATE_VERSION;
    h.n_layers          = (uint32_t) layers.size();
    h.n_cells           = cfg.n_cells;
    h.budget            = cfg.budget;
    h.policy            = (uint32_t) cfg.policy;
    h.n_streams         = (uint32_t) ids.size();
    h.window            = cfg.lag > 0 ? cfg.lag : cfg.pool;
    h.heads_fingerprint = policy->uses_heads() ? llama_locret_heads_fingerprint(cfg.heads) : 0;
    io.write(&h, sizeof(h));
    const uint32_t n_sched = (uint32_t) cfg.layer_budget.size();
    io.write(&n_sched, sizeof(n_sched));
    locret_write_span(io, cfg.layer_budget.data(), sizeof(uint32_t) * n_sched);
    for (uint32_t id : ids) {
        const locret_stream & s = streams[id];
        const uint32_t fields[] = { id, s.n_used, s.uniform_from, (uint32_t) s.prev_output, s.n_pinned,
                                    s.policy_state.word[0], s.policy_state.word[1] };
        const int64_t  next     = s.logical_next;
        const uint64_t stats[]  = { s.n_evictions, s.n_units_evicted };
        io.write(fields, sizeof(fields));
        io.write(&next, sizeof(next));
        io.write(stats, sizeof(stats));
        io.write(&s.dead_end, sizeof(s.dead_end));
        locret_write_span(io, s.live_end.data(), sizeof(uint32_t) * s.live_end.size());
        std::vector<float> block; // layer i's scores [n_used][n_head_kv], or zeros for a policy without heads
        std::vector<float> row(s.n_used);
        for (size_t i = 0; i < layers.size(); ++i) {
            const uint32_t n_head_kv = layers[i].n_head_kv;
            block.assign((size_t) s.n_used * n_head_kv, 0.0f);
            if (!scores_of_layer.empty()) {
                scores_get(i, id, s.n_used, block.data());
            }
            for (uint32_t hd = 0; hd < n_head_kv; ++hd) {
                for (uint32_t c = 0; c < s.n_used; ++c) {
                    row[c] = block[(size_t) c * n_head_kv + hd];
                }
                locret_write_span(io, s.pos[i].data() + (size_t) hd * cfg.n_cells, sizeof(int32_t) * s.n_used);
                locret_write_span(io, row.data(), sizeof(float) * s.n_used);
            }
        }
        // the queries the policy's next selection reads
        std::vector<uint8_t> qrow;
        for (ggml_tensor * q : queries_of_layer) {
            qrow.resize(query_block_bytes(q));
            ggml_backend_tensor_get(q, qrow.data(), (size_t) id * qrow.size(), qrow.size());
            locret_write_span(io, qrow.data(), qrow.size());
        }
    }
}

void llama_locret_memory::state_read(llama_io_read_i & io, llama_seq_id seq_id, llama_state_seq_flags flags) {
    if (flags & LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) {
        throw std::runtime_error("Locret: a partial (window-only) state cannot be loaded into an evicting cache");
    }
    if (seq_id >= 0 && (size_t) seq_id >= streams.size()) {
        throw std::runtime_error(format("Locret: no sequence %d to load a state into", seq_id));
    }
    // the sequences being replaced start empty (the inner cache then restores its cells from cell 0 on)
    auto empty_target = [&]() {
        if (seq_id < 0) {
            inner->clear(true);
            for (auto & s : streams) {
                reset_stream(s);
            }
        } else {
            inner->seq_rm(seq_id, -1, -1);
            reset_stream(streams[seq_id]);
        }
    };
    empty_target();
    try {
        inner->state_read(io, seq_id, flags);
        if (take_fault(LOCRET_FAULT_STATE_READ)) {
            throw std::runtime_error("Locret: state load failed after the KV cells were restored (injected)");
        }
        locret_state_header h;
        try {
            io.read(&h, sizeof(h));
        } catch (const std::exception &) {
            // a state saved by a cache without eviction ends with the cells
            throw std::runtime_error("Locret: the saved state ends before its Locret section (saved without eviction, or truncated)");
        }
        if (h.magic != LOCRET_STATE_MAGIC) {
            throw std::runtime_error("Locret: the saved state has no Locret section (saved without eviction?)");
        }
        if (h.version < 2 || h.version > LOCRET_STATE_VERSION) {
            throw std::runtime_error(format("Locret: the saved state has version %u, this build reads %u", h.version, LOCRET_STATE_VERSION));
        }
        const uint64_t fp = policy->uses_heads() ? llama_locret_heads_fingerprint(cfg.heads) : 0;
        if (h.n_layers != layers.size() || h.n_cells != cfg.n_cells || h.budget != cfg.budget) {
            throw std::runtime_error(format("Locret: the saved state was made with another model or budget "
                    "(%u layers, %u cells, budget %u; this context: %zu, %u, %u)", h.n_layers, h.n_cells, h.budget,
                    layers.size(), cfg.n_cells, cfg.budget));
        }
        if (h.policy != (uint32_t) cfg.policy || h.heads_fingerprint != fp) {
            throw std::runtime_error("Locret: the saved state was scored by another policy or other retaining heads");
        }
        if (cfg.lag > 0 && h.window != cfg.lag) {
            // the saved scores rank partitions of another size than the ones this context would score next
            throw std::runtime_error(format("Locret: the saved state was scored by LagKV with partitions of %u units, this "
                    "context's are %u (--locret-lag)", h.window, cfg.lag));
        }
        if (cfg.lag == 0 && h.window != cfg.pool) {
            // the saved units' scores are on another scale than the ones this context would compute next
            throw std::runtime_error(format("Locret: the saved state's scores were pooled over %u tokens, this context's "
                    "over %u (--locret-pool)", h.window, cfg.pool));
        }
        std::vector<uint32_t> sched;
        if (h.version >= 6) {
            uint32_t n_sched = 0;
            io.read(&n_sched, sizeof(n_sched));
            if (n_sched != 0 && n_sched != layers.size()) {
                throw std::runtime_error("Locret: the saved state is corrupt (bad budget schedule)");
            }
            sched.resize(n_sched);
            locret_read_span(io, sched.data(), sizeof(uint32_t) * n_sched);
        }
        if (sched != cfg.layer_budget) {
            throw std::runtime_error(format("Locret: the saved state was made with %s budget schedule than this context's "
                    "(--locret-budget-schedule)", sched.empty() || cfg.layer_budget.empty() ? "a different" : "another"));
        }
        const uint32_t n_expected = seq_id < 0 ? (uint32_t) streams.size() : 1;
        if (h.n_streams != n_expected) {
            throw std::runtime_error(format("Locret: the saved state holds %u sequences, expected %u", h.n_streams, n_expected));
        }
        for (uint32_t k = 0; k < h.n_streams; ++k) {
            uint32_t fields[7] = {};
            int64_t  next;
            uint64_t stats[2];
            io.read(fields, sizeof(uint32_t) * (h.version == 2 ? 4 : h.version == 3 ? 5 : h.version == 4 ? 6 : 7));
            io.read(&next, sizeof(next));
            io.read(stats, sizeof(stats));
            uint32_t dead_end = 0;
            std::vector<uint32_t> live_end(layers.size(), 0);
            if (h.version >= 6) {
                io.read(&dead_end, sizeof(dead_end));
                locret_read_span(io, live_end.data(), sizeof(uint32_t) * live_end.size());
            } else {
                // before schedules: every layer reads every cell
                std::fill(live_end.begin(), live_end.end(), dead_end);
            }
            const uint32_t id = seq_id < 0 ? fields[0] : (uint32_t) seq_id;
            bool masks_ok = dead_end <= fields[1];
            for (size_t i = 0; i < layers.size(); ++i) {
                masks_ok = masks_ok && live_end[i] <= dead_end && (dead_end == live_end[i] || !cfg.layer_budget.empty());
            }
            if (!masks_ok) {
                throw std::runtime_error("Locret: the saved state is corrupt (bad masked cells)");
            }
            if (id >= streams.size() || fields[1] > cfg.n_cells || fields[2] > fields[1] || next < fields[1] ||
                    next > std::numeric_limits<llama_pos>::max() ||
                    (fields[4] > 0 && (uint64_t) fields[4] + cfg.stabilizers +
                        policy->unscored_units(cfg) >= min_layer_budget()) ||
                    !policy->state_ok(cfg, locret_policy_state { { fields[5], fields[6] } }, fields[1])) {
                throw std::runtime_error("Locret: the saved state is corrupt (bad sequence header)");
            }
            locret_stream & s = streams[id];
            s.n_used          = fields[1];
            s.uniform_from    = fields[2];
            s.prev_output     = fields[3] != 0;
            s.logical_next    = (llama_pos) next;
            s.n_pinned        = fields[4];
            // the policy's words (versions before LagKV and SAGE-KV: zeros, which the policies they had never read)
            s.policy_state    = locret_policy_state { { fields[5], fields[6] } };
            s.n_evictions     = stats[0];
            s.n_units_evicted = stats[1];
            s.dead_end        = dead_end;
            s.live_end        = live_end;
            std::vector<float> block;
            std::vector<float> row(s.n_used);
            for (size_t i = 0; i < layers.size(); ++i) {
                const uint32_t n_head_kv = layers[i].n_head_kv;
                block.assign((size_t) s.n_used * n_head_kv, 0.0f);
                for (uint32_t hd = 0; hd < n_head_kv; ++hd) {
                    int32_t * pos = s.pos[i].data() + (size_t) hd * cfg.n_cells;
                    locret_read_span(io, pos, sizeof(int32_t) * s.n_used);
                    locret_read_span(io, row.data(), sizeof(float) * s.n_used);
                    int32_t prev = -1;
                    for (uint32_t c = 0; c < s.n_used; ++c) {
                        if (c >= live_end[i] && c < dead_end) {
                            if (pos[c] != -1) {
                                throw std::runtime_error("Locret: the saved state is corrupt (a masked cell holds a unit)");
                            }
                            continue; // masked in this layer: no unit
                        }
                        if (pos[c] < 0 || pos[c] >= s.logical_next || pos[c] <= prev) {
                            throw std::runtime_error("Locret: the saved state is corrupt (positions out of order)");
                        }
                        prev = pos[c];
                        // pinned units are never evicted: every head holds the same ones, in the first cells
                        const int32_t pos0 = s.pos[0][c]; // layer 0, KV head 0 (read first)
                        if ((pos[c] < (int32_t) s.n_pinned || (pos0 >= 0 && pos0 < (int32_t) s.n_pinned)) && pos[c] != pos0) {
                            throw std::runtime_error("Locret: the saved state is corrupt (pinned units differ between heads)");
                        }
                        block[(size_t) c * n_head_kv + hd] = row[c];
                    }
                }
                if (!scores_of_layer.empty()) {
                    scores_set(i, id, s.n_used, block.data());
                }
            }
            if (!queries_of_layer.empty() && h.version < 5) {
                throw std::runtime_error("Locret: the saved state has no captured queries (saved by an older build)");
            }
            std::vector<uint8_t> qrow;
            for (ggml_tensor * q : queries_of_layer) {
                qrow.resize(query_block_bytes(q));
                locret_read_span(io, qrow.data(), qrow.size());
                ggml_backend_tensor_set(q, qrow.data(), (size_t) id * qrow.size(), qrow.size());
            }
            // llama.cpp restored the cells from 0: they must be exactly the used ones
            const llama_kv_cells & cells = kv->get_cells((llama_seq_id) id);
            if (cells.get_used() != s.n_used || (s.n_used > 0 && cells.used_max_p1() != s.n_used)) {
                throw std::runtime_error("Locret: the restored cells do not match the saved Locret state");
            }
        }
    } catch (...) {
        // a failed load leaves the sequences it was loading empty and consistent
        empty_target();
        throw;
    }
}
