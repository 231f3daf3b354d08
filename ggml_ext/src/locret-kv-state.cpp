// A fix of llama.cpp's whole-cache states (patches/0021 calls it; locret-hooks.h says what it does): a restore puts
// every cell back where it was saved, and the slot search's head with it. Restored from cell 0, a cache whose cells
// are not 0..n-1 in order (a sliding-window cache is a ring) held the same cells in another layout, and the next
// ubatch's tokens landed elsewhere too: attention summed the same terms in another order, and Gemma 3's logits after a
// reload mid-prompt were 1.2 apart from the saver's own continuation, without any eviction.

#include "locret-hooks.h"

#include "llama-io.h"

#include <mutex>
#include <stdexcept>
#include <unordered_set>

// the top bit of a saved stream's cell count: the cells' layout and the slot search's head follow the count
static constexpr uint32_t LOCRET_KV_STATE_LAYOUT_FLAG = 0x80000000u;

void llama_locret_kv_state_write_count(llama_io_write_i & io, uint32_t cell_count, bool whole,
                                       const std::vector<std::pair<uint32_t, uint32_t>> & ranges, uint32_t head) {
    if (!whole || cell_count == 0) {
        io.write(&cell_count, sizeof(cell_count));
        return;
    }
    // the flag in the count keeps saves without a layout (per sequence, and every save before the fix) readable
    const uint32_t flagged  = cell_count | LOCRET_KV_STATE_LAYOUT_FLAG;
    const uint32_t n_ranges = (uint32_t) ranges.size();
    io.write(&flagged,  sizeof(flagged));
    io.write(&n_ranges, sizeof(n_ranges));
    for (const auto & range : ranges) {
        const uint32_t r[2] = { range.first, range.second };
        io.write(r, sizeof(r));
    }
    io.write(&head, sizeof(head));
}

uint32_t llama_locret_kv_state_read_count(llama_io_read_i & io, bool use_places, uint32_t n_cells,
                                          std::vector<uint32_t> & at, uint32_t & head_saved) {
    at.clear();
    head_saved = 0;
    uint32_t cell_count;
    io.read(&cell_count, sizeof(cell_count));
    if (!(cell_count & LOCRET_KV_STATE_LAYOUT_FLAG)) {
        return cell_count;
    }
    cell_count &= ~LOCRET_KV_STATE_LAYOUT_FLAG;
    uint32_t n_ranges;
    io.read(&n_ranges, sizeof(n_ranges));
    if (n_ranges == 0 || n_ranges > cell_count) {
        throw std::runtime_error("failed to restore kv cache: corrupt cell layout");
    }
    // grown as the ranges are read, not sized by the file's count: a short file ends the read first
    std::vector<std::pair<uint32_t, uint32_t>> ranges;
    uint32_t n_read   = 0;
    uint32_t prev_end = 0;
    for (uint32_t k = 0; k < n_ranges; ++k) {
        uint32_t r[2];
        io.read(r, sizeof(r));
        // ranges ascending, apart, inside the count and summing to it
        if (r[0] >= r[1] || r[0] < prev_end || r[1] - r[0] > cell_count - n_read) {
            throw std::runtime_error("failed to restore kv cache: corrupt cell layout");
        }
        ranges.emplace_back(r[0], r[1]);
        n_read  += r[1] - r[0];
        prev_end = r[1];
    }
    io.read(&head_saved, sizeof(head_saved));
    if (n_read != cell_count) {
        throw std::runtime_error("failed to restore kv cache: corrupt cell layout");
    }
    // the places are used only by a whole restore into a cache they fit (so `at` is bounded by its size); a mirrored
    // pair (both must place alike) or a single sequence restores from cell 0 as before
    if (use_places && prev_end <= n_cells) {
        at.reserve(cell_count);
        for (const auto & range : ranges) {
            for (uint32_t i = range.first; i < range.second; ++i) {
                at.push_back(i);
            }
        }
    }
    return cell_count;
}

// the window caches whose sequence saves keep their SWA-masked cells: those of the evicting memories alive
static std::mutex                                 g_keep_masked_mutex;
static std::unordered_set<const llama_kv_cache *> g_keep_masked;

void locret_kv_state_keep_masked(const llama_kv_cache * kv, bool keep) {
    std::lock_guard<std::mutex> lock(g_keep_masked_mutex);
    if (keep) {
        g_keep_masked.insert(kv);
    } else {
        g_keep_masked.erase(kv);
    }
}

bool llama_locret_kv_state_keeps_masked(const llama_kv_cache * kv) {
    std::lock_guard<std::mutex> lock(g_keep_masked_mutex);
    return g_keep_masked.count(kv) > 0;
}
