// The Locret memory type (see locret-memory.h): its memory contexts, construction and stores, ubatch planning and
// placement, and the memory interface in logical positions. Eviction is in locret-evictor.cpp, state files in
// locret-state.cpp.

#include "locret-memory.h"
#include "locret-hooks.h"
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
    // layer groups 1..: each group's own context, for the ubatch last applied (a full-cache view for graph
    // reservation); group 0 is the context itself
    std::vector<std::unique_ptr<llama_kv_cache_context>> groups;
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
        if (this->plans.empty()) {
            for (size_t g = 1; g < mem->groups().size(); ++g) {
                this->groups.push_back(std::make_unique<llama_kv_cache_context>(mem->groups().cache(g)));
            }
        }
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
            mem->placed(plans[i_plan], Base::get_ubatch(), groups);
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

locret_evict_parts llama_locret_memory::evict_parts() {
    return { cfg, policy, layers, streams, scores, queries, grp, kv, kv_swa, v_trans, select_graph, faults,
             [this](llama_seq_id s) { seq_rm(s, -1, -1); } };
}

llama_locret_memory::llama_locret_memory(const llama_model & model, const llama_cparams & cparams,
        const locret_config & cfg_in, llama_memory_ptr inner_in)
    : model(model), cfg(cfg_in), policy(locret_policy_make(cfg_in.policy)), inner(std::move(inner_in)), ev(evict_parts()) {
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
    grp.init(kv, {});
    setup(cparams);
    if (kv_swa != nullptr) {
        // its saves keep every cell it holds, so that a restored sequence continues as it would have (locret-hooks.h)
        keep_masked.keep(kv_swa);
    }
}

llama_locret_memory::llama_locret_memory(const llama_model & model, const llama_cparams & cparams,
        const locret_config & cfg_in, std::vector<std::unique_ptr<llama_kv_cache>> groups)
    : model(model), cfg(cfg_in), policy(locret_policy_make(cfg_in.policy)), ev(evict_parts()) {
    GGML_ASSERT(!groups.empty());
    kv = groups[0].get();
    inner.reset(groups[0].release());
    groups.erase(groups.begin());
    grp.init(kv, std::move(groups));
    setup(cparams);
}

// each layer's re-rotation factors (locret_rerotation::factors) in one buffer per buffer type of the layers' keys,
// resident where the keys are
static void locret_make_rope_factors(std::vector<locret_kv_layer> & layers, std::vector<ggml_context_ptr> & ctxs,
        std::vector<ggml_backend_buffer_ptr> & bufs) {
    // one buffer per buffer type of the layers' keys (layers may sit on different devices)
    std::map<ggml_backend_buffer_type_t, std::vector<size_t>> by_buft;
    for (size_t i = 0; i < layers.size(); ++i) {
        if (!layers[i].rot.freq_factors.empty()) {
            by_buft[ggml_backend_buffer_get_type(layers[i].k->buffer)].push_back(i);
        }
    }
    for (const auto & [buft, idx] : by_buft) {
        ggml_init_params ip = { ggml_tensor_overhead() * idx.size(), nullptr, /*.no_alloc =*/ true };
        ggml_context_ptr ctx(ggml_init(ip));
        for (size_t i : idx) {
            locret_rerotation & r = layers[i].rot;
            r.factors = ggml_new_tensor_1d(ctx.get(), GGML_TYPE_F32, (int64_t) r.freq_factors.size());
            ggml_format_name(r.factors, "locret_rope_factors-%u", layers[i].il);
        }
        ggml_backend_buffer_ptr buf(ggml_backend_alloc_ctx_tensors_from_buft(ctx.get(), buft));
        if (!buf) {
            throw std::runtime_error("failed to allocate the Locret re-rotation factors");
        }
        for (size_t i : idx) {
            const locret_rerotation & r = layers[i].rot;
            ggml_backend_tensor_set(r.factors, r.freq_factors.data(), 0, ggml_nbytes(r.factors));
        }
        ctxs.push_back(std::move(ctx));
        bufs.push_back(std::move(buf));
    }
}

void llama_locret_memory::setup_layers(const llama_cparams & cparams, uint32_t n_seq) {
    const auto & hp = model.hparams;
    // every group's layers, in model order
    std::vector<std::pair<uint32_t, uint32_t>> il_group;
    for (size_t g = 0; g < grp.size(); ++g) {
        const llama_kv_cache * c = grp.cache(g);
        if (c->get_n_stream() != n_seq || c->get_v_trans() != v_trans) {
            throw std::runtime_error("the Locret layer groups' caches differ in streams or V layout");
        }
        for (uint32_t il : c->get_layer_ids()) {
            il_group.emplace_back(il, (uint32_t) g);
        }
    }
    std::sort(il_group.begin(), il_group.end());
    std::vector<std::vector<size_t>> group_layers(grp.size());
    layer_of_il.assign(hp.n_layer(), -1);
    for (const auto & [il, g] : il_group) {
        const llama_kv_cache * c = grp.cache(g);
        locret_kv_layer L;
        L.il        = il;
        L.n_head_kv = hp.n_head_kv(il);
        L.d_k       = hp.n_embd_head_k(il);
        L.d_v       = hp.n_embd_head_v(il);
        L.k         = c->get_k_storage(il);
        L.v         = c->get_v_storage(il);
        L.group     = g;
        L.kv_size   = c->get_size();
        if (L.k == nullptr || L.v == nullptr || (uint64_t) L.v->ne[0] != (uint64_t) L.d_v * L.n_head_kv ||
                (uint64_t) L.k->ne[0] != (uint64_t) L.d_k * L.n_head_kv) {
            throw std::runtime_error(format("layer %u's K/V cache layout is not supported by Locret eviction", il));
        }
        L.rot = locret_rerotation_make(model, cparams, il);
        if (il < layer_of_il.size()) {
            layer_of_il[il] = (int32_t) layers.size();
        }
        group_layers[g].push_back(layers.size());
        layers.push_back(std::move(L));
    }
    grp.set_layers(std::move(group_layers));
}

void llama_locret_memory::log_setup(const char * func, const llama_cparams & cparams, uint32_t n_seq) const {
    const std::string pooling = (cfg.pool > 0 ? format(", score pooling %u", cfg.pool) : std::string()) +
                                (cfg.pool_from > 0 ? format(" for prompts of %u budgets or more", cfg.pool_from) :
                                 std::string()) +
                                policy->describe(cfg);
    std::string budget = format("budget %u", cfg.budget);
    if (!cfg.layer_budget.empty()) {
        budget = format("budget %u per layer on average, scheduled from %u (layer %u) to %u (layer %u) units (%s)",
                cfg.budget_mean, cfg.layer_budget.front(), layers.front().il, cfg.layer_budget.back(), layers.back().il,
                grp.size() > 1 ? format("a cache per budget, %zu caches", grp.size()).c_str() :
                "the cache is sized for the largest");
    }
    const std::string positions = cfg.keep_positions ?
        format(", positions kept (compacted at %u)", cfg.position_limit) :
        std::string(cfg.rotate_in_place ? ", positions compacted in place" : ", positions compacted");
    LLAMA_LOG_INFO("%s: Locret eviction: policy %s%s, %s, stabilizers %u, local %u%s, chunk (ubatch) %u -> %u KV "
            "cells per sequence, %u sequence(s) (logical context %u)%s%s\n", func, llama_locret_policy_name(cfg.policy),
            scores.empty() ? "" : select_graph ? " (selection on the device)" : " (selection on the host)",
            budget.c_str(), cfg.stabilizers, cfg.local, pooling.c_str(), cfg.n_ubatch, cfg.n_cells, n_seq, cparams.n_ctx,
            kv_swa ? ", window layers in their own cache" : "", positions.c_str());
    if (!cfg.layer_budget.empty()) {
        std::string list;
        for (size_t i = 0; i < layers.size(); ++i) {
            list += format("%s%u:%u", i ? " " : "", layers[i].il, cfg.layer_budget[i]);
        }
        LLAMA_LOG_INFO("%s: Locret budget schedule (layer:units): %s\n", func, list.c_str());
        for (size_t g = 0; g < grp.size() && grp.size() > 1; ++g) {
            std::string il_list;
            for (size_t i : grp.layers_of(g)) {
                il_list += format("%s%u", il_list.empty() ? "" : " ", layers[i].il);
            }
            LLAMA_LOG_INFO("%s: Locret layer group %zu: %u cells per sequence, layers %s\n", func, g,
                    grp.cache(g)->get_size(), il_list.c_str());
        }
    }
}

void llama_locret_memory::setup(const llama_cparams & cparams) {
    const uint32_t n_seq = std::max(1u, cparams.n_seq_max);
    if (kv->get_n_stream() != n_seq || kv->get_size() < cfg.capacity) {
        throw std::runtime_error(format("the KV cache has %u cells in %u streams, expected at least %u cells in %u",
                kv->get_size(), kv->get_n_stream(), cfg.capacity, n_seq));
    }
    cfg.n_cells = kv->get_size();
    v_trans     = kv->get_v_trans();

    setup_layers(cparams, n_seq);

    locret_make_rope_factors(layers, rope_factors_ctx, rope_factors_buf);

    if (!cfg.layer_budget.empty() && cfg.layer_budget.size() != layers.size()) {
        throw std::runtime_error(format("the budget schedule was resolved for %zu layers, but the cache evicts %zu",
                cfg.layer_budget.size(), layers.size()));
    }

    std::vector<uint32_t> heads(layers.size());
    for (size_t i = 0; i < layers.size(); ++i) {
        heads[i] = layers[i].n_head_kv;
    }
    streams.resize(n_seq);
    for (auto & s : streams) {
        s.init(heads, cfg.n_cells, cfg.holes_filled());
    }
    std::vector<locret_store_layer> shapes(layers.size());
    for (size_t i = 0; i < layers.size(); ++i) {
        shapes[i] = { layers[i].il, layers[i].n_head_kv, (int64_t) layers[i].d_k * model.hparams.n_head(layers[i].il) };
    }
    // beside the keys: the graph writes the scores where it writes the keys and selects there, and compares the
    // queries with the keys
    ggml_backend_buffer_type_t buft = ggml_backend_buffer_get_type(layers[0].k->buffer);
    if (policy->stores_scores()) {
        scores.make(shapes, cfg.n_cells, n_seq, buft);
        for (size_t i = 0; i < layers.size(); ++i) {
            layers[i].score = scores.layer(i);
        }
        select_graph = scores.all() != nullptr && !ggml_backend_buffer_is_host(scores.buffer());
        if (const char * e = getenv("LOCRET_DEBUG_SELECT")) {
            select_graph = scores.all() != nullptr && strcmp(e, "graph") == 0 ? true : strcmp(e, "host") == 0 ? false : select_graph;
        }
    }
    const uint32_t n_rows = policy->query_rows(cfg);
    GGML_ASSERT(policy->query_pin_rows(cfg) <= n_rows);
    if (n_rows > 0) {
        queries.make(shapes, n_rows, policy->query_pin_rows(cfg), n_seq, buft);
    }

    log_setup(__func__, cparams, n_seq);
}

int32_t llama_locret_memory::layer_index(uint32_t il) const {
    return il < layer_of_il.size() ? layer_of_il[il] : -1;
}

const locret_cells * llama_locret_memory::get_stream(llama_seq_id seq_id) const {
    return seq_id >= 0 && (size_t) seq_id < streams.size() ? &streams[seq_id] : nullptr;
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

// the settings ubatch planning reads (locret-plan.h: the rules, as pure functions)
static locret_plan_params locret_plan_params_of(const locret_config & cfg, const locret_policy & policy) {
    locret_plan_params p;
    p.budget       = cfg.budget;
    p.stabilizers  = cfg.stabilizers;
    p.local        = cfg.local;
    p.n_ubatch     = cfg.n_ubatch;
    p.capacity     = cfg.capacity;
    p.n_cells      = cfg.n_cells;
    p.selects_once = policy.reads_prompt_whole();
    p.keep_positions = cfg.keep_positions;
    p.position_limit = cfg.position_limit;
    return p;
}

// what planning needs of stream s, as it stands
static locret_plan_stream locret_plan_stream_of(const locret_cells & s, const locret_config & cfg,
        const locret_policy & policy) {
    locret_plan_stream p;
    p.n_used      = s.n_used;
    p.prev_output = s.prev_output;
    p.rope_next   = s.rope_next;
    p.offset      = s.logical_next - (llama_pos) s.rope_next;
    p.selection_due  = policy.selection_due(s.policy_state);
    // a budget schedule: the layer nearest its own budget decides when the stream evicts (locret_plan_stream::lead)
    int64_t lead = 0;
    for (size_t i = 0; i < cfg.layer_budget.size(); ++i) {
        const int64_t masked = (int64_t) s.dead_end - s.live_end[i];
        lead = std::max(lead, (int64_t) cfg.budget - cfg.layer_budget[i] - masked);
    }
    p.lead        = (uint32_t) lead;
    return p;
}

uint32_t locret_generation_room(const llama_locret_memory & mem, llama_seq_id seq_id) {
    const locret_cells * s = mem.get_stream(seq_id);
    if (s == nullptr) {
        return 0;
    }
    const locret_config & cfg = mem.config();
    return locret_plan_room(locret_plan_params_of(cfg, mem.get_policy()), locret_plan_stream_of(*s, cfg, mem.get_policy()));
}

// init_batch(), in steps: the batch's ubatches into `ubatches`, split by the planning rules for the batch's sequences
// (seqs) and the streams as they stand (sim); fewer tokens than the batch's when a split fails
static void locret_split_batch(llama_batch_allocr & balloc, uint32_t n_ubatch, const locret_plan_params & params,
        const locret_batch_seqs & seqs, const std::vector<locret_plan_stream> & sim,
        std::vector<llama_ubatch> & ubatches) {
    const llama_batch & batch = balloc.get_batch();
    const uint32_t n_tokens = balloc.get_n_tokens();

    // the ubatches: a sequence's tokens in parts of at most n_ubatch, the local tail of a prompt end in a part of its
    // own when anything may be evicted before it; with several sequences each part holds one sequence, except that
    // one token per sequence (generation) goes in one ubatch
    balloc.split_reset();
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
            const bool tail_alone = seqs.ends_with_output[s] && locret_plan_tail_alone(params, sim[s], seqs.count[s]);
            const uint32_t take = locret_plan_take(n_ubatch, params.local, remaining[s], tail_alone);
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
}

// the inner cache's slot for a ubatch's plan: each part's stream and cells, streams [s0, s1] (consecutive: checked by
// the plan)
static llama_kv_cache::slot_info locret_plan_slot(const locret_ubatch_plan & plan) {
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
    return sinfo;
}

// the plan of every ubatch, advancing sim through the batch's evictions and placements: per ubatch the inner cache's
// slot, the plan, the graph's copy at physical positions, and (an iSWA pair: with_window) a copy at the window cache's
// positions; the planning's error at the first ubatch that cannot be planned
static locret_plan_error locret_plan_batch(const locret_plan_params & params, bool with_window,
        const std::vector<llama_ubatch> & ubatches, std::vector<locret_plan_stream> & sim,
        llama_kv_cache::slot_info_vec_t & sinfos, std::vector<locret_ubatch_plan> & plans,
        std::vector<llama_ubatch> & physical, std::vector<llama_ubatch> & window_frame) {
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
            return err;
        }

        llama_kv_cache::slot_info sinfo = locret_plan_slot(plan);

        // the graph's copy of the ubatch: a token's physical position is the one RoPE rotates it at (its cell with
        // compact positions)
        std::vector<llama_pos> pos_phys(ubatch.n_tokens);
        for (uint32_t i = 0; i < ubatch.n_tokens; ++i) {
            pos_phys[i] = (llama_pos) plan.rope[i];
        }
        sinfos.push_back(std::move(sinfo));
        physical.push_back(locret_ubatch_with_pos(ubatch, pos_phys));
        if (with_window) {
            window_frame.push_back(locret_ubatch_with_pos(ubatch, pos_frame));
        }
        plans.push_back(std::move(plan));
    }
    return {};
}

llama_memory_context_ptr llama_locret_memory::init_batch(llama_batch_allocr & balloc, uint32_t n_ubatch, bool embd_all) {
    GGML_UNUSED(embd_all);
    auto failed = [] { return std::make_unique<llama_kv_cache_context>(LLAMA_MEMORY_STATUS_FAILED_PREPARE); };

    const llama_batch & batch = balloc.get_batch();
    const uint32_t n_tokens = balloc.get_n_tokens();

    const locret_plan_params params = locret_plan_params_of(cfg, *policy);

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

    // the streams as they stand; the planning below advances these copies through the batch's evictions
    std::vector<locret_plan_stream> sim(streams.size());
    for (size_t s = 0; s < streams.size(); ++s) {
        sim[s] = locret_plan_stream_of(streams[s], cfg, *policy);
    }

    std::vector<llama_ubatch> ubatches;
    locret_split_batch(balloc, n_ubatch, params, seqs, sim, ubatches);
    if (balloc.get_n_used() < n_tokens) {
        LLAMA_LOG_ERROR("%s: Locret: failed to split a batch of %u tokens\n", __func__, n_tokens);
        return failed();
    }

    // simulate the evictions and placements, per stream
    llama_kv_cache::slot_info_vec_t sinfos;
    std::vector<locret_ubatch_plan> plans;
    std::vector<llama_ubatch> physical;
    std::vector<llama_ubatch> window_frame; // positions in the window cache's frame at the start of the batch
    {
        const locret_plan_error err = locret_plan_batch(params, kv_swa != nullptr, ubatches, sim, sinfos, plans, physical,
                window_frame);
        if (!err.ok()) {
            if (err.status == LOCRET_PLAN_PROMPT_TOO_LONG) {
                // the user's to fix: the reason goes to llama_locret_last_error
                locret_set_error(format("policy %s: %s", locret_policy_find(cfg.policy)->name, err.msg.c_str()));
            }
            LLAMA_LOG_ERROR("%s: Locret: %s\n", __func__, err.msg.c_str());
            return failed();
        }
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

namespace {

// the updates (stream copies) of every layer group's cache, applied together
class locret_update_context : public llama_memory_context_i {
public:
    explicit locret_update_context(std::vector<llama_memory_context_ptr> parts) : parts(std::move(parts)) {
        status = LLAMA_MEMORY_STATUS_NO_UPDATE;
        for (const auto & p : this->parts) {
            status = llama_memory_status_combine(status, p->get_status());
        }
    }
    bool next() override { return false; }
    bool apply() override {
        bool ok = true;
        for (auto & p : parts) {
            if (p->get_status() == LLAMA_MEMORY_STATUS_SUCCESS) {
                ok = p->apply() && ok;
            }
        }
        return ok;
    }
    llama_memory_status get_status() const override { return status; }
    const llama_ubatch & get_ubatch() const override { return parts[0]->get_ubatch(); }

private:
    std::vector<llama_memory_context_ptr> parts;
    llama_memory_status status;
};

} // namespace

llama_memory_context_ptr llama_locret_memory::init_update(llama_context * lctx, bool optimize) {
    if (grp.size() == 1) {
        return inner->init_update(lctx, optimize);
    }
    std::vector<llama_memory_context_ptr> parts;
    for (size_t g = 0; g < grp.size(); ++g) {
        parts.push_back(grp.cache(g)->init_update(lctx, optimize));
    }
    return std::make_unique<locret_update_context>(std::move(parts));
}

const llama_kv_cache_context * locret_group_context(const llama_memory_context_i * mctx, size_t g) {
    const auto * b = dynamic_cast<const locret_batch *>(mctx);
    if (b == nullptr) {
        return nullptr;
    }
    if (g == 0) {
        return dynamic_cast<const llama_kv_cache_context *>(mctx);
    }
    return g - 1 < b->groups.size() ? b->groups[g - 1].get() : nullptr;
}

//
// placement and scores
//

void llama_locret_memory::placed(const locret_ubatch_plan & plan, const llama_ubatch & ubatch,
        std::vector<std::unique_ptr<llama_kv_cache_context>> & group_contexts) {
    // the layer groups' caches place the ubatch in their own cells (after the eviction before it)
    grp.place(plan, ubatch, streams, group_contexts);
    for (const auto & st : plan.steps) {
        locret_cells & s = streams[st.strm];
        // the ubatch split planned this part after the same evictions that ran before it
        GGML_ASSERT(st.first_cell == s.n_used && "Locret: ubatch placement does not follow the eviction plan");
        const bool prompt_end = locret_plan_prompt_end(s.prev_output, st.n_tokens, st.output);
        s.place_part(st.first_cell, st.first_rope, st.n_tokens, st.output, st.first_logical);
        policy->placed(cfg, s.policy_state, s.n_used, st.n_tokens, s.n_pinned, prompt_end);
    }
    for (size_t t = 0; t < plan.cell.size(); ++t) {
        streams[plan.strm[t]].set_unit(plan.cell[t], plan.logical[t], plan.rope[t]);
    }
    for (const auto & st : plan.steps) {
        locret_cells_assert(streams[st.strm]);
    }
}

//
// the memory interface in logical positions
//

int32_t llama_locret_memory::tell_prompt(llama_seq_id seq_id, uint32_t n_tokens) {
    if (seq_id < 0 || (size_t) seq_id >= streams.size()) {
        locret_set_error(format("Locret: no sequence %d to tell a prompt of (%zu sequences)", seq_id, streams.size()));
        return -1;
    }
    locret_cells & s = streams[seq_id];
    if (cfg.pool_from > 0 && s.n_used == 0 && s.logical_next == 0) {
        // the budget as asked for (a schedule's mean): the rule is in prompts per budget, as the heads were measured
        s.long_prompt = (uint64_t) n_tokens >= (uint64_t) cfg.pool_from * cfg.budget_mean;
        LLAMA_LOG_INFO("%s: Locret: sequence %d: a prompt of %u tokens, %s %u budgets: score pooling %s\n", __func__,
                seq_id, n_tokens, s.long_prompt ? "at least" : "under", cfg.pool_from, s.long_prompt ? "on" : "off");
    }
    return locret_pool_of(*this, seq_id) > 1 ? 1 : 0;
}

uint32_t locret_pool_of(const llama_locret_memory & mem, llama_seq_id seq_id) {
    const locret_config & cfg = mem.config();
    if (cfg.pool <= 1) {
        return 0;
    }
    const locret_cells * s = mem.get_stream(seq_id);
    return cfg.pool_from == 0 || (s != nullptr && s->long_prompt) ? cfg.pool : 0;
}

bool llama_locret_memory::pin_prefix(llama_seq_id seq_id, uint32_t n_tokens) {
    if (seq_id < 0 || (size_t) seq_id >= streams.size()) {
        locret_set_error(format("Locret: no sequence %d to pin a query in (%zu sequences)", seq_id, streams.size()));
        return false;
    }
    locret_cells & s = streams[seq_id];
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
    // policy keeps unscored)
    const uint64_t unscored = policy->unscored_units(cfg);
    if ((uint64_t) n_tokens + cfg.stabilizers + unscored >= cfg.min_layer_budget()) {
        locret_set_error(format("Locret: a pinned query of %u tokens leaves no room in the budget (%u units per head%s, "
                "%u stabilizers%s): shorten the query or raise the budget", n_tokens, cfg.min_layer_budget(),
                cfg.has_schedule() ? " in the smallest layer budget of the schedule" : "", cfg.stabilizers,
                unscored > 0 ? (", " + policy->unscored_what(cfg)).c_str() : ""));
        return false;
    }
    s.n_pinned = n_tokens;
    return true;
}

void llama_locret_memory::clear(bool data) {
    each_cache([&](llama_memory_i & m) { m.clear(data); });
    for (auto & s : streams) {
        s.reset();
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
    locret_cells & s = streams[seq_id];
    p0 = std::max(p0, 0);
    if (p1 < 0) {
        p1 = std::numeric_limits<llama_pos>::max();
    }
    if (s.n_used == 0 || p0 >= p1 || p0 >= s.logical_next) {
        return true;
    }
    if (p0 <= seq_pos_min(seq_id) && p1 >= s.logical_next) {
        each_cache([&](llama_memory_i & m) { m.seq_rm(seq_id, -1, -1); });
        s.reset();
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
    const llama_pos offset = s.logical_next - (llama_pos) s.rope_next; // logical - physical of the uniform part
    // the physical position of the first cell removed: its cell (compact), or the position it was placed at
    const llama_pos phys_first = first == s.n_used ? (llama_pos) s.rope_next :
                                 s.rope.empty() ? (llama_pos) first : (llama_pos) s.rope[0][first];
    if (kv_swa != nullptr) {
        // the window layers continue from p0 only if their cache still holds the window before it
        const llama_pos swa_min = kv_swa->seq_pos_min(seq_id);
        if (first > 0 && (swa_min < 0 || swa_min + offset > std::max(0, p0 - (llama_pos) model.hparams.n_swa))) {
            LLAMA_LOG_DEBUG("%s: Locret: the window cache of sequence %d no longer holds the window before %d\n", __func__, seq_id, p0);
            return false;
        }
        kv_swa->seq_rm(seq_id, phys_first, -1);
    }
    grp.free_from((uint32_t) seq_id, phys_first);
    s.truncate(first, (uint32_t) phys_first, p0);
    policy->truncated(cfg, s.policy_state, s.n_used);
    locret_cells_assert(s);
    return true;
}

void llama_locret_memory::seq_cp(llama_seq_id seq_id_src, llama_seq_id seq_id_dst, llama_pos p0, llama_pos p1) {
    if (seq_id_src == seq_id_dst || seq_id_src < 0 || seq_id_dst < 0 ||
            (size_t) seq_id_src >= streams.size() || (size_t) seq_id_dst >= streams.size()) {
        return;
    }
    const locret_cells & src = streams[seq_id_src];
    if (p0 > 0 || (p1 >= 0 && p1 < src.logical_next)) {
        LLAMA_LOG_ERROR("%s: Locret: a compressed sequence can only be copied whole; sequence %d was not copied\n",
                __func__, seq_id_src);
        return;
    }
    // the streams' cells are copied at the next update (llama.cpp's stream copy), the bookkeeping now
    each_cache([&](llama_memory_i & m) { m.seq_cp(seq_id_src, seq_id_dst, -1, -1); });
    streams[seq_id_dst] = src;
    // the last compaction moved the scores and is not waited for by the eviction itself (the host copies below do not
    // queue behind it)
    ev.wait_idle();
    scores.copy((uint32_t) seq_id_src, (uint32_t) seq_id_dst, streams[seq_id_src].n_used);
    for (ggml_tensor * q : queries.tensors()) {
        // the copy's next selection reads the same captured queries
        std::vector<uint8_t> rows(queries.block_bytes(q));
        ggml_backend_tensor_get(q, rows.data(), (size_t) seq_id_src * rows.size(), rows.size());
        ggml_backend_tensor_set(q, rows.data(), (size_t) seq_id_dst * rows.size(), rows.size());
    }
    streams[seq_id_dst].undo.valid = false;
}

void llama_locret_memory::seq_keep(llama_seq_id seq_id) {
    each_cache([&](llama_memory_i & m) { m.seq_keep(seq_id); });
    for (size_t s = 0; s < streams.size(); ++s) {
        if ((llama_seq_id) s != seq_id) {
            streams[s].reset();
        }
    }
}

void llama_locret_memory::seq_add(llama_seq_id seq_id, llama_pos p0, llama_pos p1, llama_pos shift) {
    // logical positions are labels: RoPE uses the physical ones, so a shift only relabels units
    if (seq_id < 0 || (size_t) seq_id >= streams.size() || shift == 0) {
        return;
    }
    locret_cells & s = streams[seq_id];
    p0 = std::max(p0, 0);
    if (p1 < 0) {
        p1 = std::numeric_limits<llama_pos>::max();
    }
    s.relabel(p0, p1, shift);
}

void llama_locret_memory::seq_div(llama_seq_id seq_id, llama_pos p0, llama_pos p1, int d) {
    GGML_UNUSED(seq_id); GGML_UNUSED(p0); GGML_UNUSED(p1); GGML_UNUSED(d);
    LLAMA_LOG_WARN("%s: Locret eviction: seq_div is not supported on a compressed cache; ignored\n", __func__);
}

llama_pos llama_locret_memory::seq_pos_min(llama_seq_id seq_id) const {
    const locret_cells * s = get_stream(seq_id);
    if (s == nullptr || s->n_used == 0) {
        return -1;
    }
    llama_pos res = std::numeric_limits<llama_pos>::max();
    for (size_t i = 0; i < layers.size(); ++i) {
        for (uint32_t h = 0; h < layers[i].n_head_kv; ++h) {
            const int32_t * pos = s->pos[i].data() + (size_t) h * cfg.n_cells;
            if (s->rope.empty()) {
                res = std::min(res, pos[0]); // cells are in position order
                continue;
            }
            for (uint32_t c = 0; c < s->n_used; ++c) { // kept positions fill holes out of order
                if (pos[c] >= 0) {
                    res = std::min(res, pos[c]);
                }
            }
        }
    }
    if (kv_swa != nullptr) {
        // like llama.cpp's iSWA cache: the positions every layer can still attend from
        const llama_pos swa_min = kv_swa->seq_pos_min(seq_id);
        if (swa_min >= 0) {
            res = std::max(res, swa_min + s->logical_next - (llama_pos) s->rope_next);
        }
    }
    return res;
}

llama_pos llama_locret_memory::seq_pos_max(llama_seq_id seq_id) const {
    const locret_cells * s = get_stream(seq_id);
    if (s == nullptr || s->n_used == 0) {
        return -1;
    }
    return s->logical_next - 1;
}

std::map<ggml_backend_buffer_type_t, size_t> llama_locret_memory::memory_breakdown() const {
    auto res = inner->memory_breakdown();
    grp.each_own([&](const llama_kv_cache & c) {
        for (const auto & [buft, size] : c.memory_breakdown()) {
            res[buft] += size;
        }
    });
    if (scores.buffer() != nullptr) {
        res[ggml_backend_buffer_get_type(scores.buffer())] += scores.bytes();
    }
    if (queries.buffer() != nullptr) {
        res[ggml_backend_buffer_get_type(queries.buffer())] += queries.bytes();
    }
    for (const auto & b : rope_factors_buf) {
        res[ggml_backend_buffer_get_type(b.get())] += ggml_backend_buffer_get_size(b.get());
    }
    return res;
}
