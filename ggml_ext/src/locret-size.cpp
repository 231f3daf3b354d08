// The rule book's sizes: what an evicting context allocates, and the budget that fits a memory size (locret-size.h).

#include "locret-size.h"

#include "locret-policy.h"

#include "llama-cparams.h"
#include "llama-impl.h"
#include "llama-model.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <stdexcept>
#include <string>

uint64_t locret_layer_row_bytes(const llama_model & model, uint32_t il, ggml_type type_k, ggml_type type_v, bool v_trans) {
    const auto & hp = model.hparams;
    return ggml_row_size(type_k, hp.n_embd_k_gqa(il)) +
           ggml_row_size(type_v, v_trans ? hp.n_embd_v_gqa_max() : hp.n_embd_v_gqa(il));
}

std::vector<locret_layer_group> locret_layer_groups(const locret_config & cfg, size_t n_layers, bool one_cache) {
    const char * env = getenv("LOCRET_DEBUG_ALLOC");
    const bool masked = env != nullptr && std::strcmp(env, "masked") == 0;
    if (cfg.layer_budget.empty() || one_cache || masked || n_layers == 0) {
        locret_layer_group all;
        all.layers.resize(n_layers);
        std::iota(all.layers.begin(), all.layers.end(), 0u);
        all.n_cells = cfg.n_cells;
        return { all };
    }
    GGML_ASSERT(cfg.layer_budget.size() == n_layers);
    // one group per distinct budget, the largest first
    std::vector<uint32_t> budgets = cfg.layer_budget;
    std::sort(budgets.begin(), budgets.end(), std::greater<uint32_t>());
    budgets.erase(std::unique(budgets.begin(), budgets.end()), budgets.end());
    std::vector<locret_layer_group> groups(budgets.size());
    for (size_t g = 0; g < budgets.size(); ++g) {
        groups[g].n_cells = g == 0 ? cfg.n_cells : budgets[g] + cfg.n_ubatch;
    }
    for (uint32_t j = 0; j < n_layers; ++j) {
        const size_t g = std::find(budgets.begin(), budgets.end(), cfg.layer_budget[j]) - budgets.begin();
        groups[g].layers.push_back(j);
    }
    return groups;
}

std::vector<locret_layer_group> locret_layer_groups_for(const llama_model & model, const locret_config & cfg) {
    const auto & hp = model.hparams;
    size_t n_layers = 0;
    for (uint32_t il = 0; il < hp.n_layer(); ++il) {
        n_layers += locret_layer_evicts(hp, il) ? 1 : 0;
    }
    // an iSWA model's window cache follows the one evicting cache's frame; ALiBi's mask holds distances by cell, which
    // a group's cells do not share with the first group's (whose mask the others read)
    return locret_layer_groups(cfg, n_layers, hp.swa_type != LLAMA_SWA_TYPE_NONE || hp.use_alibi);
}

locret_memory_size locret_memory_size_make(const llama_model & model, const locret_config & cfg, const llama_cparams & cparams,
        ggml_type type_k, ggml_type type_v, bool v_trans, bool swa_full) {
    const auto & hp = model.hparams;
    // the model's memory is llama_kv_cache_iswa when it has sliding-window layers: the evicting cache then holds the
    // full-attention layers and the window layers get a cache of the window plus a ubatch (llama-kv-cache-iswa.cpp)
    const bool iswa = hp.swa_type != LLAMA_SWA_TYPE_NONE;
    locret_memory_size s;
    if (iswa) {
        s.n_cells_window = swa_full ? cfg.n_cells : GGML_PAD(std::min(cfg.n_cells, hp.n_swa + cparams.n_ubatch), 256);
    }
    const std::unique_ptr<locret_policy> policy = locret_policy_make(cfg.policy);
    const uint64_t n_query_rows = policy ? policy->query_rows(cfg) : 0;
    const bool     scores       = policy && policy->stores_scores();
    // the evicting layers' cells: their group's (one group of cfg.n_cells without a schedule)
    const std::vector<locret_layer_group> groups = locret_layer_groups_for(model, cfg);
    std::vector<uint32_t> cells_of_layer;
    for (const auto & g : groups) {
        for (uint32_t j : g.layers) {
            cells_of_layer.resize(std::max<size_t>(cells_of_layer.size(), j + 1), 0);
            cells_of_layer[j] = g.n_cells;
        }
    }
    s.n_groups = (uint32_t) groups.size();
    s.layer.assign(hp.n_layer(), 0);
    uint32_t j = 0; // index among the evicting layers
    for (uint32_t il = 0; il < hp.n_layer(); ++il) {
        if (!hp.has_kv(il)) {
            continue;
        }
        // one K row and one V row per cell, as llama_kv_cache sizes them
        const uint64_t row = locret_layer_row_bytes(model, il, type_k, type_v, v_trans);
        if (iswa && hp.is_swa(il)) {
            s.layer[il] = row * s.n_cells_window;
            s.window   += s.layer[il];
            continue;
        }
        GGML_ASSERT(j < cells_of_layer.size());
        s.layer[il] = row * cells_of_layer[j++];
        s.kv       += s.layer[il];
        if (scores) {
            s.scores += (uint64_t) sizeof(float) * hp.n_head_kv(il) * cfg.n_cells;
        }
        s.queries += (uint64_t) sizeof(float) * hp.n_embd_head_k(il) * hp.n_head(il) * n_query_rows;
    }
    return s;
}

uint32_t locret_budget_for_bytes(const llama_model & model, const llama_locret_params & p_in, const locret_schedule_spec & schedule,
        const llama_cparams & cparams, uint32_t n_ubatch_requested, ggml_type type_k, ggml_type type_v, bool v_trans,
        bool swa_full, uint64_t bytes, locret_config * cfg_out, locret_memory_size * size_out) {
    if (schedule.kind == locret_schedule_spec::EXPLICIT) {
        throw std::runtime_error(format("a budget schedule file ('%s') sets the budget itself: give --locret-budget, "
                "not a memory size", schedule.source.c_str()));
    }
    if (p_in.policy == LLAMA_LOCRET_POLICY_SAGE) {
        throw std::runtime_error("SAGE-KV's cache holds the whole prompt, so its memory is set by the context size (-c), "
                "not by the budget: give --locret-budget");
    }
    llama_locret_params p = p_in;
    // the config and memory of budget b; false (with the reason in *err) when the rules refuse it
    auto try_budget = [&](uint32_t b, locret_config & cfg, locret_memory_size & size, std::string * err) {
        p.budget = (int32_t) b;
        try {
            cfg  = locret_config_make(model, p, schedule, cparams, n_ubatch_requested, type_k);
            size = locret_memory_size_make(model, cfg, cparams, type_k, type_v, v_trans, swa_full);
            return true;
        } catch (const std::exception & e) {
            if (err != nullptr) {
                *err = e.what();
            }
            return false;
        }
    };
    locret_config      cfg;
    locret_memory_size size;
    // the smallest budget the rules accept: they refuse budgets below the stabilizers, the window, ... (a bound that
    // holds from some budget up) and, with kept positions, above the position limit. Powers of two find the range,
    // halving finds its start.
    const uint32_t b_probe_max = 1u << 29; // b stays within int32_t (llama_locret_params.budget) when doubled once more
    uint32_t hi = 1;
    std::string err_typical;
    while (hi <= b_probe_max && !try_budget(hi, cfg, size, hi == 2048 ? &err_typical : nullptr)) {
        hi *= 2;
    }
    if (hi > b_probe_max) {
        // refused at every budget: the reason a typical budget gets
        throw std::runtime_error(err_typical.empty() ? "the Locret settings are refused at every budget" : err_typical);
    }
    uint32_t lo = hi / 2; // refused (or 0)
    while (hi - lo > 1) {
        const uint32_t mid = lo + (hi - lo) / 2;
        (try_budget(mid, cfg, size, nullptr) ? hi : lo) = mid;
    }
    const uint32_t b_min = hi;
    try_budget(b_min, cfg, size, nullptr);
    if (size.total() > bytes) {
        throw std::runtime_error(format("%.2f MiB per sequence is too small: the smallest budget the settings allow, "
                "b = %u, needs %.2f MiB (K/V %.2f, window cache %.2f, scores %.2f)", bytes / 1048576.0, b_min,
                size.total() / 1048576.0, size.kv / 1048576.0, size.window / 1048576.0,
                (size.scores + size.queries) / 1048576.0));
    }
    // the largest budget that fits: memory grows with b, and a budget the rules refuse above b_min (past the position
    // limit) refuses every larger one
    auto fits = [&](uint32_t b) {
        return try_budget(b, cfg, size, nullptr) && size.total() <= bytes;
    };
    uint32_t good = b_min;
    uint32_t bad  = b_min;
    while (bad <= b_probe_max && fits(bad)) {
        good = bad;
        bad  = bad * 2;
    }
    while (bad - good > 1) {
        const uint32_t mid = good + (bad - good) / 2;
        (fits(mid) ? good : bad) = mid;
    }
    try_budget(good, cfg, size, nullptr);
    if (cfg_out != nullptr) {
        *cfg_out = cfg;
    }
    if (size_out != nullptr) {
        *size_out = size;
    }
    return good;
}
