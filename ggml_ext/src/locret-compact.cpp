// The compaction graph: gather the rows that move, re-rotate their keys exactly, write them to their new rows.
// Existing ggml ops only (get_rows, rope_ext, set_rows, the Hadamard matmul of a quantized K cache), so every backend
// runs the same graph.

#include "locret-compact.h"

#include "llama-context.h"
#include "llama-cparams.h"
#include "llama-graph.h"
#include "llama-impl.h"
#include "llama-kv-cache.h"
#include "llama-model.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <stdexcept>

//
// exact re-rotation
//

// YaRN's ramp between interpolated and extrapolated frequencies, as ggml computes it for the pair starting at i0
static float locret_yarn_ramp(float low, float high, int i0) {
    const float y = (i0 / 2 - low) / std::max(0.001f, high - low);
    return 1.0f - std::min(1.0f, std::max(0.0f, y));
}

static bool locret_naive_rope() {
    const char * env = getenv("LOCRET_DEBUG_NAIVE_ROPE");
    return env != nullptr && atoi(env) != 0;
}

locret_rerotation locret_rerotation_make(const llama_model & model, const llama_cparams & cparams, uint32_t il) {
    const auto & hp = model.hparams;
    locret_rerotation r;
    if (hp.rope_type == LLAMA_ROPE_TYPE_NONE || !hp.has_rope(il)) {
        return r;
    }
    r.rope       = true;
    r.n_rot      = (int) hp.n_rot(il);
    r.mode       = hp.rope_type;
    r.n_ctx_orig = (int) cparams.n_ctx_orig_yarn;
    r.freq_base  = model.get_rope_freq_base(cparams, il);
    r.beta_fast  = cparams.yarn_beta_fast;
    r.beta_slow  = cparams.yarn_beta_slow;

    const float freq_scale = model.get_rope_freq_scale(cparams, il);
    const int   n_pairs    = r.n_rot / 2;

    // the model's own frequency factors (llama3 rope_freqs, LongRoPE short or long), read once
    std::vector<float> model_factors;
    if (ggml_tensor * ff = model.get_rope_factors(cparams, il); ff != nullptr && ff->buffer != nullptr) {
        GGML_ASSERT(ff->type == GGML_TYPE_F32 && ggml_nelements(ff) >= n_pairs);
        model_factors.resize(n_pairs);
        ggml_backend_tensor_get(ff, model_factors.data(), 0, sizeof(float) * n_pairs);
    }

    if (locret_naive_rope()) {
        r.freq_scale   = freq_scale;
        r.ext_factor   = cparams.yarn_ext_factor;
        r.attn_factor  = cparams.yarn_attn_factor;
        r.freq_factors = model_factors;
        return r;
    }

    // the model rotates pair i at position p by p*w_i with w_i = base^(-2i/n_rot) / ff_i * (s*(1 - m_i) + m_i),
    // where s is the frequency scale and m_i YaRN's ramp mix. Folding everything but base^(-2i/n_rot) into the
    // factors and rotating with scale 1, no YaRN and attention factor 1 gives the same angles and a magnitude of 1.
    float corr_dims[2] = { 0.0f, 0.0f };
    ggml_rope_yarn_corr_dims(r.n_rot, r.n_ctx_orig, r.freq_base, r.beta_fast, r.beta_slow, corr_dims);
    r.freq_factors.resize(n_pairs);
    for (int i = 0; i < n_pairs; ++i) {
        const float ff  = model_factors.empty() ? 1.0f : model_factors[i];
        const float mix = cparams.yarn_ext_factor != 0.0f ? locret_yarn_ramp(corr_dims[0], corr_dims[1], 2 * i) * cparams.yarn_ext_factor : 0.0f;
        r.freq_factors[i] = ff / (freq_scale * (1.0f - mix) + mix);
    }
    r.freq_scale  = 1.0f;
    r.ext_factor  = 0.0f;
    r.attn_factor = 1.0f;
    return r;
}

//
// moves
//

void * locret_host_block::reserve(ggml_backend_buffer_type_t host_buft, size_t n) {
    if (base != nullptr && n <= size) {
        return base;
    }
    buf.reset();
    plain.clear();
    plain.shrink_to_fit();
    base = nullptr;
    if (host_buft != nullptr) {
        buf.reset(ggml_backend_buft_alloc_buffer(host_buft, std::max<size_t>(n, 1)));
        if (buf != nullptr) {
            base = ggml_backend_buffer_get_base(buf.get());
        } else {
            LLAMA_LOG_WARN("%s: Locret: no pinned host memory for %.1f MiB of eviction transfers; using pageable memory\n",
                    __func__, n / 1024.0 / 1024.0);
        }
    }
    if (base == nullptr) {
        plain.resize(std::max<size_t>(n, 1));
        base = plain.data();
    }
    size = n;
    return base;
}

ggml_backend_buffer_type_t locret_host_buft_for(const ggml_tensor * t) {
    if (t == nullptr || t->buffer == nullptr || ggml_backend_buffer_is_host(t->buffer)) {
        return nullptr;
    }
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(t->buffer));
    return dev != nullptr ? ggml_backend_dev_host_buffer_type(dev) : nullptr;
}

void locret_moves::allocate(const std::vector<size_t> & cap, ggml_backend_buffer_type_t cache_buft, bool kv_rows) {
    size_t n_total = 0;
    for (size_t c : cap) {
        n_total += c;
    }
    const int64_t ne = (int64_t) std::max<size_t>(n_total, 1);
    ggml_init_params ip = { 5 * ggml_tensor_overhead(), nullptr, /*.no_alloc =*/ true };
    buf.reset();
    ctx.reset(ggml_init(ip));
    t_src   = ggml_new_tensor_1d(ctx.get(), GGML_TYPE_I32, ne);
    t_dst   = ggml_new_tensor_1d(ctx.get(), GGML_TYPE_I64, ne);
    t_delta = ggml_new_tensor_1d(ctx.get(), GGML_TYPE_I32, ne);
    ggml_set_name(t_src, "locret_move_src");
    ggml_set_name(t_dst, "locret_move_dst");
    ggml_set_name(t_delta, "locret_move_delta");
    t_kv_src = kv_rows ? ggml_new_tensor_1d(ctx.get(), GGML_TYPE_I32, ne) : nullptr;
    t_kv_dst = kv_rows ? ggml_new_tensor_1d(ctx.get(), GGML_TYPE_I64, ne) : nullptr;
    if (kv_rows) {
        ggml_set_name(t_kv_src, "locret_move_kv_src");
        ggml_set_name(t_kv_dst, "locret_move_kv_dst");
    }
    buf.reset(ggml_backend_alloc_ctx_tensors_from_buft(ctx.get(), cache_buft));
    if (!buf) {
        throw std::runtime_error("failed to allocate the Locret compaction's move tables");
    }

    int64_t * dst64;
    int32_t * src32;
    int32_t * dlt32;
    // LOCRET_DEBUG_STAGED_MOVES=1: a cache in host memory also keeps the arrays apart and copies them into the tables
    // at every eviction, as for a device (tests check that path on a CPU)
    const char * env = getenv("LOCRET_DEBUG_STAGED_MOVES");
    staged = !ggml_backend_buffer_is_host(buf.get()) || (env != nullptr && atoi(env) != 0);
    int64_t * kv_dst64 = nullptr;
    int32_t * kv_src32 = nullptr;
    if (!staged) {
        dst64 = (int64_t *) t_dst->data;
        src32 = (int32_t *) t_src->data;
        dlt32 = (int32_t *) t_delta->data;
        if (kv_rows) {
            kv_dst64 = (int64_t *) t_kv_dst->data;
            kv_src32 = (int32_t *) t_kv_src->data;
        }
    } else {
        // the I64 arrays first, so that every array is aligned
        const size_t n_arrays64 = kv_rows ? 2 : 1;
        const size_t n_arrays32 = kv_rows ? 3 : 2;
        auto * base = (uint8_t *) host.reserve(locret_host_buft_for(t_src),
                (size_t) ne * (n_arrays64 * sizeof(int64_t) + n_arrays32 * sizeof(int32_t)));
        dst64 = (int64_t *) base;
        src32 = (int32_t *) (base + n_arrays64 * ne * sizeof(int64_t));
        dlt32 = src32 + ne;
        if (kv_rows) {
            kv_dst64 = dst64 + ne;
            kv_src32 = dlt32 + ne;
        }
    }
    layer.assign(cap.size(), {});
    size_t at = 0;
    for (size_t i = 0; i < cap.size(); ++i) {
        layer[i].src   = src32 + at;
        layer[i].dst   = dst64 + at;
        layer[i].delta = dlt32 + at;
        layer[i].kv_src = kv_rows ? kv_src32 + at : nullptr;
        layer[i].kv_dst = kv_rows ? kv_dst64 + at : nullptr;
        layer[i].cap   = cap[i];
        layer[i].at    = at;
        at += cap[i];
    }
}

void locret_moves::upload() const {
    if (!staged) {
        return;
    }
    // three to five copies per layer (about 90 for SmolLM2): each waited for, they cost a GPU about 1 ms per eviction
    // and an RPC server a round trip each; queued, none
    auto set = [this](ggml_tensor * t, const void * data, size_t offset, size_t size) {
        if (queue != nullptr) {
            ggml_backend_tensor_set_async(queue, t, data, offset, size);
        } else {
            ggml_backend_tensor_set(t, data, offset, size);
        }
    };
    for (const auto & m : layer) {
        const size_t n = n_stack > 0 ? n_stack : m.n; // stacked: the padding too
        if (n == 0) {
            continue;
        }
        set(t_src,   m.src,   m.at * sizeof(int32_t), n * sizeof(int32_t));
        set(t_dst,   m.dst,   m.at * sizeof(int64_t), n * sizeof(int64_t));
        set(t_delta, m.delta, m.at * sizeof(int32_t), n * sizeof(int32_t));
        if (m.kv_src != nullptr) {
            set(t_kv_src, m.kv_src, m.at * sizeof(int32_t), n * sizeof(int32_t));
            set(t_kv_dst, m.kv_dst, m.at * sizeof(int64_t), n * sizeof(int64_t));
        }
    }
}

size_t locret_moves::device_bytes() const {
    return buf ? ggml_backend_buffer_get_size(buf.get()) : 0;
}

void locret_moves::clear() {
    for (auto & l : layer) {
        l.n = 0;
        l.n_copy = 0;
    }
    for (auto & r : in_place) {
        r.n = 0;
    }
    n_stack = 0;
}

void locret_moves::allocate_in_place() {
    in_place.assign(layer.size(), {});
    for (size_t i = 0; i < layer.size(); ++i) {
        in_place[i].row.resize(layer[i].cap);
        in_place[i].delta.resize(layer[i].cap);
        if (layer[i].kv_src != nullptr) {
            in_place[i].kv_row.resize(layer[i].cap);
        }
    }
}

void locret_moves::finish() {
    for (size_t i = 0; i < layer.size(); ++i) {
        layer_moves & m = layer[i];
        m.n_copy = m.n;
        if (i >= in_place.size() || in_place[i].n == 0) {
            continue;
        }
        in_place_rows & r = in_place[i];
        GGML_ASSERT(m.n + r.n <= m.cap);
        for (size_t j = 0; j < r.n; ++j) {
            m.src[m.n + j] = (int32_t) r.row[j];
            m.dst[m.n + j] = r.row[j];
        }
        std::copy(r.delta.begin(), r.delta.begin() + r.n, m.delta + m.n);
        if (m.kv_src != nullptr) {
            for (size_t j = 0; j < r.n; ++j) {
                m.kv_src[m.n + j] = (int32_t) r.kv_row[j];
                m.kv_dst[m.n + j] = r.kv_row[j];
            }
        }
        m.n += r.n;
        r.n = 0;
    }
}

// A row of `row_bytes` is copied as 4-byte words (no round trip through F32) when it is a whole number of words;
// LOCRET_DEBUG_CONVERT_ROWS=1 converts every row through F32 instead (tests compare both). 0: through F32.
static int64_t locret_words_per_row(size_t row_bytes) {
    if (row_bytes % sizeof(float) != 0 || getenv("LOCRET_DEBUG_CONVERT_ROWS") != nullptr) {
        return 0;
    }
    return (int64_t) (row_bytes / sizeof(float));
}

// layer i's tensor ts[i] at ts[0] + i*stride in one buffer, each of one type and shape: an alias over all of them as
// [ne0, n_rows, n_layer] rows of `row_bytes` (in `type`), or NULL
static ggml_tensor * locret_stack_alias(ggml_context * ctx, const std::vector<ggml_tensor *> & ts, ggml_type type,
        int64_t ne0, size_t row_bytes, int64_t n_rows) {
    const ggml_tensor * t0 = ts.empty() ? nullptr : ts[0];
    if (t0 == nullptr || t0->data == nullptr || t0->buffer == nullptr || !ggml_is_contiguous(t0) ||
            (size_t) n_rows * row_bytes > ggml_nbytes(t0)) {
        return nullptr;
    }
    size_t stride = ggml_nbytes(t0);
    if (ts.size() > 1) {
        if (ts[1] == nullptr || (const char *) ts[1]->data < (const char *) t0->data + ggml_nbytes(t0)) {
            return nullptr; // overlapping or descending: not a stack
        }
        stride = (size_t) ((const char *) ts[1]->data - (const char *) t0->data);
    }
    for (size_t i = 0; i < ts.size(); ++i) {
        const ggml_tensor * t = ts[i];
        if (t == nullptr || t->buffer != t0->buffer || t->type != t0->type || !ggml_are_same_shape(t, t0) ||
                !ggml_are_same_stride(t, t0) || (const char *) t->data != (const char *) t0->data + i * stride) {
            return nullptr;
        }
    }
    ggml_tensor * a = ggml_new_tensor_3d(ctx, type, ne0, n_rows, (int64_t) ts.size());
    GGML_ASSERT(a->nb[1] == row_bytes);
    a->nb[2]  = stride;
    a->nb[3]  = stride * ts.size();
    a->data   = t0->data;
    a->buffer = t0->buffer;
    return a;
}

void locret_moves::make_stack(const std::vector<locret_kv_layer> & layers, bool v_trans, int64_t kv_size,
        int64_t n_stream) {
    stack = {};
    const char * env = getenv("LOCRET_DEBUG_COMPACT_PER_LAYER");
    if (layers.empty() || (env != nullptr && atoi(env) != 0)) {
        return;
    }
    const locret_kv_layer & L0 = layers[0];
    // the tables must hold each layer's part at an even spacing too (the same room in every layer)
    for (size_t i = 0; i < layers.size(); ++i) {
        const locret_kv_layer & L = layers[i];
        if (L.n_head_kv != L0.n_head_kv || L.d_k != L0.d_k || L.d_v != L0.d_v || (L.score != nullptr) != (L0.score != nullptr) ||
                i >= layer.size() || layer[i].cap != layer[0].cap || layer[i].at != i * layer[0].cap) {
            return;
        }
    }
    const int64_t n_rows = (int64_t) L0.n_head_kv * kv_size * n_stream;
    ggml_init_params ip = { 5 * ggml_tensor_overhead(), nullptr, /*.no_alloc =*/ true };
    stack.ctx.reset(ggml_init(ip));
    ggml_context * ctx = stack.ctx.get();
    std::vector<ggml_tensor *> k(layers.size()), v(layers.size()), sc(layers.size());
    for (size_t i = 0; i < layers.size(); ++i) {
        k[i]  = layers[i].k;
        v[i]  = layers[i].v;
        sc[i] = layers[i].score;
    }
    const size_t k_row = ggml_row_size(L0.k->type, L0.d_k);
    const size_t v_row = ggml_row_size(L0.v->type, L0.d_v);
    const int64_t k_words = locret_words_per_row(k_row);
    const int64_t v_words = locret_words_per_row(v_row);
    stack.k       = locret_stack_alias(ctx, k, L0.k->type, L0.d_k, k_row, n_rows);
    stack.k_words = k_words > 0 ? locret_stack_alias(ctx, k, GGML_TYPE_F32, k_words, k_row, n_rows) : nullptr;
    if (!v_trans) {
        stack.v       = locret_stack_alias(ctx, v, L0.v->type, L0.d_v, v_row, n_rows);
        stack.v_words = v_words > 0 ? locret_stack_alias(ctx, v, GGML_TYPE_F32, v_words, v_row, n_rows) : nullptr;
    }
    if (L0.score != nullptr && L0.score->type == GGML_TYPE_F32) {
        stack.score = locret_stack_alias(ctx, sc, GGML_TYPE_F32, 1, sizeof(float), n_rows);
    }
    // one set of RoPE parameters for every layer, in the exact form (no magnitude factor: a change of 0 is the
    // identity), and keys that rotate through F32 without loss (a quantized K goes through the Hadamard matmul)
    bool alike = L0.rot.rope && L0.rot.ext_factor == 0.0f && L0.rot.attn_factor == 1.0f &&
                 (L0.k->type == GGML_TYPE_F32 || L0.k->type == GGML_TYPE_F16 || L0.k->type == GGML_TYPE_BF16);
    for (const auto & L : layers) {
        const locret_rerotation & a = L.rot;
        const locret_rerotation & b = L0.rot;
        alike = alike && a.rope == b.rope && a.n_rot == b.n_rot && a.mode == b.mode && a.n_ctx_orig == b.n_ctx_orig &&
                a.freq_base == b.freq_base && a.freq_scale == b.freq_scale && a.ext_factor == b.ext_factor &&
                a.attn_factor == b.attn_factor && a.beta_fast == b.beta_fast && a.beta_slow == b.beta_slow &&
                a.freq_factors == b.freq_factors;
    }
    stack.rotates = alike;
    stack.n_rows  = n_rows;
    if (stack.k != nullptr) {
        ggml_set_name(stack.k, "locret_k_layers");
    }
}

void locret_moves::prepare(const std::vector<locret_kv_layer> & layers) {
    n_stack = 0;
    const locret_layer_stack & S = stack;
    const bool k_ok = rotate ? S.k != nullptr && S.rotates : S.k_words != nullptr || S.k != nullptr;
    const bool v_ok = S.v_words != nullptr || S.v != nullptr;
    // scores kept but not stacked: the per-layer graph moves them
    const bool s_ok = layers.empty() || (layers[0].score != nullptr) == (S.score != nullptr);
    if (!k_ok || !v_ok || !s_ok || layer.size() != layers.size()) {
        return;
    }
    size_t n = 0;
    for (const auto & m : layer) {
        n = std::max(n, m.n);
    }
    if (n == 0) {
        return;
    }
    for (auto & m : layer) {
        if (m.n == n) {
            continue;
        }
        // a row no move of this layer writes: copied onto itself it stays as it is (the reads come before the writes:
        // get_rows and set_rows are two ops)
        int64_t lo = INT64_MAX;
        int64_t hi = -1;
        for (size_t j = 0; j < m.n; ++j) {
            lo = std::min(lo, m.dst[j]);
            hi = std::max(hi, m.dst[j]);
        }
        int64_t row = m.n == 0 ? 0 : hi + 1 < S.n_rows ? hi + 1 : lo > 0 ? lo - 1 : -1;
        if (row < 0) {
            std::vector<uint8_t> written((size_t) S.n_rows, 0);
            for (size_t j = 0; j < m.n; ++j) {
                written[(size_t) m.dst[j]] = 1;
            }
            row = (int64_t) (std::find(written.begin(), written.end(), 0) - written.begin());
            GGML_ASSERT(row < S.n_rows); // a layer moves fewer rows than it has
        }
        std::fill(m.src + m.n, m.src + n, (int32_t) row);
        std::fill(m.dst + m.n, m.dst + n, row);
        std::fill(m.delta + m.n, m.delta + n, 0);
    }
    n_stack = n;
}

bool locret_moves::empty() const {
    return count() == 0;
}

size_t locret_moves::count() const {
    size_t n = 0;
    for (const auto & l : layer) {
        n += l.n;
    }
    return n;
}

//
// the graph
//

namespace {

// per layer: the V elements of a transposed V cache and the re-rotation factors, uploaded when the graph runs (with
// the move tables, which the graph reads in place)
struct locret_compact_input : llm_graph_input_i {
    struct layer_input {
        bool          moves   = false;   // the layer has moves (read from the move tables, uploaded with them)
        ggml_tensor * v_src   = nullptr; // I32 [n_moves*d_v] element indices of a transposed V, or NULL
        ggml_tensor * v_dst   = nullptr;
        std::vector<int32_t> v_src_data;
        std::vector<int32_t> v_dst_data;
    };

    locret_compact_input(const locret_moves & moves, const std::vector<locret_kv_layer> & layers, const llama_kv_cache * kv)
        : moves(moves), layers(layers), kv(kv) {}

    void set_input(const llama_ubatch * ubatch) override {
        GGML_UNUSED(ubatch);
        moves.upload();
        for (size_t i = 0; i < inp.size(); ++i) {
            const layer_input & li = inp[i];
            if (!li.moves) {
                continue;
            }
            if (li.v_src != nullptr) {
                ggml_backend_tensor_set(li.v_src, li.v_src_data.data(), 0, ggml_nbytes(li.v_src));
                ggml_backend_tensor_set(li.v_dst, li.v_dst_data.data(), 0, ggml_nbytes(li.v_dst));
            }
        }
        if (k_rot != nullptr) {
            kv->set_input_k_rot(k_rot);
        }
    }

    std::vector<layer_input> inp;
    ggml_tensor * k_rot = nullptr; // the Hadamard rotation of a quantized K cache, or NULL

    const locret_moves                 & moves;
    const std::vector<locret_kv_layer> & layers;
    const llama_kv_cache               * kv;
};

// element indices of a transposed V for the moving rows: row (strm*kv_size + cell)*n_head_kv + head holds, for
// dimension j of the head, the element (strm*n_embd_v_gqa + head*d_v + j)*kv_size + cell
template <typename idx_t>
void locret_v_trans_elements(const idx_t * rows, size_t n_rows, uint32_t n_head_kv, uint32_t d_v, int64_t kv_size,
        std::vector<int32_t> & out) {
    const int64_t n_embd_v_gqa = (int64_t) n_head_kv * d_v;
    out.resize(n_rows * d_v);
    for (size_t m = 0; m < n_rows; ++m) {
        const int64_t head = rows[m] % n_head_kv;
        const int64_t slot = rows[m] / n_head_kv; // strm*kv_size + cell
        const int64_t strm = slot / kv_size;
        const int64_t cell = slot % kv_size;
        for (uint32_t j = 0; j < d_v; ++j) {
            const int64_t e = (strm * n_embd_v_gqa + head * d_v + j) * kv_size + cell;
            GGML_ASSERT(e <= INT32_MAX);
            out[m * d_v + j] = (int32_t) e;
        }
    }
}

// A cache's rows [n_rows] as rows of 4-byte words, for moves that only copy: get_rows and set_rows then copy each
// row's bytes as they are (F16 or quantized rows without a round trip through F32, which would cost 4 bytes per element
// in the graph and a quantization per row). ggml has no bit-cast op, so this is a view of the cache whose type and
// shape are set by hand; F32 get_rows and set_rows only load and store the words, on every backend. NULL when a row is
// not a whole number of words (the caller converts through F32 then).
static ggml_tensor * locret_rows_as_words(ggml_context * ctx, ggml_tensor * cache, int64_t row_elems, int64_t n_rows) {
    const size_t  row_bytes = ggml_row_size(cache->type, row_elems);
    const int64_t n_words   = locret_words_per_row(row_bytes);
    if (n_words == 0) {
        return nullptr;
    }
    // a view of the whole cache, then reinterpreted: same data, same byte extent
    ggml_tensor * w = ggml_view_1d(ctx, cache, ggml_nelements(cache), 0);
    GGML_ASSERT((size_t) n_rows * row_bytes <= ggml_nbytes(cache));
    w->type  = GGML_TYPE_F32;
    w->ne[0] = n_words;
    w->ne[1] = n_rows;
    w->ne[2] = w->ne[3] = 1;
    w->nb[0] = sizeof(float);
    w->nb[1] = row_bytes;
    w->nb[2] = w->nb[3] = row_bytes * n_rows;
    return w;
}

// The stacked form (moves.prepare chose it): every layer's part of the tables is n_stack entries at an even spacing, so
// a run of layers is one [n, layers] index view, and each kind of storage one get_rows and one set_rows over the run.
// A run's gathered rows (F32 keys to re-rotate, or the words copied) stay within LOCRET_COMPACT_RUN_BYTES: the
// compaction's compute buffer is then bounded whatever the layer count. Over all layers at once it held every
// layer's moved keys twice in F32 (gathered, then rotated), four times the F16 keys the budget holds: 90.7 MiB for
// SmolLM2 at b 2048, beside a 56 MiB cache. Runs cost a few nodes each (a kernel launch each on a GPU).
static constexpr size_t LOCRET_COMPACT_RUN_BYTES = 8u << 20;

// layers per run when each layer gathers `bytes_per_layer` (at least 1, at most `n_layer`).
// LOCRET_DEBUG_COMPACT_RUN_BYTES=N bounds a run by N bytes instead (tests: several runs at a small cache's budget)
static int64_t locret_layers_per_run(size_t bytes_per_layer, int64_t n_layer) {
    const char * env = getenv("LOCRET_DEBUG_COMPACT_RUN_BYTES");
    const size_t bound = env != nullptr ? (size_t) std::max(1LL, atoll(env)) : LOCRET_COMPACT_RUN_BYTES;
    return std::clamp<int64_t>((int64_t) (bound / std::max<size_t>(bytes_per_layer, 1)), 1, n_layer);
}

// layers [l0, l0 + nl) of a stacked alias [w, n_rows, L]
static ggml_tensor * locret_stack_run(ggml_context * ctx0, ggml_tensor * t, int64_t l0, int64_t nl) {
    if (l0 == 0 && nl == t->ne[2]) {
        return t; // every layer: the alias itself (no view node)
    }
    return ggml_view_3d(ctx0, t, t->ne[0], t->ne[1], nl, t->nb[1], t->nb[2], l0 * t->nb[2]);
}
// layers [l0, l0 + nl) of a move table (cap entries a layer), its first n entries each: [n, nl]
static ggml_tensor * locret_table_run(ggml_context * ctx0, ggml_tensor * table, size_t cap, int64_t n, int64_t l0, int64_t nl) {
    const size_t es = ggml_element_size(table);
    return ggml_view_2d(ctx0, table, n, nl, cap * es, l0 * cap * es);
}

// Shapes: n = n_stack, L = n_layer, nl = the layers of a run.
static void locret_build_compact_stacked(ggml_context * ctx0, ggml_cgraph * gf, const std::vector<locret_kv_layer> & layers,
        const locret_moves & moves) {
    const locret_layer_stack & S = moves.stack;
    const int64_t n   = (int64_t) moves.n_stack;
    const int64_t L   = (int64_t) layers.size();
    const size_t  cap = moves.layer[0].cap;
    // V and the scores: only the entries that move rows (the most of any layer: in the others the range reaches into
    // in-place rotations or padding, rows copied onto themselves)
    int64_t n_copy = 0;
    for (const auto & m : moves.layer) {
        n_copy = std::max(n_copy, (int64_t) m.n_copy);
    }
    // the tables' views for a run, made once (V and the scores share them when their runs agree): src I32 [rows, nl],
    // dst I64 [rows, nl]
    struct run_tables { int64_t rows, l0, nl; ggml_tensor * src, * dst; };
    std::vector<run_tables> views;
    const auto tables = [&](int64_t rows, int64_t l0, int64_t nl) -> run_tables {
        for (const auto & v : views) {
            if (v.rows == rows && v.l0 == l0 && v.nl == nl) {
                return v;
            }
        }
        views.push_back({ rows, l0, nl, locret_table_run(ctx0, moves.t_src, cap, rows, l0, nl),
                          locret_table_run(ctx0, moves.t_dst, cap, rows, l0, nl) });
        return views.back();
    };
    // rows [w, n_rows, L]: the first `rows_moved` entries of each layer's tables, a run of layers at a time
    const auto copy = [&](ggml_tensor * rows, int64_t rows_moved) {
        // get_rows gathers into F32 (4-byte words stay words)
        const int64_t per_run = locret_layers_per_run((size_t) rows_moved * rows->ne[0] * sizeof(float), L);
        for (int64_t l0 = 0; l0 < L; l0 += per_run) {
            const int64_t nl   = std::min(per_run, L - l0);
            ggml_tensor * part = locret_stack_run(ctx0, rows, l0, nl);    // [w, n_rows, nl]
            const run_tables t = tables(rows_moved, l0, nl);
            ggml_build_forward_expand(gf, ggml_set_rows(ctx0, part, ggml_get_rows(ctx0, part, t.src), t.dst));
        }
    };
    if (moves.rotate) {
        const locret_kv_layer   & L0  = layers[0];
        const locret_rerotation & rot = L0.rot;
        const int64_t per_run = locret_layers_per_run((size_t) n * L0.d_k * sizeof(float), L);
        for (int64_t l0 = 0; l0 < L; l0 += per_run) {
            const int64_t nl   = std::min(per_run, L - l0);
            ggml_tensor * part = locret_stack_run(ctx0, S.k, l0, nl);                            // [d_k, n_rows, nl]
            const run_tables t = tables(n, l0, nl);
            ggml_tensor * k_new = ggml_get_rows(ctx0, part, t.src);                              // F32 [d_k, n, nl]
            // RoPE reads one position per row from a contiguous vector
            ggml_tensor * delta = ggml_cont(ctx0, locret_table_run(ctx0, moves.t_delta, cap, n, l0, nl)); // I32 [n, nl]
            k_new = ggml_reshape_3d(ctx0, k_new, L0.d_k, 1, n * nl);                             // [d_k, 1, n*nl]
            k_new = ggml_rope_ext(ctx0, k_new, ggml_reshape_1d(ctx0, delta, n * nl), rot.factors, rot.n_rot, rot.mode,
                    rot.n_ctx_orig, rot.freq_base, rot.freq_scale, rot.ext_factor, rot.attn_factor, rot.beta_fast, rot.beta_slow);
            // a reshape (not rope, view, set_rows: CUDA fuses that pattern for one layer's 2D rows only)
            k_new = ggml_reshape_3d(ctx0, k_new, L0.d_k, n, nl);                                 // [d_k, n, nl]
            ggml_build_forward_expand(gf, ggml_set_rows(ctx0, part, k_new, t.dst));
        }
    } else {
        copy(S.k_words != nullptr ? S.k_words : S.k, n);
    }
    if (n_copy == 0) {
        return;
    }
    if (S.score != nullptr) {
        copy(S.score, n_copy);
    }
    copy(S.v_words != nullptr ? S.v_words : S.v, n_copy);
}

// K of one layer in the general form: one row per (stream, cell, head), copied as words when no key is re-rotated,
// else through F32 and rotated by each unit's position delta. Shapes: src I32 [n_moves], dst I64 [n_moves].
static void locret_build_compact_k(ggml_context * ctx0, ggml_cgraph * gf, const locret_kv_layer & L,
        const locret_moves::layer_moves & m, const locret_moves & moves, ggml_tensor * k_rot, ggml_tensor * src,
        ggml_tensor * dst, int64_t n_moves, int64_t n_rows) {
    const bool k_rotates = L.rot.rope && moves.rotate;
    if (ggml_tensor * k_words = k_rotates ? nullptr : locret_rows_as_words(ctx0, L.k, L.d_k, n_rows)) {
        ggml_build_forward_expand(gf, ggml_set_rows(ctx0, k_words, ggml_get_rows(ctx0, k_words, src), dst));
    } else {
        ggml_tensor * k_rows = ggml_view_2d(ctx0, L.k, L.d_k, n_rows, ggml_row_size(L.k->type, L.d_k), 0);
        ggml_tensor * k_new  = ggml_get_rows(ctx0, k_rows, src); // F32 [d_k, n_moves]
        if (k_rotates) {
            ggml_tensor * delta = ggml_view_1d(ctx0, moves.t_delta, n_moves, m.at * sizeof(int32_t));
            k_new = ggml_reshape_3d(ctx0, k_new, L.d_k, 1, n_moves);
            if (k_rot) {
                k_new = llama_mul_mat_hadamard(ctx0, k_new, k_rot); // back to the RoPE basis (rot^2 == I)
            }
            // the stored keys were rotated for their old positions: rotating by the difference moves them
            k_new = ggml_rope_ext(ctx0, k_new, delta, L.rot.factors, L.rot.n_rot, L.rot.mode, L.rot.n_ctx_orig,
                    L.rot.freq_base, L.rot.freq_scale, L.rot.ext_factor, L.rot.attn_factor, L.rot.beta_fast, L.rot.beta_slow);
            if (k_rot) {
                k_new = llama_mul_mat_hadamard(ctx0, k_new, k_rot);
            }
            // a view, not a reshape: rope, view, set_rows in a row is the pattern a backend (CUDA) fuses into one kernel
            k_new = ggml_view_2d(ctx0, k_new, L.d_k, n_moves, ggml_row_size(k_new->type, L.d_k), 0);
        }
        ggml_build_forward_expand(gf, ggml_set_rows(ctx0, k_rows, k_new, dst));
    }
}

// V of one layer in the general form: moved unchanged, as words (else through F32: a quantized row is dequantized and
// quantized again, which gives the same bytes), or as single elements of a transposed V. Shapes: src I32 [n_copy],
// dst I64 [n_copy].
static void locret_build_compact_v(ggml_context * ctx0, ggml_cgraph * gf, const locret_kv_layer & L,
        const locret_moves::layer_moves & m, bool v_trans, locret_compact_input::layer_input & li, ggml_tensor * src,
        ggml_tensor * dst, int64_t n_copy, int64_t n_rows) {
    const int64_t kv_size = L.kv_size;
    if (ggml_tensor * v_words = v_trans ? nullptr : locret_rows_as_words(ctx0, L.v, L.d_v, n_rows)) {
        ggml_build_forward_expand(gf, ggml_set_rows(ctx0, v_words, ggml_get_rows(ctx0, v_words, src), dst));
    } else if (!v_trans) {
        ggml_tensor * v_rows = ggml_view_2d(ctx0, L.v, L.d_v, n_rows, ggml_row_size(L.v->type, L.d_v), 0);
        ggml_build_forward_expand(gf, ggml_set_rows(ctx0, v_rows, ggml_get_rows(ctx0, v_rows, src), dst));
    } else {
        // a transposed V holds each (head, dimension) of a stream as a row of kv_size cells: move single elements,
        // as llama.cpp itself writes such a cache
        locret_v_trans_elements(m.kv_src != nullptr ? m.kv_src : m.src, m.n_copy, L.n_head_kv, L.d_v, kv_size, li.v_src_data);
        locret_v_trans_elements(m.kv_dst != nullptr ? m.kv_dst : m.dst, m.n_copy, L.n_head_kv, L.d_v, kv_size, li.v_dst_data);
        li.v_src = ggml_new_tensor_1d(ctx0, GGML_TYPE_I32, n_copy * L.d_v);
        li.v_dst = ggml_new_tensor_1d(ctx0, GGML_TYPE_I32, n_copy * L.d_v);
        ggml_set_input(li.v_src);
        ggml_set_input(li.v_dst);
        ggml_tensor * v_elems = ggml_view_2d(ctx0, L.v, 1, ggml_nelements(L.v), ggml_row_size(L.v->type, 1), 0);
        ggml_build_forward_expand(gf, ggml_set_rows(ctx0, v_elems, ggml_get_rows(ctx0, v_elems, li.v_src), li.v_dst));
    }
}

// One layer's moves in the general form (not stacked): its part of the move tables, then K, the scores and V; nothing
// for a layer without moves.
static void locret_build_compact_layer(ggml_context * ctx0, ggml_cgraph * gf, const locret_kv_layer & L,
        const locret_moves::layer_moves & m, const locret_moves & moves, bool v_trans, int64_t n_stream,
        ggml_tensor * k_rot, locret_compact_input::layer_input & li) {
    const int64_t n_moves = (int64_t) m.n;
    if (n_moves == 0) {
        return;
    }
    li.moves = true;
    // this layer's part of the move tables
    ggml_tensor * src = ggml_view_1d(ctx0, moves.t_src, n_moves, m.at * sizeof(int32_t));
    ggml_tensor * dst = ggml_view_1d(ctx0, moves.t_dst, n_moves, m.at * sizeof(int64_t));
    // the scores' rows are the bookkeeping's cells; K and V are rows of the layer's own cache (its group's)
    ggml_tensor * score_src = src;
    ggml_tensor * score_dst = dst;
    if (m.kv_src != nullptr) {
        src = ggml_view_1d(ctx0, moves.t_kv_src, n_moves, m.at * sizeof(int32_t));
        dst = ggml_view_1d(ctx0, moves.t_kv_dst, n_moves, m.at * sizeof(int64_t));
    }
    const int64_t kv_size = L.kv_size;
    const int64_t n_rows  = (int64_t) L.n_head_kv * kv_size * n_stream;

    locret_build_compact_k(ctx0, gf, L, m, moves, k_rot, src, dst, n_moves, n_rows);

    // the scores and V: only the entries that move rows (the rest re-rotate keys where they are)
    const int64_t n_copy = (int64_t) m.n_copy;
    if (n_copy == 0) {
        return;
    }
    if (n_copy < n_moves) {
        score_src = ggml_view_1d(ctx0, moves.t_src, n_copy, m.at * sizeof(int32_t));
        score_dst = ggml_view_1d(ctx0, moves.t_dst, n_copy, m.at * sizeof(int64_t));
        src = m.kv_src == nullptr ? score_src : ggml_view_1d(ctx0, moves.t_kv_src, n_copy, m.at * sizeof(int32_t));
        dst = m.kv_src == nullptr ? score_dst : ggml_view_1d(ctx0, moves.t_kv_dst, n_copy, m.at * sizeof(int64_t));
    }

    // the units' scores move with them (one float per (cell, KV head) row)
    if (L.score != nullptr) {
        ggml_tensor * s_rows = ggml_view_2d(ctx0, L.score, 1, ggml_nelements(L.score), sizeof(float), 0);
        ggml_build_forward_expand(gf, ggml_set_rows(ctx0, s_rows, ggml_get_rows(ctx0, s_rows, score_src), score_dst));
    }

    locret_build_compact_v(ctx0, gf, L, m, v_trans, li, src, dst, n_copy, n_rows);
}

} // namespace

ggml_cgraph * locret_build_compact_graph(llm_graph_result * res, llama_kv_cache * kv, bool v_trans,
        const std::vector<locret_kv_layer> & layers, const locret_moves & moves) {
    ggml_context * ctx0 = res->get_ctx();
    ggml_cgraph  * gf   = res->get_gf();
    const int64_t n_stream = kv->get_n_stream();

    auto inp = std::make_unique<locret_compact_input>(moves, layers, kv);
    if (moves.n_stack > 0) {
        locret_build_compact_stacked(ctx0, gf, layers, moves);
        res->add_input(std::move(inp));
        return gf;
    }
    inp->inp.resize(layers.size());
    // the Hadamard rotation of a quantized K cache, only when keys are re-rotated (an input the graph leaves unused
    // would have no memory to be set into)
    inp->k_rot = moves.rotate ? kv->build_input_k_rot(ctx0) : nullptr;

    for (size_t i = 0; i < layers.size(); ++i) {
        locret_build_compact_layer(ctx0, gf, layers[i], moves.layer[i], moves, v_trans, n_stream, inp->k_rot, inp->inp[i]);
    }

    res->add_input(std::move(inp));
    return gf;
}

bool locret_profile() {
    // read at every eviction (a few calls each): a process can turn it on and off, as the tests do
    return getenv("LOCRET_PROFILE") != nullptr;
}

locret_compact_status locret_compact(ggml_backend_sched_t sched, llm_graph_result * res, llama_kv_cache * kv, bool v_trans,
        const std::vector<locret_kv_layer> & layers, locret_moves & moves, bool fail_alloc, bool fail_compute) {
    const int64_t b0 = ggml_time_us();
    moves.prepare(layers);
    ggml_backend_sched_reset(sched);
    res->reset();
    ggml_cgraph * gf = locret_build_compact_graph(res, kv, v_trans, layers, moves);
    const int64_t b1 = ggml_time_us();
    if (fail_alloc || !ggml_backend_sched_alloc_graph(sched, gf)) {
        LLAMA_LOG_ERROR("%s: Locret: failed to allocate the compaction graph%s\n", __func__, fail_alloc ? " (injected)" : "");
        return LOCRET_COMPACT_NOT_RUN;
    }
    const int64_t p0 = ggml_time_us();
    res->set_inputs(nullptr);
    const int64_t p1 = ggml_time_us();
    if (fail_compute) {
        LLAMA_LOG_ERROR("%s: Locret: the compaction graph failed to start (injected)\n", __func__);
        return LOCRET_COMPACT_NOT_RUN;
    }
    // queued, not waited for: the next ubatch's graph runs after it on the same backends, and the next eviction waits
    // for the backend before it writes the move tables again (locret-memory.h, evict_waited)
    const ggml_status status = ggml_backend_sched_graph_compute_async(sched, gf);
    if (locret_profile()) {
        // stacked, a few nodes in all; else a few per layer that moves rows: build and allocation show what that costs
        fprintf(stderr, "locret-profile: compaction build %.2f alloc %.2f inputs %.2f compute %.2f ms (nodes %d, splits %d)\n",
                (b1 - b0) / 1e3, (p0 - b1) / 1e3, (p1 - p0) / 1e3, (ggml_time_us() - p1) / 1e3, ggml_graph_n_nodes(gf),
                ggml_backend_sched_get_n_splits(sched));
    }
    if (status != GGML_STATUS_SUCCESS) {
        LLAMA_LOG_ERROR("%s: Locret: the compaction graph failed (status %d)\n", __func__, (int) status);
        return LOCRET_COMPACT_FAILED;
    }
    return LOCRET_COMPACT_OK;
}
