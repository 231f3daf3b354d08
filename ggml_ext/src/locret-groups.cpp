// The layer groups' caches and their cell maps (see locret-groups.h).

#include "locret-groups.h"

#include <algorithm>

void locret_group_caches::init(llama_kv_cache * c0, std::vector<std::unique_ptr<llama_kv_cache>> rest) {
    cache0 = c0;
    caches = std::move(rest);
    group_layers.assign(size(), {});
}

uint32_t locret_group_caches::live_end(size_t g, const locret_cells & s) const {
    if (g == 0) {
        return s.dead_end; // the largest budget's group: its largest layer is never masked
    }
    uint32_t e = 0;
    for (size_t i : group_layers[g]) {
        e = std::max(e, std::min(s.live_end[i], s.dead_end));
    }
    return e;
}

int64_t locret_group_caches::cell(size_t g, const locret_cells & s, uint32_t c) const {
    const uint32_t live = live_end(g, s);
    if (c < live) {
        return c;
    }
    if (c < s.dead_end) {
        return -1;
    }
    return (int64_t) c - (s.dead_end - live);
}

void locret_group_caches::masked_cells(size_t g, size_t i, const locret_cells & s, uint32_t * c0, uint32_t * c1) const {
    *c1 = live_end(g, s);
    *c0 = std::min(s.live_end[i], *c1);
}

void locret_group_caches::place(const locret_ubatch_plan & plan, const llama_ubatch & ubatch,
        const std::vector<locret_cells> & streams, std::vector<std::unique_ptr<llama_kv_cache_context>> & out) const {
    out.resize(size() - 1);
    for (size_t g = 1; g < size(); ++g) {
        // each part goes right after the group's cells in use: its cells in group 0 less the group's gap
        llama_kv_cache::slot_info sinfo;
        sinfo.resize(plan.steps.size());
        for (size_t p = 0; p < plan.steps.size(); ++p) {
            const locret_step & st = plan.steps[p];
            const locret_cells & s = streams[st.strm];
            const uint32_t gp = gap(g, s);
            GGML_ASSERT(st.first_cell >= s.dead_end && st.first_cell - gp + st.n_tokens <= cache(g)->get_size());
            sinfo.strm[p] = st.strm;
            sinfo.idxs[p].resize(st.n_tokens);
            for (uint32_t j = 0; j < st.n_tokens; ++j) {
                sinfo.idxs[p][j] = st.first_cell - gp + j;
            }
        }
        sinfo.s0 = *std::min_element(sinfo.strm.begin(), sinfo.strm.end());
        sinfo.s1 = *std::max_element(sinfo.strm.begin(), sinfo.strm.end());
        out[g - 1] = std::make_unique<llama_kv_cache_context>(cache(g), llama_kv_cache::slot_info_vec_t{ sinfo },
                std::vector<llama_ubatch>{ ubatch });
        out[g - 1]->apply();
    }
}

void locret_group_caches::free_from(uint32_t strm, llama_pos pos_from) const {
    // the cache's cells hold positions that grow with the cell (compact positions: the cell itself; kept positions:
    // cells below the budget hold their own index, later ones the RoPE position they were placed at): removing
    // positions >= pos_from frees the cells from the first that holds such a position on. A layer group's cache holds
    // the same units of a suffix at the same positions.
    for (size_t g = 0; g < size(); ++g) {
        cache(g)->seq_rm((llama_seq_id) strm, pos_from, -1);
    }
}

void locret_group_caches::free_tails(uint32_t strm, const locret_cells & s) const {
    // after an eviction group g keeps cells [0, its live end) of its own cache; the cells there hold positions that
    // grow with the cell as in group 0's (each part is placed after the cells in use, at positions past theirs), so
    // the cells from the live end on are those whose position is at least that cell's
    for (size_t g = 1; g < size(); ++g) {
        llama_kv_cache * c = cache(g);
        const llama_kv_cells & cells = c->get_cells((llama_seq_id) strm);
        const uint32_t live = live_end(g, s);
        if (live < cells.size() && !cells.is_empty(live)) {
            c->seq_rm((llama_seq_id) strm, cells.pos_get(live), -1);
        }
        GGML_ASSERT(cells.get_used() == live && "Locret: a layer group's cache does not follow the eviction");
    }
}
