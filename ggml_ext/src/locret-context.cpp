// A context's Locret state and the hooks around its ubatches: attached heads, the score recorder, the Locret memory's
// creation, and the eviction before / scores after each ubatch. Also the calls the tools make around a context: the
// default heads (llama_locret_configure_default, llama_locret_attach_default), a pinned query (llama_locret_pin_query),
// a sequence's prompt length (llama_locret_seq_prompt: pooling for long prompts),
// and the sizes read from a model file before it is loaded (llama_locret_resolve_file, llama_locret_budget_for_mib,
// llama_locret_fit_n_ctx: locret-size.h's rules).

#include "llama-locret-debug.h"
#include "locret-context.h"
#include "locret-hooks.h"
#include "locret-memory.h"
#include "locret-policy.h"
#include "locret-settings.h"
#include "locret-size.h"

#include "llama-batch.h"
#include "llama-context.h"
#include "llama-cparams.h"
#include "llama-graph.h"
#include "llama-impl.h"
#include "llama-model.h"

#include <algorithm>
#include <stdexcept>
#include <utility>
#include <vector>

static llama_locret_context & locret_of(llama_context * ctx) {
    if (!ctx->locret) {
        ctx->locret.reset(new llama_locret_context());
    }
    return *ctx->locret;
}

llama_locret_context * llama_locret_context_create(const llama_model & model) {
    llama_locret_params p;
    if (!locret_settings_find(model, p)) {
        return nullptr;
    }
    auto * lctx = new llama_locret_context();
    lctx->heads = p.heads; // with the random and streaming policies heads, if any, only score for the recorder
    lctx->evicts_by_heads = p.budget > 0 && locret_policy_find(p.policy) != nullptr && locret_policy_find(p.policy)->needs_heads;
    return lctx;
}

void llama_locret_context_deleter::operator()(llama_locret_context * lctx) const {
    delete lctx;
}

const llama_locret_heads * llama_locret_context_heads(const llama_locret_context * lctx) {
    // the scores cost a graph per layer: they are computed only when an eviction or the recorder reads them
    return lctx != nullptr && (lctx->evicts_by_heads || lctx->record) ? lctx->heads : nullptr;
}

// one llama_kv_cache per group of evicting layers, made as the model makes its own (llama.cpp's layer filter picks
// the group's layers), group g in groups[g].n_cells cells per sequence
static std::vector<std::unique_ptr<llama_kv_cache>> locret_make_group_caches(const llama_model & model,
        const llama_memory_params & params, const llama_cparams & cparams, const std::vector<locret_layer_group> & groups) {
    const auto & hp = model.hparams;
    std::vector<uint32_t> evicting; // model layer of each evicting layer
    for (uint32_t il = 0; il < hp.n_layer(); ++il) {
        if (locret_layer_evicts(hp, il)) {
            evicting.push_back(il);
        }
    }
    std::vector<std::unique_ptr<llama_kv_cache>> caches;
    for (size_t g = 0; g < groups.size(); ++g) {
        std::vector<bool> in_group(hp.n_layer(), false);
        for (uint32_t j : groups[g].layers) {
            in_group[evicting.at(j)] = true;
        }
        const llama_kv_cache::layer_filter_cb filter = [in_group](int32_t il) {
            return il >= 0 && (size_t) il < in_group.size() && in_group[il];
        };
        // tensor names stay unique across the caches: group 0 keeps llama.cpp's own names
        const std::string tag = g == 0 ? std::string() : format("locret_g%zu_", g);
        caches.emplace_back(new llama_kv_cache(model, hp, params.type_k, params.type_v, !cparams.flash_attn,
                cparams.offload_kqv, /*unified =*/ false, groups[g].n_cells, std::max(1u, cparams.n_seq_max), /*n_pad =*/ 1,
                hp.n_swa, hp.swa_type, nullptr, filter, nullptr, nullptr, tag.c_str()));
    }
    return caches;
}

llama_memory_i * llama_locret_memory_create(const llama_model & model, const llama_memory_params & params,
        llama_cparams & cparams, uint32_t n_ubatch_requested) {
    llama_locret_params p;
    if (!locret_settings_find(model, p) || p.budget <= 0) {
        return nullptr;
    }
    try {
        const locret_config cfg = locret_config_make(model, p, locret_schedule_find(model), cparams, n_ubatch_requested,
                params.type_k);
        // the model's own cache, made for the cells the budget needs, one stream per sequence
        llama_cparams cparams_mem = cparams;
        cparams_mem.n_ctx_seq  = cfg.n_cells;
        cparams_mem.n_ctx      = cfg.n_cells * std::max(1u, cparams.n_seq_max);
        cparams_mem.kv_unified = false;
        // RoPE sees positions below the cells of a sequence, whatever the logical context: LongRoPE models choose
        // their factor set by that (keys, queries and re-rotation alike)
        cparams.n_ctx_rope = cfg.n_cells;
        // a budget schedule's layers in caches of their own, each sized for its group's budget (locret_layer_groups);
        // one group: the model's own cache
        const std::vector<locret_layer_group> groups = locret_layer_groups_for(model, cfg);
        if (groups.size() > 1) {
            return new llama_locret_memory(model, cparams, cfg, locret_make_group_caches(model, params, cparams_mem, groups));
        }
        llama_memory_ptr inner(model.create_memory(params, cparams_mem));
        if (!inner) {
            throw std::runtime_error(format("the '%s' model has no KV cache to evict", llm_arch_name(model.arch)));
        }
        return new llama_locret_memory(model, cparams, cfg, std::move(inner));
    } catch (const std::exception & e) {
        locret_set_error(e.what());
        throw std::runtime_error(std::string("Locret: ") + e.what());
    }
}

int32_t llama_locret_set_heads(llama_context * ctx, const llama_locret_heads * heads) {
    locret_set_error("");
    if (heads != nullptr && heads->model != llama_get_model(ctx)) {
        locret_set_error(format("retaining heads from '%s' were loaded for another model than this context's", heads->path.c_str()));
        LLAMA_LOG_ERROR("%s: %s\n", __func__, llama_locret_last_error());
        return -1;
    }
    llama_locret_context & lctx = locret_of(ctx);
    const llama_locret_memory * mem = locret_memory_of(llama_get_memory(ctx));
    if (mem != nullptr && mem->get_policy().uses_heads() && heads != lctx.heads) {
        locret_set_error("this context evicts with the heads it was created with; they cannot be replaced or detached");
        LLAMA_LOG_ERROR("%s: %s\n", __func__, llama_locret_last_error());
        return -1;
    }
    lctx.heads = heads;
    return 0;
}

// where the tools look for heads: `heads_path` when it is non-empty, else the model file when the model embeds
// heads (its metadata says so without reading the file again), else nowhere ("")
static std::string locret_default_heads_path(const llama_model * model, const char * model_path, const char * heads_path) {
    if (heads_path != nullptr && heads_path[0] != '\0') {
        return heads_path;
    }
    char version[32];
    if (model_path != nullptr && llama_model_meta_val_str(model, "locret.format_version", version, sizeof(version)) >= 0) {
        return model_path;
    }
    return "";
}

int32_t llama_locret_attach_default(llama_context * ctx, const char * model_path, const char * heads_path,
        llama_locret_heads ** out) {
    *out = nullptr;
    const llama_model * model = llama_get_model(ctx);
    const std::string path = locret_default_heads_path(model, model_path, heads_path);
    if (path.empty()) {
        return 0;
    }
    llama_locret_heads * heads = llama_locret_heads_load(model, path.c_str());
    if (heads == nullptr) {
        return -1;
    }
    if (llama_locret_set_heads(ctx, heads) != 0) {
        llama_locret_heads_free(heads);
        return -1;
    }
    *out = heads;
    return 0;
}

// llama_locret_configure_default but for the schedule and positions: the heads found for settings p whose budget -1
// means "no --locret-budget" (the rest as llama_locret_model_configure takes them, but for p.heads, found here)
static int32_t locret_configure_tool(llama_model * model, const char * model_path, const char * heads_path,
        const llama_locret_params & p, llama_locret_heads ** out) {
    *out = nullptr;
    locret_set_error("");
    const int32_t budget = p.budget, stabilizers = p.stabilizers, local = p.local, pool = p.pool;
    const llama_locret_policy policy = p.policy;
    const char * policy_settings = p.policy_settings;
    const locret_policy_entry * entry = locret_policy_find(policy);
    const char * policy_name = entry != nullptr ? entry->name : nullptr;
    if (entry == nullptr) {
        locret_set_error(format("unknown Locret policy %d", (int) policy));
        return -1;
    }
    // -1 is "no --locret-budget"; any other value below 1 was given and is refused
    if (budget == -1 && (stabilizers >= 0 || local >= 0)) {
        locret_set_error("--locret-stabilizers and --locret-local need --locret-budget");
        return -1;
    }
    if (budget == -1 && pool >= 0) {
        locret_set_error("--locret-pool needs --locret-budget");
        return -1;
    }
    if (budget == -1 && policy_settings != nullptr && policy_settings[0] != '\0') {
        locret_set_error(format("the settings of --locret-policy %s need --locret-budget", policy_name));
        return -1;
    }
    if (budget == -1 && !entry->needs_heads) {
        locret_set_error(format("--locret-policy %s needs --locret-budget", policy_name));
        return -1;
    }
    if (budget != -1 && budget < 1) {
        locret_set_error(format("the Locret budget must be at least 1 unit (got %d)", budget));
        return -1;
    }
    const std::string path = locret_default_heads_path(model, model_path, heads_path);
    llama_locret_params params = p;
    params.heads  = nullptr;
    params.budget = budget == -1 ? 0 : budget;
    if (!entry->needs_heads) {
        // the scores come from the policy: loading the heads would only add their cost to every ubatch
        if (!path.empty()) {
            LLAMA_LOG_WARN("%s: Locret: policy %s does not use retaining heads; the heads in '%s' are not loaded\n",
                    __func__, policy_name, path.c_str());
        }
        return llama_locret_model_configure(model, &params);
    }
    if (path.empty()) {
        if (budget != -1) {
            locret_set_error("--locret-budget needs retaining heads: pass --locret-heads FILE (or a model with embedded "
                    "heads), or choose --locret-policy lagkv, streaming or random");
            return -1;
        }
        llama_locret_model_configure(model, nullptr);
        return 0;
    }
    llama_locret_heads * heads = llama_locret_heads_load(model, path.c_str());
    if (heads == nullptr) {
        return -1;
    }
    params.heads = heads;
    if (llama_locret_model_configure(model, &params) != 0) {
        llama_locret_heads_free(heads);
        return -1;
    }
    *out = heads;
    return 0;
}

int32_t llama_locret_configure_default(llama_model * model, const char * model_path, const char * heads_path,
        const llama_locret_params * params, llama_locret_heads ** out) {
    *out = nullptr;
    locret_set_error("");
    if (params == nullptr || params->heads != nullptr) {
        locret_set_error("llama_locret_configure_default finds the heads itself: give settings with heads NULL");
        return -1;
    }
    llama_locret_params base = *params;
    base.budget_schedule = nullptr;
    base.positions       = -1;
    base.position_limit  = -1;
    if (locret_configure_tool(model, model_path, heads_path, base, out) != 0) {
        return -1;
    }
    // the schedule and the layout go on the registered settings through their own setters, which check them with
    // the rest (the order is this one, here only)
    const bool scheduled = params->budget_schedule != nullptr && params->budget_schedule[0] != '\0';
    if ((scheduled && llama_locret_model_set_budget_schedule(model, params->budget_schedule) != 0) ||
            (params->positions >= 0 &&
             llama_locret_model_set_positions(model, params->positions, params->position_limit) != 0)) {
        const std::string reason = llama_locret_last_error();
        llama_locret_model_configure(model, nullptr);
        llama_locret_heads_free(*out);
        *out = nullptr;
        locret_set_error(reason);
        return -1;
    }
    return 0;
}

// only errors reach the log while the fit reads the model's hyperparameters
static void locret_log_errors_only(ggml_log_level level, const char * text, void * user_data) {
    const auto * prev = (const std::pair<ggml_log_callback, void *> *) user_data;
    if (level == GGML_LOG_LEVEL_ERROR && prev->first != nullptr) {
        prev->first(level, text, prev->second);
    }
}

// Runs fn(model, p, cparams, n_ubatch_requested) on the hyperparameters of the model in `model_path` (a metadata
// load), with `params` completed as a context would: when params->heads is NULL and the policy scores with heads, the
// recommended settings of the heads in `heads_path` (else the model's embedded ones) are the defaults. fn throws
// std::runtime_error for settings the rules refuse. Returns 0, or -1 (llama_locret_last_error).
template <typename F>
static int32_t locret_with_model_file(const char * model_path, const char * heads_path, const llama_locret_params & params,
        const llama_context_params & cparams, F && fn) {
    // the rules read the model's hyperparameters only: a metadata load (no_alloc, as -fit's own) reads them without
    // the weights (a vocab_only load would stop before them)
    std::pair<ggml_log_callback, void *> prev;
    llama_log_get(&prev.first, &prev.second);
    llama_log_set(locret_log_errors_only, &prev);
    llama_model_params mparams = llama_model_default_params();
    mparams.no_alloc     = true;
    mparams.load_mode    = LLAMA_LOAD_MODE_NONE;
    mparams.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(model_path, mparams);
    llama_log_set(prev.first, prev.second);
    if (model == nullptr) {
        locret_set_error(format("cannot read the model '%s'", model_path));
        return -1;
    }
    llama_locret_params p = params;
    const std::string heads = locret_default_heads_path(model, model_path, heads_path);
    // the heads' recommendations are the defaults only where the heads will score (llama_locret_configure_default)
    const locret_policy_entry * policy = locret_policy_find(p.policy);
    const bool read_heads = p.heads == nullptr && !heads.empty() && policy != nullptr && policy->needs_heads;
    int32_t ret = -1;
    if (!read_heads || llama_locret_file_recommended(heads.c_str(), &p.defaults) >= 0) {
        try {
            uint32_t n_ubatch_requested = 0;
            const llama_cparams c = locret_cparams_like_context(*model, cparams, &n_ubatch_requested);
            fn(*model, p, c, n_ubatch_requested);
            ret = 0;
        } catch (const std::exception & e) {
            locret_set_error(e.what());
        }
    }
    llama_model_free(model);
    return ret;
}

// the V cache is transposed without flash attention (llama_context turns "auto" on where the backend has it)
static bool locret_v_trans(const llama_context_params & cparams) {
    return cparams.flash_attn_type == LLAMA_FLASH_ATTN_TYPE_DISABLED;
}

static void locret_resolved_fill(const locret_config & cfg, const locret_memory_size & size, const llama_cparams & c,
        llama_locret_resolved * out) {
    out->n_cells        = cfg.n_cells;
    out->n_seq          = c.n_seq_max;
    out->budget_max     = cfg.budget;
    out->stabilizers    = cfg.stabilizers;
    out->local          = cfg.local;
    out->n_ubatch       = cfg.n_ubatch;
    out->n_cells_window = size.n_cells_window;
    out->kv_bytes       = size.kv;
    out->window_bytes   = size.window;
    out->store_bytes    = size.scores + size.queries;
}

int32_t llama_locret_resolve_file(const char * model_path, const char * heads_path, const llama_locret_params * params,
        const llama_context_params * cparams, llama_locret_resolved * out) {
    locret_set_error("");
    if (model_path == nullptr || params == nullptr || cparams == nullptr || out == nullptr) {
        locret_set_error("llama_locret_resolve_file: model_path, params, cparams and out must not be NULL");
        return -1;
    }
    // the same resolution without the per-layer bytes
    return llama_locret_resolve_file_layers(model_path, heads_path, params, cparams, out, nullptr, nullptr, 0) < 0 ? -1 : 0;
}

int32_t llama_locret_resolve_file_layers(const char * model_path, const char * heads_path, const llama_locret_params * params,
        const llama_context_params * cparams, llama_locret_resolved * out, uint64_t * layers_out, uint32_t * budgets_out,
        int32_t n_layers_out) {
    locret_set_error("");
    if (model_path == nullptr || params == nullptr || cparams == nullptr || (layers_out == nullptr && n_layers_out > 0)) {
        locret_set_error("llama_locret_resolve_file_layers: model_path, params, cparams and layers_out must not be NULL");
        return -1;
    }
    if (out != nullptr) {
        *out = {};
    }
    int32_t n_layer = -1;
    const int32_t ret = locret_with_model_file(model_path, heads_path, *params, *cparams,
            [&](const llama_model & model, const llama_locret_params & p, const llama_cparams & c, uint32_t n_ubatch_requested) {
        const locret_config cfg = locret_config_make(model, p, locret_schedule_parse(p.budget_schedule), c,
                n_ubatch_requested, cparams->type_k);
        const locret_memory_size size = locret_memory_size_make(model, cfg, c, cparams->type_k, cparams->type_v,
                locret_v_trans(*cparams), cparams->swa_full);
        const llama_hparams & hp = model.hparams;
        n_layer = (int32_t) size.layer.size();
        size_t i_evicting = 0; // the schedule lists the evicting layers only, in layer order
        for (int32_t il = 0; il < n_layer; ++il) {
            const bool evicts = locret_layer_evicts(hp, (uint32_t) il);
            const uint32_t budget = !evicts ? 0 : cfg.layer_budget.empty() ? cfg.budget : cfg.layer_budget[i_evicting];
            i_evicting += evicts ? 1 : 0;
            if (il < n_layers_out) {
                layers_out[il] = size.layer[il];
                if (budgets_out != nullptr) {
                    budgets_out[il] = budget;
                }
            }
        }
        if (out != nullptr) {
            locret_resolved_fill(cfg, size, c, out);
        }
    });
    return ret == 0 ? n_layer : -1;
}

int32_t llama_locret_budget_for_mib(const char * model_path, const char * heads_path, const llama_locret_params * params,
        const llama_context_params * cparams, double mib, llama_locret_resolved * out) {
    locret_set_error("");
    if (model_path == nullptr || params == nullptr || cparams == nullptr) {
        locret_set_error("llama_locret_budget_for_mib: model_path, params and cparams must not be NULL");
        return -1;
    }
    // at most 16 TiB: the budget search stays within 32-bit budgets
    if (!(mib > 0.0) || mib > 16777216.0) {
        locret_set_error(format("the Locret memory size must be more than 0 MiB and at most 16777216 MiB (got %g)", mib));
        return -1;
    }
    if (out != nullptr) {
        *out = {};
    }
    int32_t budget = -1;
    const int32_t ret = locret_with_model_file(model_path, heads_path, *params, *cparams,
            [&](const llama_model & model, const llama_locret_params & p, const llama_cparams & c, uint32_t n_ubatch_requested) {
        locret_config      cfg;
        locret_memory_size size;
        budget = (int32_t) locret_budget_for_bytes(model, p, locret_schedule_parse(p.budget_schedule), c,
                n_ubatch_requested, cparams->type_k, cparams->type_v, locret_v_trans(*cparams), cparams->swa_full,
                (uint64_t) (mib * 1048576.0), &cfg, &size);
        if (out != nullptr) {
            locret_resolved_fill(cfg, size, c, out);
        }
    });
    return ret == 0 ? budget : -1;
}

int64_t llama_locret_fit_n_ctx(const char * model_path, const char * heads_path, const llama_locret_params * params,
        const llama_context_params * cparams) {
    locret_set_error("");
    if (model_path == nullptr || params == nullptr || cparams == nullptr) {
        locret_set_error("llama_locret_fit_n_ctx: model_path, params and cparams must not be NULL");
        return -1;
    }
    int64_t n_ctx = -1;
    const int32_t ret = locret_with_model_file(model_path, heads_path, *params, *cparams,
            [&](const llama_model & model, const llama_locret_params & p, const llama_cparams & c, uint32_t n_ubatch_requested) {
        const locret_config cfg = locret_config_make(model, p, locret_schedule_parse(p.budget_schedule), c,
                n_ubatch_requested, cparams->type_k);
        const bool v_trans = locret_v_trans(*cparams);
        const locret_memory_size size = locret_memory_size_make(model, cfg, c, cparams->type_k, cparams->type_v, v_trans,
                cparams->swa_full);
        uint64_t cells = cfg.n_cells;
        if (size.n_groups > 1) {
            // llama.cpp's fit sizes n_ctx cells in every layer: as many as hold the layer groups' bytes (a budget
            // schedule's groups are never made for an iSWA model, so every layer with KV evicts)
            uint64_t row = 0;
            for (uint32_t il = 0; il < model.hparams.n_layer(); ++il) {
                row += locret_layer_evicts(model.hparams, il) ?
                        locret_layer_row_bytes(model, il, cparams->type_k, cparams->type_v, v_trans) : 0;
            }
            cells = row > 0 ? (size.kv + row - 1) / row : cells;
        }
        n_ctx = (int64_t) cells * c.n_seq_max;
    });
    return ret == 0 ? n_ctx : -1;
}

const llama_locret_heads * llama_locret_get_heads(const llama_context * ctx) {
    return ctx->locret ? ctx->locret->heads : nullptr;
}

bool llama_locret_check_graph(const llama_locret_context * lctx, const llm_graph_result * res, int32_t n_layer) {
    if (llama_locret_context_heads(lctx) == nullptr) {
        return true;
    }
    for (int32_t il = 0; il < n_layer; ++il) {
        if (il >= (int32_t) res->t_locret_cis.size() || res->t_locret_cis[il] == nullptr) {
            const llama_model * model = lctx->heads->model;
            locret_set_error(format("the '%s' graph does not compute layer %d's Q, K, V through build_qkv, "
                    "so retaining heads cannot score it; Locret does not support this architecture (the random and "
                    "streaming policies need no heads)", llm_arch_name(model->arch), il));
            LLAMA_LOG_ERROR("%s: %s\n", __func__, llama_locret_last_error());
            return false;
        }
    }
    return true;
}

// The refusals shared by the calls about one sequence's tokens: a context that does not evict, a negative count.
// Returns the context's Locret memory, or nullptr with the error set.
static llama_locret_memory * locret_memory_for_tokens(llama_context * ctx, const char * caller, int32_t n_tokens) {
    locret_set_error("");
    llama_locret_memory * mem = ctx != nullptr ? locret_memory_of(llama_get_memory(ctx)) : nullptr;
    if (mem == nullptr) {
        locret_set_error(format("%s: the context does not evict (no Locret budget)", caller));
        return nullptr;
    }
    if (n_tokens < 0) {
        locret_set_error(format("%s: a negative token count (%d)", caller, n_tokens));
        return nullptr;
    }
    return mem;
}

int32_t llama_locret_pin_query(llama_context * ctx, llama_seq_id seq_id, int32_t n_tokens) {
    llama_locret_memory * mem = locret_memory_for_tokens(ctx, __func__, n_tokens);
    if (mem == nullptr) {
        return -1;
    }
    const locret_cells * s = mem->get_stream(seq_id);
    const bool changed = s != nullptr && s->n_pinned != (uint32_t) n_tokens;
    if (!mem->pin_prefix(seq_id, (uint32_t) n_tokens)) {
        return -1;
    }
    if (changed && n_tokens > 0) {
        LLAMA_LOG_INFO("%s: Locret-Q: the first %d positions of sequence %d are pinned (never evicted)\n", __func__, n_tokens, seq_id);
    }
    return 0;
}

int32_t llama_locret_seq_prompt(llama_context * ctx, llama_seq_id seq_id, int32_t n_tokens) {
    llama_locret_memory * mem = locret_memory_for_tokens(ctx, __func__, n_tokens);
    return mem != nullptr ? mem->tell_prompt(seq_id, (uint32_t) n_tokens) : -1;
}

void llama_locret_reserve(llama_context * ctx) {
    llama_locret_memory * mem = locret_memory_of(llama_get_memory(ctx));
    if (mem != nullptr && !mem->evictor().reserve(ctx)) {
        throw std::runtime_error(std::string("Locret: ") + llama_locret_last_error());
    }
}

bool llama_locret_before_ubatch(llama_context * ctx, llama_memory_context_i * mctx, llm_graph_result *& prev_graph) {
    llama_locret_memory * mem = nullptr;
    const locret_ubatch_plan * plan = mctx != nullptr ? locret_plan_of(mctx, &mem) : nullptr;
    if (plan == nullptr) {
        return true;
    }
    const int evicted = mem->evictor().evict(ctx, *plan);
    if (evicted != 0) {
        prev_graph = nullptr;
    }
    return evicted >= 0;
}

bool llama_locret_after_ubatch(llama_locret_context * lctx, ggml_backend_sched * sched, const llm_graph_result * res,
        const llama_ubatch & ubatch, const llama_memory_context_i * mctx) {
    llama_locret_memory * mem = nullptr;
    const locret_ubatch_plan * plan = locret_plan_of(mctx, &mem);
    if (mem != nullptr && mem->faults.take(LOCRET_FAULT_UBATCH)) {
        locret_set_error("the ubatch failed after it was placed (injected)");
        LLAMA_LOG_ERROR("%s: Locret: %s\n", __func__, llama_locret_last_error());
        return false;
    }
    // an evicting memory's scores stay on the device (the graph wrote them into its store): only the recorder reads
    if (llama_locret_context_heads(lctx) == nullptr || !lctx->record) {
        return true;
    }
    // the graph may still be running on an asynchronous backend: wait before reading the scores
    ggml_backend_sched_synchronize(sched);
    const size_t n_layer   = lctx->heads->layers.size();
    const size_t n_head_kv = lctx->heads->n_head_kv;
    const size_t n_tokens  = ubatch.n_tokens;
    const size_t first     = lctx->positions.size();
    lctx->rec_n_layer   = n_layer;
    lctx->rec_n_head_kv = n_head_kv;
    lctx->scores.resize((first + n_tokens) * n_layer * n_head_kv);
    lctx->staging.resize(n_tokens * n_head_kv);
    for (size_t il = 0; il < n_layer; ++il) {
        ggml_tensor * cis = res->t_locret_cis[il]; // [n_head_kv, n_tokens]
        GGML_ASSERT(cis != nullptr && (size_t) cis->ne[0] == n_head_kv && (size_t) cis->ne[1] == n_tokens);
        ggml_backend_tensor_get(cis, lctx->staging.data(), 0, ggml_nbytes(cis));
        for (size_t t = 0; t < n_tokens; ++t) {
            float * dst = &lctx->scores[((first + t) * n_layer + il) * n_head_kv];
            for (size_t h = 0; h < n_head_kv; ++h) {
                dst[h] = lctx->staging[t * n_head_kv + h];
            }
        }
    }
    // the client's positions: an evicting memory gives the graph physical ones
    for (size_t t = 0; t < n_tokens; ++t) {
        lctx->positions.push_back(plan != nullptr ? plan->logical[t] : ubatch.pos[t]);
        lctx->seq_ids.push_back(ubatch.seq_id[t][0]);
    }
    return true;
}

void llama_locret_record_scores(llama_context * ctx, bool enable) {
    llama_locret_context & lctx = locret_of(ctx);
    lctx.record = enable;
    if (enable) {
        lctx.scores.clear();
        lctx.positions.clear();
        lctx.seq_ids.clear();
    }
}

int32_t llama_locret_recorded_n_tokens(const llama_context * ctx) {
    const llama_locret_context * lctx = ctx->locret.get();
    return lctx ? (int32_t) lctx->positions.size() : 0;
}

int32_t llama_locret_recorded_sequences(const llama_context * ctx, int32_t * seq_ids, int32_t n_tokens) {
    locret_set_error("");
    const int32_t n_recorded = llama_locret_recorded_n_tokens(ctx);
    if (n_tokens != n_recorded) {
        locret_set_error(format("llama_locret_recorded_sequences: asked for %d tokens but %d are recorded", n_tokens, n_recorded));
        return -1;
    }
    if (n_recorded > 0) {
        std::copy(ctx->locret->seq_ids.begin(), ctx->locret->seq_ids.end(), seq_ids);
    }
    return n_tokens;
}

int32_t llama_locret_recorded_scores(const llama_context * ctx, float * scores, int32_t * positions, int32_t n_tokens) {
    locret_set_error("");
    const llama_locret_context * lctx = ctx->locret.get();
    const int32_t n_recorded = llama_locret_recorded_n_tokens(ctx);
    if (n_tokens != n_recorded) {
        locret_set_error(format("llama_locret_recorded_scores: asked for %d tokens but %d are recorded", n_tokens, n_recorded));
        return -1;
    }
    if (n_recorded == 0) {
        return 0;
    }
    if (positions != nullptr) {
        std::copy(lctx->positions.begin(), lctx->positions.end(), positions);
    }
    if (scores != nullptr) {
        const size_t n_layer   = lctx->rec_n_layer;
        const size_t n_head_kv = lctx->rec_n_head_kv;
        // token-major storage -> [n_layer][n_head_kv][n_tokens]
        for (size_t t = 0; t < (size_t) n_tokens; ++t) {
            for (size_t il = 0; il < n_layer; ++il) {
                for (size_t h = 0; h < n_head_kv; ++h) {
                    scores[(il * n_head_kv + h) * n_tokens + t] = lctx->scores[(t * n_layer + il) * n_head_kv + h];
                }
            }
        }
    }
    return n_tokens;
}
