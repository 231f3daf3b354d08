// Locret eviction inside llama.cpp's KV cache (Algorithm 1 of the Locret paper, made a property of the cache).
//
// The chunk is the ubatch. Every ubatch's causal importance scores (CIS) are kept on the host beside the cells
// its units went to. Before a ubatch is placed, the cache decides whether an eviction is due:
//   - after a prefill chunk (a ubatch without outputs) when more than b units are held: keep the top-b per
//     (layer, KV head); the last n_s units are kept as stabilizers unless the incoming ubatch is the prompt's
//     tail (the final chunk of Algorithm 1 is evicted without stabilizers);
//   - otherwise (generation, or a new prompt after generation) only when the ubatch would not fit in b + B:
//     every unit is scored like any other and the cache goes back to b.
// A batch whose last token asks for an output is a prompt end: its last n_loc tokens form their own ubatch, so
// they are processed after the compression and are never evicted while the prompt is processed.
//
// The scores are the heads' CIS (policy "heads") or, for the paper's ablations, a function of the unit alone
// (policies "random" and "streaming"), computed when an eviction runs; everything else is the same for all policies.
//
// Retained units keep their order and are compacted to cells 0..n-1 with positions 0..n-1, the same in every
// layer and head; keys are re-rotated by their position change. Clients keep logical positions: the cache
// reports them through seq_pos_min/max and rewrites each ubatch's positions to physical ones when placing it.

#include "locret-hooks.h"
#include "locret-state.h"

#include "llama-batch.h"
#include "llama-context.h"
#include "llama-cparams.h"
#include "llama-graph.h"
#include "llama-impl.h"
#include "llama-io.h"
#include "llama-kv-cache.h"
#include "llama-model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>

//
// settings registered per model, consumed by the contexts created from it
//

static std::mutex                                         g_config_mutex;
static std::map<const llama_model *, llama_locret_params> g_config;

static const llama_locret_policy LOCRET_POLICIES[] = {
    LLAMA_LOCRET_POLICY_HEADS, LLAMA_LOCRET_POLICY_RANDOM, LLAMA_LOCRET_POLICY_STREAMING,
};

const char * llama_locret_policy_name(enum llama_locret_policy policy) {
    switch (policy) {
        case LLAMA_LOCRET_POLICY_HEADS:     return "heads";
        case LLAMA_LOCRET_POLICY_RANDOM:    return "random";
        case LLAMA_LOCRET_POLICY_STREAMING: return "streaming";
    }
    return nullptr; // a value from outside the enum (C callers, ctypes)
}

int32_t llama_locret_policy_from_name(const char * name, enum llama_locret_policy * out) {
    locret_set_error("");
    std::string valid;
    for (llama_locret_policy p : LOCRET_POLICIES) {
        if (name != nullptr && std::strcmp(name, llama_locret_policy_name(p)) == 0) {
            *out = p;
            return 0;
        }
        valid += valid.empty() ? "" : ", ";
        valid += llama_locret_policy_name(p);
    }
    locret_set_error(format("unknown Locret policy '%s'; valid policies: %s", name ? name : "(null)", valid.c_str()));
    return -1;
}

struct llama_locret_params llama_locret_params_default(void) {
    llama_locret_params p;
    p.heads       = nullptr;
    p.budget      = 0;
    p.stabilizers = -1;
    p.local       = -1;
    p.policy      = LLAMA_LOCRET_POLICY_HEADS;
    return p;
}

int32_t llama_locret_model_configure(struct llama_model * model, const struct llama_locret_params * params) {
    locret_set_error("");
    std::lock_guard<std::mutex> lock(g_config_mutex);
    if (params == nullptr || (params->budget == 0 && params->heads == nullptr)) {
        g_config.erase(model);
        return 0;
    }
    std::string err;
    if (llama_locret_policy_name(params->policy) == nullptr) {
        err = format("unknown Locret policy %d", (int) params->policy);
    } else if (params->heads == nullptr && params->policy == LLAMA_LOCRET_POLICY_HEADS) {
        err = "a Locret budget needs retaining heads (--locret-heads, or a model with embedded heads)";
    } else if (params->heads != nullptr && params->heads->model != model) {
        err = format("retaining heads from '%s' were loaded for another model", params->heads->path.c_str());
    } else if (params->budget < 0) {
        err = format("the Locret budget must be at least 1 unit (got %d)", params->budget);
    } else if (params->budget > 0 && params->stabilizers >= 0 && params->stabilizers >= params->budget) {
        err = format("the Locret budget (%d) must be larger than the stabilizers (%d)", params->budget, params->stabilizers);
    }
    if (!err.empty()) {
        locret_set_error(err);
        LLAMA_LOG_ERROR("%s: %s\n", __func__, err.c_str());
        return -1;
    }
    g_config[model] = *params;
    return 0;
}

void llama_locret_model_forget(const llama_model * model) {
    std::lock_guard<std::mutex> lock(g_config_mutex);
    g_config.erase(model);
}

//
// context creation
//

// an explicit setting (>= 0) must fit in one ubatch; a default (-1) is `recommended` (else `paper`) fitted to `cap`.
// Sets err (if still empty) when the explicit value does not fit.
static uint32_t locret_setting(int32_t requested, uint32_t recommended, uint32_t paper, uint32_t cap, uint32_t n_ubatch,
        const char * what, std::string & err) {
    if (requested < 0) {
        return std::min(recommended > 0 ? recommended : paper, cap);
    }
    if ((uint32_t) requested > n_ubatch && err.empty()) {
        err = format("the %s (%d) must fit in one ubatch (-ub %u)", what, requested, n_ubatch);
    }
    return (uint32_t) requested;
}

llama_locret_context * llama_locret_context_create(const llama_model & model, const llama_cparams & cparams,
        uint32_t n_ubatch_requested, uint32_t * kv_cells) {
    *kv_cells = 0;
    llama_locret_params p;
    {
        std::lock_guard<std::mutex> lock(g_config_mutex);
        auto it = g_config.find(&model);
        if (it == g_config.end()) {
            return nullptr;
        }
        p = it->second;
    }

    auto * lctx = new llama_locret_context();
    lctx->heads = p.heads;
    if (p.budget == 0) {
        return lctx; // heads only: scores without eviction
    }

    auto fail = [&](const std::string & msg) {
        delete lctx;
        locret_set_error(msg);
        throw std::runtime_error("Locret: " + msg);
    };

    const auto & hp = model.hparams;
    const uint32_t budget   = (uint32_t) p.budget;
    const uint32_t n_ubatch = cparams.n_ubatch;
    const llama_locret_settings rec = llama_locret_heads_recommended(p.heads);

    if (hp.swa_type != LLAMA_SWA_TYPE_NONE || hp.is_swa_any()) {
        fail(format("the '%s' model has sliding-window attention layers (an iSWA cache); Locret eviction does "
                "not support them yet", llm_arch_name(model.arch)));
    }
    if (hp.rope_type == LLAMA_ROPE_TYPE_MROPE || hp.rope_type == LLAMA_ROPE_TYPE_IMROPE || hp.rope_type == LLAMA_ROPE_TYPE_VISION) {
        fail("multi-dimensional RoPE (M-RoPE) models are not supported by Locret eviction");
    }
    if (hp.n_lora_kv > 0) {
        fail("models with compressed (MLA) attention are not supported by Locret eviction");
    }
    if (cparams.n_seq_max > 1) {
        fail(format("Locret eviction keeps one sequence per context; got %u sequences (use -np 1)", cparams.n_seq_max));
    }
    if (n_ubatch_requested > cparams.n_ctx) {
        fail(format("the ubatch (-ub %u) is larger than the context (-c %u)", n_ubatch_requested, cparams.n_ctx));
    }

    // defaults: the file's recommendation, else the paper's n_s = 2500 and n_loc = 100; n_s also to half the budget
    std::string err;
    const uint32_t n_s   = locret_setting(p.stabilizers, rec.stabilizers, 2500, std::min(n_ubatch, budget / 2), n_ubatch,
                                          "stabilizers", err);
    const uint32_t n_loc = locret_setting(p.local, rec.local, 100, n_ubatch, n_ubatch, "local length", err);
    if (!err.empty()) {
        fail(err);
    }
    if (n_s >= budget) {
        fail(format("the budget (%u) must be larger than the stabilizers (%u)", budget, n_s));
    }

    auto & ev = lctx->ev;
    ev.budget      = budget;
    ev.stabilizers = n_s;
    ev.local       = n_loc;
    ev.n_ubatch    = n_ubatch;
    ev.capacity    = budget + n_ubatch;
    ev.n_cells     = GGML_PAD(ev.capacity, 256);
    ev.policy      = p.policy;
    lctx->evicting = true;

    *kv_cells = ev.n_cells;

    LLAMA_LOG_INFO("%s: Locret eviction: policy %s, budget %u, stabilizers %u, local %u, chunk (ubatch) %u -> %u KV cells "
            "(logical context %u)\n", __func__, llama_locret_policy_name(p.policy), budget, n_s, n_loc, n_ubatch,
            ev.n_cells, cparams.n_ctx);
    if (p.heads != nullptr && p.policy != LLAMA_LOCRET_POLICY_HEADS) {
        LLAMA_LOG_WARN("%s: Locret: policy %s chooses what is evicted; the retaining heads only score (for recording)\n",
                __func__, llama_locret_policy_name(p.policy));
    }
    return lctx;
}

void llama_locret_context_bind(llama_locret_context * lctx, llama_context * ctx, llama_memory_i * mem) {
    GGML_UNUSED(ctx);
    if (lctx == nullptr || !lctx->evicting) {
        return;
    }
    auto * kv = dynamic_cast<llama_kv_cache *>(mem);
    if (kv == nullptr) {
        throw std::runtime_error("Locret: this model's memory is not a plain KV cache (recurrent or hybrid model); "
                "Locret eviction does not support it");
    }
    auto & ev = lctx->ev;
    if (kv->get_size() < ev.capacity || kv->get_n_stream() != 1) {
        throw std::runtime_error(format("Locret: the KV cache has %u cells in %u streams, expected %u cells in one",
                kv->get_size(), kv->get_n_stream(), ev.n_cells));
    }
    const auto & hp = llama_locret_access::hparams(kv);
    const uint32_t n_layer = hp.n_layer();
    ev.kv = kv;
    ev.n_cells = kv->get_size();
    ev.unit_pos.assign(n_layer, {});
    ev.unit_score.assign(n_layer, {});
    ev.n_head_kv.assign(n_layer, 0);
    ev.ev_rows.assign(llama_locret_access::n_layers(kv), {});
    ev.ev_delta.assign(llama_locret_access::n_layers(kv), {});
    for (size_t ikv = 0; ikv < llama_locret_access::n_layers(kv); ++ikv) {
        const uint32_t il = llama_locret_access::layer_il(kv, ikv);
        ggml_tensor * v = llama_locret_access::layer_v(kv, ikv);
        if (v == nullptr || (uint64_t) v->ne[0] != hp.n_embd_v_gqa(il)) {
            throw std::runtime_error(format("Locret: layer %u's V cache layout is not supported", il));
        }
        ev.n_head_kv[il] = hp.n_head_kv(il);
        ev.unit_pos[il].assign((size_t) ev.n_head_kv[il] * ev.n_cells, -1);
        ev.unit_score[il].assign((size_t) ev.n_head_kv[il] * ev.n_cells, 0.0f);
    }
    kv->locret = lctx;
}

//
// planning, shared by the ubatch split (simulated) and the real run
//

static bool ubatch_has_output(const llama_ubatch & ubatch) {
    for (uint32_t i = 0; i < ubatch.n_tokens; ++i) {
        if (ubatch.output[i]) {
            return true;
        }
    }
    return false;
}

// units to keep in an eviction that must run before placing a ubatch of n_tokens, or n_used when none is due;
// n_stab receives the stabilizers to force
static uint32_t locret_plan(const locret_evict_state & ev, uint32_t n_used, bool prev_output,
        uint32_t n_tokens, bool cur_output, uint32_t & n_stab) {
    n_stab = 0;
    if (!prev_output && n_used > ev.budget) {
        // after a prefill chunk; the chunk before the prompt's tail is the final one: no stabilizers
        n_stab = cur_output ? 0 : std::min(ev.stabilizers, n_used);
        return ev.budget;
    }
    if (n_used + n_tokens > ev.capacity) {
        return std::min(ev.budget, n_used);
    }
    return n_used;
}

llama_memory_context_ptr llama_locret_kv_init_batch(llama_locret_context * lctx, llama_kv_cache * kv,
        llama_batch_allocr & balloc, uint32_t n_ubatch) {
    auto & ev = lctx->ev;
    balloc.split_reset();

    const llama_batch & batch = balloc.get_batch();
    const uint32_t n_tokens = balloc.get_n_tokens();
    const bool split_tail = ev.local > 0 && n_tokens > 0 && batch.logits != nullptr && batch.logits[n_tokens - 1];

    std::vector<llama_ubatch> ubatches;
    uint32_t remaining = n_tokens;
    while (remaining > 0) {
        uint32_t take = std::min(n_ubatch, remaining);
        if (split_tail && remaining > ev.local) {
            take = std::min(take, remaining - ev.local);
        }
        auto ubatch = balloc.split_simple(take);
        if (ubatch.n_tokens == 0) {
            break;
        }
        remaining -= ubatch.n_tokens;
        ubatches.push_back(std::move(ubatch));
    }
    if (balloc.get_n_used() < n_tokens) {
        return std::make_unique<llama_kv_cache_context>(LLAMA_MEMORY_STATUS_FAILED_PREPARE);
    }

    llama_kv_cache::slot_info_vec_t sinfos;
    uint32_t n_used = ev.n_used;
    bool prev_output = ev.prev_output;
    for (const auto & ubatch : ubatches) {
        const bool has_output = ubatch_has_output(ubatch);
        uint32_t n_stab = 0;
        n_used = locret_plan(ev, n_used, prev_output, ubatch.n_tokens, has_output, n_stab);
        if (n_used + ubatch.n_tokens > ev.n_cells) {
            LLAMA_LOG_ERROR("%s: Locret: a ubatch of %u tokens does not fit after %u retained units in %u cells\n",
                    __func__, ubatch.n_tokens, n_used, ev.n_cells);
            return std::make_unique<llama_kv_cache_context>(LLAMA_MEMORY_STATUS_FAILED_PREPARE);
        }
        llama_kv_cache::slot_info sinfo;
        sinfo.s0 = 0;
        sinfo.s1 = 0;
        sinfo.resize(1);
        sinfo.strm[0] = 0;
        sinfo.idxs[0].resize(ubatch.n_tokens);
        for (uint32_t i = 0; i < ubatch.n_tokens; ++i) {
            sinfo.idxs[0][i] = n_used + i;
        }
        sinfos.push_back(std::move(sinfo));
        n_used += ubatch.n_tokens;
        prev_output = has_output;
    }

    return std::make_unique<llama_kv_cache_context>(kv, std::move(sinfos), std::move(ubatches));
}

void llama_locret_kv_apply_ubatch(llama_locret_context * lctx, uint32_t first_cell, uint32_t n, const llama_ubatch & ubatch) {
    auto & ev = lctx->ev;
    // the split planned this ubatch after the same evictions that before_ubatch ran
    GGML_ASSERT(first_cell == ev.n_used && "Locret: ubatch placement does not follow the eviction plan");
    GGML_ASSERT(n == ubatch.n_tokens && first_cell + n <= ev.n_cells);

    for (size_t il = 0; il < ev.unit_pos.size(); ++il) {
        for (uint32_t h = 0; h < ev.n_head_kv[il]; ++h) {
            int32_t * pos   = ev.unit_pos[il].data()   + (size_t) h * ev.n_cells + first_cell;
            float   * score = ev.unit_score[il].data() + (size_t) h * ev.n_cells + first_cell;
            for (uint32_t i = 0; i < n; ++i) {
                pos[i]   = ubatch.pos[i];
                score[i] = 0.0f;
            }
        }
    }
    if (n > 0) {
        ev.logical_next = ubatch.pos[n - 1] + 1;
    }
    // the graph ropes and masks with physical positions: the cell indices
    for (uint32_t i = 0; i < n; ++i) {
        ubatch.pos[i] = (llama_pos) (first_cell + i);
    }
    ev.n_used      = first_cell + n;
    ev.last_start  = first_cell;
    ev.last_n      = n;
    ev.prev_output = ubatch_has_output(ubatch);
}

void llama_locret_kv_scores(llama_locret_context * lctx, uint32_t il, const float * cis, uint32_t n_tokens) {
    auto & ev = lctx->ev;
    GGML_ASSERT(n_tokens == ev.last_n && il < ev.unit_score.size());
    const uint32_t n_head_kv = ev.n_head_kv[il];
    for (uint32_t h = 0; h < n_head_kv; ++h) {
        float * score = ev.unit_score[il].data() + (size_t) h * ev.n_cells + ev.last_start;
        for (uint32_t t = 0; t < n_tokens; ++t) {
            score[t] = cis[(size_t) t * n_head_kv + h];
        }
    }
}

//
// the eviction itself
//

// the random policy's score: the top 24 bits of a 64-bit hash of (seed, layer, KV head, logical position), so that
// the value is uniform in [0, 1), exact in a float, and the same on every run and machine. The mixing function is
// the SplitMix64 finalizer (a bijection of 64-bit words with full avalanche); tests/py/test_policies.py mirrors it.
static const uint64_t LOCRET_RANDOM_SEED = 0x4c6f63726574ULL; // "Locret"

static uint64_t locret_mix64(uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}

static float locret_random_score(uint32_t il, uint32_t ih, llama_pos pos) {
    const uint64_t key = ((uint64_t) (il & 0xffff) << 48) | ((uint64_t) (ih & 0xffff) << 32) | (uint64_t) (uint32_t) pos;
    return (float) (locret_mix64(key ^ LOCRET_RANDOM_SEED) >> 40) * (1.0f / 16777216.0f);
}

// StreamingLLM's attention sinks: the first logical positions of the sequence always win
static const llama_pos LOCRET_STREAMING_SINKS = 4;

// scores of the units in cells [0, n_used) of layer il, KV head ih, for the policies that do not use the heads
static void locret_policy_scores(const locret_evict_state & ev, uint32_t il, uint32_t ih, const int32_t * pos,
        uint32_t n_used, float * score) {
    for (uint32_t c = 0; c < n_used; ++c) {
        if (ev.policy == LLAMA_LOCRET_POLICY_RANDOM) {
            score[c] = locret_random_score(il, ih, pos[c]);
        } else if (pos[c] < LOCRET_STREAMING_SINKS) {
            score[c] = INFINITY;
        } else {
            // recency: the logical position, counted back from the next one so that float rounding cannot tie
            // recent units even at positions past 2^24
            score[c] = -(float) ((int64_t) ev.logical_next - pos[c]);
        }
    }
}

// the top (n_keep - n_stab) of cells [0, n_used - n_stab) by score, ties to the earlier cell, plus the last n_stab
// cells; returned in cell order
static void locret_select(const float * score, uint32_t n_used, uint32_t n_keep, uint32_t n_stab,
        std::vector<uint32_t> & keep) {
    const uint32_t n_cand = n_used - n_stab;
    const uint32_t n_top  = n_keep - n_stab;
    keep.resize(n_cand);
    for (uint32_t c = 0; c < n_cand; ++c) {
        keep[c] = c;
    }
    auto better = [score](uint32_t a, uint32_t b) {
        const float sa = std::isnan(score[a]) ? -INFINITY : score[a];
        const float sb = std::isnan(score[b]) ? -INFINITY : score[b];
        return sa > sb || (sa == sb && a < b);
    };
    if (n_top < n_cand) {
        std::nth_element(keep.begin(), keep.begin() + n_top, keep.end(), better);
        keep.resize(n_top);
    }
    std::sort(keep.begin(), keep.end());
    for (uint32_t c = n_cand; c < n_used; ++c) {
        keep.push_back(c);
    }
}

namespace {

class locret_evict_input : public llm_graph_input_i {
public:
    locret_evict_input(const locret_evict_state & ev, const llama_kv_cache * kv) : ev(ev), kv(kv) {}

    void set_input(const llama_ubatch * ubatch) override {
        GGML_UNUSED(ubatch);
        for (size_t ikv = 0; ikv < rows.size(); ++ikv) {
            ggml_backend_tensor_set(rows[ikv], ev.ev_rows[ikv].data(), 0, ggml_nbytes(rows[ikv]));
            if (delta[ikv] != nullptr && delta[ikv]->buffer) {
                ggml_backend_tensor_set(delta[ikv], ev.ev_delta[ikv].data(), 0, ggml_nbytes(delta[ikv]));
            }
        }
        if (k_rot != nullptr && k_rot->buffer) {
            kv->set_input_k_rot(k_rot);
        }
    }

    std::vector<ggml_tensor *> rows;  // per KV layer: I32 [n_keep*n_head_kv], source row (cell*n_head_kv + head)
    std::vector<ggml_tensor *> delta; // per KV layer: I32 [n_keep*n_head_kv], new position - old position
    ggml_tensor * k_rot = nullptr;    // Hadamard rotation of a quantized K cache, or NULL

    const locret_evict_state & ev;
    const llama_kv_cache * kv;
};

} // namespace

// one graph for all layers: gather each (cell, head) row of K and V from its old cell, re-rotate K by the
// position change, and write the rows back into cells [0, n_keep)
static ggml_cgraph * locret_build_evict_graph(llm_graph_result * res, llama_context * ctx, const locret_evict_state & ev,
        uint32_t n_keep, uint32_t n_used) {
    llama_kv_cache * kv = ev.kv;
    const llama_model   & model   = llama_locret_access::model(kv);
    const llama_hparams & hp      = llama_locret_access::hparams(kv);
    const llama_cparams & cparams = ctx->get_cparams();
    const bool v_trans = llama_locret_access::v_trans(kv);
    const uint64_t kv_size = kv->get_size();

    ggml_context * ctx0 = res->get_ctx();
    ggml_cgraph  * gf   = res->get_gf();

    auto inp = std::make_unique<locret_evict_input>(ev, kv);
    inp->k_rot = llama_locret_access::rot_k(kv) ? kv->build_input_k_rot(ctx0) : nullptr;

    const size_t n_layers = llama_locret_access::n_layers(kv);
    inp->rows.assign(n_layers, nullptr);
    inp->delta.assign(n_layers, nullptr);

    for (size_t ikv = 0; ikv < n_layers; ++ikv) {
        const uint32_t il        = llama_locret_access::layer_il(kv, ikv);
        const int64_t  n_head_kv = hp.n_head_kv(il);
        const int64_t  d_k       = hp.n_embd_head_k(il);
        const int64_t  d_v       = hp.n_embd_head_v(il);
        const int64_t  n_rows    = (int64_t) n_keep * n_head_kv;

        ggml_tensor * rows = ggml_new_tensor_1d(ctx0, GGML_TYPE_I32, n_rows);
        ggml_set_input(rows);
        inp->rows[ikv] = rows;

        // K: [n_embd_k_gqa, kv_size] viewed as one row per (cell, head)
        ggml_tensor * k = llama_locret_access::layer_k(kv, ikv);
        ggml_tensor * k_src = ggml_view_2d(ctx0, k, d_k, n_head_kv * n_used, ggml_row_size(k->type, d_k), 0);
        ggml_tensor * k_new = ggml_get_rows(ctx0, k_src, rows); // F32 [d_k, n_rows]

        if (hp.rope_type != LLAMA_ROPE_TYPE_NONE && hp.has_rope(il)) {
            ggml_tensor * delta = ggml_new_tensor_1d(ctx0, GGML_TYPE_I32, n_rows);
            ggml_set_input(delta);
            inp->delta[ikv] = delta;

            k_new = ggml_reshape_3d(ctx0, k_new, d_k, 1, n_rows);
            if (inp->k_rot) {
                k_new = llama_mul_mat_hadamard(ctx0, k_new, inp->k_rot); // back to the RoPE basis (rot^2 == I)
            }
            // the stored keys were rotated for their old positions: rotating by the difference moves them
            k_new = ggml_rope_ext(ctx0, k_new, delta, model.get_rope_factors(cparams, il), hp.n_rot(il), hp.rope_type,
                    cparams.n_ctx_orig_yarn, model.get_rope_freq_base(cparams, il), model.get_rope_freq_scale(cparams, il),
                    cparams.yarn_ext_factor, cparams.yarn_attn_factor, cparams.yarn_beta_fast, cparams.yarn_beta_slow);
            if (inp->k_rot) {
                k_new = llama_mul_mat_hadamard(ctx0, k_new, inp->k_rot);
            }
            k_new = ggml_reshape_2d(ctx0, k_new, d_k, n_rows);
        }
        ggml_tensor * k_dst = ggml_view_2d(ctx0, k, d_k, n_rows, ggml_row_size(k->type, d_k), 0);
        ggml_build_forward_expand(gf, ggml_cpy(ctx0, k_new, k_dst));

        ggml_tensor * v = llama_locret_access::layer_v(kv, ikv);
        const int64_t n_embd_v_gqa = d_v * n_head_kv;
        if (!v_trans) {
            ggml_tensor * v_src = ggml_view_2d(ctx0, v, d_v, n_head_kv * n_used, ggml_row_size(v->type, d_v), 0);
            ggml_tensor * v_new = ggml_get_rows(ctx0, v_src, rows);
            ggml_tensor * v_dst = ggml_view_2d(ctx0, v, d_v, n_rows, ggml_row_size(v->type, d_v), 0);
            ggml_build_forward_expand(gf, ggml_cpy(ctx0, v_new, v_dst));
        } else {
            // transposed V: one row of kv_size cells per (head, dim); gather in the untransposed layout
            ggml_tensor * v_t   = ggml_view_2d(ctx0, v, n_used, n_embd_v_gqa, ggml_row_size(v->type, kv_size), 0);
            ggml_tensor * v_src = ggml_cont(ctx0, ggml_transpose(ctx0, v_t));            // [n_embd_v_gqa, n_used]
            v_src = ggml_reshape_2d(ctx0, v_src, d_v, n_head_kv * n_used);
            ggml_tensor * v_new = ggml_get_rows(ctx0, v_src, rows);                       // F32 [d_v, n_rows]
            v_new = ggml_transpose(ctx0, ggml_reshape_2d(ctx0, v_new, n_embd_v_gqa, n_keep)); // [n_keep, n_embd_v_gqa]
            ggml_tensor * v_dst = ggml_view_2d(ctx0, v, n_keep, n_embd_v_gqa, ggml_row_size(v->type, kv_size), 0);
            ggml_build_forward_expand(gf, ggml_cpy(ctx0, v_new, v_dst));
        }
    }

    res->add_input(std::move(inp));
    return gf;
}

// cells [from, to) become free; the slot search starts at `from`
static void locret_free_cells(llama_kv_cache * kv, uint32_t from, uint32_t to) {
    llama_kv_cells & cells = llama_locret_access::cells(kv);
    for (uint32_t c = from; c < to; ++c) {
        if (!cells.is_empty(c)) {
            cells.rm(c);
        }
    }
    llama_locret_access::head(kv) = from;
}

static bool locret_evict(llama_locret_context & lctx, llama_context * ctx, uint32_t n_keep, uint32_t n_stab) {
    auto & ev = lctx.ev;
    llama_kv_cache * kv = ev.kv;
    const uint32_t n_used = ev.n_used;
    GGML_ASSERT(n_keep < n_used && n_stab <= n_keep);

    // choose per (layer, head) on the host, compact the bookkeeping, and lay out the graph's inputs
    std::vector<uint32_t> keep;
    for (size_t ikv = 0; ikv < ev.ev_rows.size(); ++ikv) {
        const uint32_t il = llama_locret_access::layer_il(kv, ikv);
        const uint32_t n_head_kv = ev.n_head_kv[il];
        ev.ev_rows[ikv].resize((size_t) n_keep * n_head_kv);
        ev.ev_delta[ikv].resize((size_t) n_keep * n_head_kv);
        for (uint32_t h = 0; h < n_head_kv; ++h) {
            int32_t * pos   = ev.unit_pos[il].data()   + (size_t) h * ev.n_cells;
            float   * score = ev.unit_score[il].data() + (size_t) h * ev.n_cells;
            if (ev.policy != LLAMA_LOCRET_POLICY_HEADS) {
                locret_policy_scores(ev, il, h, pos, n_used, score);
            }
            locret_select(score, n_used, n_keep, n_stab, keep);
            for (uint32_t i = 0; i < n_keep; ++i) {
                const uint32_t c = keep[i]; // c >= i: compacting forward in place is safe
                pos[i]   = pos[c];
                score[i] = score[c];
                ev.ev_rows [ikv][(size_t) i * n_head_kv + h] = (int32_t) (c * n_head_kv + h);
                ev.ev_delta[ikv][(size_t) i * n_head_kv + h] = (int32_t) i - (int32_t) c;
            }
            std::fill(pos + n_keep, pos + n_used, -1);
        }
    }

    // the previous ubatch's outputs may still be copied out of the scheduler's buffers
    ggml_backend_sched_t sched = ctx->get_sched();
    ggml_backend_sched_synchronize(sched);
    ggml_backend_sched_reset(sched);

    llm_graph_result * res = ctx->get_gf_res_reserve();
    res->reset();
    ggml_cgraph * gf = locret_build_evict_graph(res, ctx, ev, n_keep, n_used);
    if (!ggml_backend_sched_alloc_graph(sched, gf)) {
        locret_set_error("failed to allocate the Locret eviction graph");
        LLAMA_LOG_ERROR("%s: %s\n", __func__, llama_locret_last_error());
        return false;
    }
    res->set_inputs(nullptr);
    if (ctx->graph_compute(gf, true) != GGML_STATUS_SUCCESS) {
        locret_set_error("failed to compute the Locret eviction graph");
        LLAMA_LOG_ERROR("%s: %s\n", __func__, llama_locret_last_error());
        return false;
    }

    // cells [0, n_keep) keep positions 0..n_keep-1; the rest become free
    locret_free_cells(kv, n_keep, n_used);

    uint64_t n_units_evicted = 0;
    for (size_t il = 0; il < ev.n_head_kv.size(); ++il) {
        n_units_evicted += (uint64_t) ev.n_head_kv[il] * (n_used - n_keep);
    }
    ev.n_used          = n_keep;
    ev.uniform_from    = n_keep;
    ev.n_evictions    += 1;
    ev.n_units_evicted += n_units_evicted;

    LLAMA_LOG_DEBUG("%s: Locret eviction %llu: %u -> %u units per head (%u stabilizers), logical position %d\n", __func__,
            (unsigned long long) ev.n_evictions, n_used, n_keep, n_stab, ev.logical_next);
    return true;
}

int llama_locret_before_ubatch(llama_locret_context * lctx, llama_context * ctx, const llama_ubatch & ubatch) {
    if (lctx == nullptr || !lctx->evicting || lctx->ev.kv == nullptr) {
        return 0;
    }
    auto & ev = lctx->ev;
    uint32_t n_stab = 0;
    const uint32_t n_keep = locret_plan(ev, ev.n_used, ev.prev_output, ubatch.n_tokens, ubatch_has_output(ubatch), n_stab);
    if (n_keep >= ev.n_used) {
        return 0;
    }
    return locret_evict(*lctx, ctx, n_keep, n_stab) ? 1 : -1;
}

//
// the memory interface in logical positions
//

static void locret_reset(locret_evict_state & ev) {
    for (size_t il = 0; il < ev.unit_pos.size(); ++il) {
        std::fill(ev.unit_pos[il].begin(), ev.unit_pos[il].end(), -1);
        std::fill(ev.unit_score[il].begin(), ev.unit_score[il].end(), 0.0f);
    }
    ev.n_used       = 0;
    ev.uniform_from = 0;
    ev.prev_output  = true;
    ev.logical_next = 0;
    ev.last_start   = 0;
    ev.last_n       = 0;
}

void llama_locret_kv_clear(llama_locret_context * lctx) {
    locret_reset(lctx->ev);
}

static const int32_t * locret_first_head_pos(const locret_evict_state & ev) {
    for (size_t il = 0; il < ev.unit_pos.size(); ++il) {
        if (ev.n_head_kv[il] > 0) {
            return ev.unit_pos[il].data();
        }
    }
    return nullptr;
}

llama_pos llama_locret_kv_seq_pos_min(const llama_locret_context * lctx, llama_seq_id seq_id) {
    const auto & ev = lctx->ev;
    if (seq_id > 0 || ev.n_used == 0) {
        return -1;
    }
    llama_pos res = std::numeric_limits<llama_pos>::max();
    for (size_t il = 0; il < ev.unit_pos.size(); ++il) {
        for (uint32_t h = 0; h < ev.n_head_kv[il]; ++h) {
            res = std::min(res, ev.unit_pos[il][(size_t) h * ev.n_cells]);
        }
    }
    return res;
}

llama_pos llama_locret_kv_seq_pos_max(const llama_locret_context * lctx, llama_seq_id seq_id) {
    const auto & ev = lctx->ev;
    if (seq_id > 0 || ev.n_used == 0) {
        return -1;
    }
    return ev.logical_next - 1;
}

bool llama_locret_kv_seq_rm(llama_locret_context * lctx, llama_kv_cache * kv, llama_seq_id seq_id, llama_pos p0, llama_pos p1) {
    auto & ev = lctx->ev;
    if (seq_id > 0 || ev.n_used == 0) {
        return true;
    }
    p0 = std::max(p0, 0);
    if (p1 < 0) {
        p1 = std::numeric_limits<llama_pos>::max();
    }
    if (p0 >= p1 || p0 >= ev.logical_next) {
        return true;
    }
    if (p0 <= llama_locret_kv_seq_pos_min(lctx, 0) && p1 >= ev.logical_next) {
        locret_free_cells(kv, 0, ev.n_used);
        locret_reset(ev);
        return true;
    }
    // a suffix placed after the last eviction sits in the same cells of every head: it can go
    const int32_t * pos = locret_first_head_pos(ev);
    if (p1 >= ev.logical_next && pos != nullptr && ev.uniform_from < ev.n_used && pos[ev.uniform_from] <= p0) {
        uint32_t first = ev.uniform_from;
        while (first < ev.n_used && pos[first] < p0) {
            ++first;
        }
        locret_free_cells(kv, first, ev.n_used);
        for (size_t il = 0; il < ev.unit_pos.size(); ++il) {
            for (uint32_t h = 0; h < ev.n_head_kv[il]; ++h) {
                std::fill(ev.unit_pos[il].begin() + (size_t) h * ev.n_cells + first,
                          ev.unit_pos[il].begin() + (size_t) h * ev.n_cells + ev.n_used, -1);
            }
        }
        ev.n_used       = first;
        ev.logical_next = p0;
        ev.last_n       = 0;
        ev.prev_output  = true;
        return true;
    }
    // positions inside the compressed part differ per head: they cannot be removed one by one
    LLAMA_LOG_DEBUG("%s: Locret: cannot remove positions [%d, %d) from a compressed cache\n", __func__, p0, p1);
    return false;
}

void llama_locret_kv_seq_add(llama_locret_context * lctx, llama_seq_id seq_id, llama_pos p0, llama_pos p1, llama_pos shift) {
    // logical positions are labels: RoPE uses the physical ones, so a shift only relabels units
    auto & ev = lctx->ev;
    if (seq_id > 0 || shift == 0) {
        return;
    }
    p0 = std::max(p0, 0);
    if (p1 < 0) {
        p1 = std::numeric_limits<llama_pos>::max();
    }
    for (size_t il = 0; il < ev.unit_pos.size(); ++il) {
        for (auto & p : ev.unit_pos[il]) {
            if (p >= p0 && p < p1) {
                p += shift;
            }
        }
    }
    if (ev.logical_next >= p0 && ev.logical_next <= p1) {
        ev.logical_next += shift;
    }
}

void llama_locret_kv_unsupported(const char * what) {
    LLAMA_LOG_WARN("%s: Locret eviction: %s is not supported on a compressed cache; ignored\n", __func__, what);
}

//
// state save/load: the bookkeeping follows llama.cpp's own cells and K/V data
//

static const uint32_t LOCRET_STATE_MAGIC   = 0x5443524c; // "LRCT"
static const uint32_t LOCRET_STATE_VERSION = 1;

void llama_locret_kv_state_write(const llama_locret_context * lctx, llama_io_write_i & io) {
    const auto & ev = lctx->ev;
    const uint32_t header[] = {
        LOCRET_STATE_MAGIC, LOCRET_STATE_VERSION, (uint32_t) ev.unit_pos.size(), ev.budget, ev.n_used, ev.uniform_from,
        (uint32_t) ev.prev_output, (uint32_t) ev.logical_next, ev.last_start, ev.last_n,
    };
    io.write(header, sizeof(header));
    const uint64_t stats[] = { ev.n_evictions, ev.n_units_evicted };
    io.write(stats, sizeof(stats));
    for (size_t il = 0; il < ev.unit_pos.size(); ++il) {
        for (uint32_t h = 0; h < ev.n_head_kv[il]; ++h) {
            io.write(ev.unit_pos[il].data()   + (size_t) h * ev.n_cells, sizeof(int32_t) * ev.n_used);
            io.write(ev.unit_score[il].data() + (size_t) h * ev.n_cells, sizeof(float)   * ev.n_used);
        }
    }
}

void llama_locret_kv_state_read(llama_locret_context * lctx, llama_kv_cache * kv, llama_io_read_i & io) {
    auto & ev = lctx->ev;
    uint32_t header[10];
    io.read(header, sizeof(header));
    if (header[0] != LOCRET_STATE_MAGIC || header[1] != LOCRET_STATE_VERSION) {
        throw std::runtime_error("Locret: the saved state has no Locret section (saved without eviction?)");
    }
    if (header[2] != ev.unit_pos.size() || header[3] != ev.budget || header[4] > ev.n_cells) {
        throw std::runtime_error(format("Locret: the saved state was made with another model or budget "
                "(%u layers, budget %u, %u units)", header[2], header[3], header[4]));
    }
    // llama.cpp restored the cells from 0: they must be exactly the used ones
    const llama_kv_cells & cells = llama_locret_access::cells(kv);
    if (cells.get_used() != header[4] || (header[4] > 0 && cells.used_max_p1() != header[4])) {
        throw std::runtime_error("Locret: the restored cells do not match the saved Locret state");
    }
    locret_reset(ev);
    ev.n_used       = header[4];
    ev.uniform_from = header[5];
    ev.prev_output  = header[6] != 0;
    ev.logical_next = (llama_pos) header[7];
    ev.last_start   = header[8];
    ev.last_n       = header[9];
    uint64_t stats[2];
    io.read(stats, sizeof(stats));
    ev.n_evictions     = stats[0];
    ev.n_units_evicted = stats[1];
    for (size_t il = 0; il < ev.unit_pos.size(); ++il) {
        for (uint32_t h = 0; h < ev.n_head_kv[il]; ++h) {
            io.read(ev.unit_pos[il].data()   + (size_t) h * ev.n_cells, sizeof(int32_t) * ev.n_used);
            io.read(ev.unit_score[il].data() + (size_t) h * ev.n_cells, sizeof(float)   * ev.n_used);
        }
    }
}

//
// public read-outs
//

struct llama_locret_stats llama_locret_get_stats(const struct llama_context * ctx) {
    llama_locret_stats st = {};
    const llama_locret_context * lctx = llama_locret_access::state(ctx);
    if (lctx == nullptr || !lctx->evicting || lctx->ev.kv == nullptr) {
        return st;
    }
    const auto & ev = lctx->ev;
    st.enabled         = true;
    st.n_evictions     = ev.n_evictions;
    st.n_units_evicted = ev.n_units_evicted;
    st.n_cells_used    = ev.n_used;
    st.n_cells         = ev.n_cells;
    st.pos_logical     = ev.logical_next;
    st.budget          = ev.budget;
    st.stabilizers     = ev.stabilizers;
    st.local           = ev.local;
    st.n_ubatch        = ev.n_ubatch;
    st.policy          = ev.policy;
    for (size_t ikv = 0; ikv < llama_locret_access::n_layers(ev.kv); ++ikv) {
        st.kv_bytes += ggml_nbytes(llama_locret_access::layer_k(ev.kv, ikv));
        st.kv_bytes += ggml_nbytes(llama_locret_access::layer_v(ev.kv, ikv));
    }
    return st;
}

int32_t llama_locret_retained(const struct llama_context * ctx, int32_t il, int32_t ih, int32_t * logical_pos, int32_t n_max) {
    locret_set_error("");
    const llama_locret_context * lctx = llama_locret_access::state(ctx);
    if (lctx == nullptr || !lctx->evicting || lctx->ev.kv == nullptr) {
        locret_set_error("llama_locret_retained: the context does not evict");
        return -1;
    }
    const auto & ev = lctx->ev;
    if (il < 0 || (size_t) il >= ev.unit_pos.size() || ih < 0 || (uint32_t) ih >= ev.n_head_kv[il]) {
        locret_set_error(format("llama_locret_retained: no layer %d / KV head %d", il, ih));
        return -1;
    }
    if (logical_pos != nullptr) {
        if (n_max < (int32_t) ev.n_used) {
            locret_set_error(format("llama_locret_retained: %u units do not fit in %d", ev.n_used, n_max));
            return -1;
        }
        std::memcpy(logical_pos, ev.unit_pos[il].data() + (size_t) ih * ev.n_cells, sizeof(int32_t) * ev.n_used);
    }
    return (int32_t) ev.n_used;
}

int32_t llama_locret_debug_read_kv(struct llama_context * ctx, int32_t il, bool read_v, float * out, int32_t n_cells) {
    locret_set_error("");
    const llama_locret_context * lctx = llama_locret_access::state(ctx);
    if (lctx == nullptr || !lctx->evicting || lctx->ev.kv == nullptr) {
        locret_set_error("llama_locret_debug_read_kv: the context does not evict");
        return -1;
    }
    llama_kv_cache * kv = lctx->ev.kv;
    int64_t ikv = -1;
    for (size_t i = 0; i < llama_locret_access::n_layers(kv); ++i) {
        if ((int32_t) llama_locret_access::layer_il(kv, i) == il) {
            ikv = (int64_t) i;
        }
    }
    if (ikv < 0 || n_cells < 0 || (uint64_t) n_cells > kv->get_size()) {
        locret_set_error(format("llama_locret_debug_read_kv: no layer %d or bad cell count %d", il, n_cells));
        return -1;
    }
    llama_synchronize(ctx);
    ggml_tensor * t = read_v ? llama_locret_access::layer_v(kv, ikv) : llama_locret_access::layer_k(kv, ikv);
    std::vector<uint8_t> raw(ggml_nbytes(t));
    ggml_backend_tensor_get(t, raw.data(), 0, raw.size());
    const int64_t width   = t->ne[0];
    const int64_t kv_size = kv->get_size();
    const auto * traits = ggml_get_type_traits(t->type);
    auto to_float = [&](const void * src, float * dst, int64_t n) {
        if (t->type == GGML_TYPE_F32) {
            std::memcpy(dst, src, sizeof(float) * n);
        } else {
            traits->to_float(src, dst, n);
        }
    };
    if (read_v && llama_locret_access::v_trans(kv)) {
        // element (cell c, column r) lies at r*kv_size + c
        std::vector<float> row(kv_size);
        for (int64_t r = 0; r < width; ++r) {
            to_float(raw.data() + ggml_row_size(t->type, kv_size) * r, row.data(), kv_size);
            for (int64_t c = 0; c < n_cells; ++c) {
                out[c * width + r] = row[c];
            }
        }
    } else {
        for (int64_t c = 0; c < n_cells; ++c) {
            to_float(raw.data() + t->nb[1] * c, out + c * width, width);
        }
    }
    return (int32_t) width;
}
