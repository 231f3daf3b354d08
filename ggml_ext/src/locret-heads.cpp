// Loading and validating retaining heads (convert/HEADS-FORMAT.md) for a loaded model, and reading a heads file's
// recommended settings without a model. Also the library's last-error string (locret_set_error,
// llama_locret_last_error), which every part of the extension writes.

#include "locret-heads.h"
#include "locret-hooks.h"

#include "llama-arch.h"
#include "llama-impl.h"
#include "llama-model.h"

#include "gguf.h"

#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <map>
#include <stdexcept>

static const uint32_t LOCRET_FORMAT_VERSION = 1;
static const char *   LOCRET_TENSOR_PREFIX  = "locret.";

static thread_local std::string g_last_error;

void locret_set_error(const std::string & msg) {
    g_last_error = msg;
}

const char * llama_locret_last_error(void) {
    return g_last_error.c_str();
}

bool llama_locret_is_heads_tensor(const std::string & name) {
    return name.rfind(LOCRET_TENSOR_PREFIX, 0) == 0;
}

namespace {

// FNV-1a over 64-bit words (then the tail bytes): cheap enough for hundreds of MB of heads, and enough to tell two
// heads files apart in a saved state
uint64_t locret_fingerprint(uint64_t h, const uint8_t * data, size_t n) {
    const uint64_t prime = 0x100000001b3ULL;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        std::memcpy(&w, data + i, 8);
        h = (h ^ w) * prime;
    }
    for (; i < n; ++i) {
        h = (h ^ data[i]) * prime;
    }
    return h;
}

struct gguf_deleter { void operator()(gguf_context * ctx) { gguf_free(ctx); } };
using gguf_ptr = std::unique_ptr<gguf_context, gguf_deleter>;

// typed metadata reads that throw with the key's name on absence or a wrong type
struct heads_meta_reader {
    const gguf_context * gguf;
    const std::string  & path;

    int64_t find(const char * key, gguf_type type, bool required) const {
        const int64_t id = gguf_find_key(gguf, key);
        if (id < 0) {
            if (required) {
                throw std::runtime_error(format("%s: missing required key '%s'", path.c_str(), key));
            }
            return -1;
        }
        if (gguf_get_kv_type(gguf, id) != type) {
            throw std::runtime_error(format("%s: key '%s' has type %s, expected %s", path.c_str(), key,
                    gguf_type_name(gguf_get_kv_type(gguf, id)), gguf_type_name(type)));
        }
        return id;
    }

    uint32_t u32(const char * key, bool required = true, uint32_t fallback = 0) const {
        const int64_t id = find(key, GGUF_TYPE_UINT32, required);
        return id < 0 ? fallback : gguf_get_val_u32(gguf, id);
    }

    std::string str(const char * key, bool required = true) const {
        const int64_t id = find(key, GGUF_TYPE_STRING, required);
        return id < 0 ? std::string() : std::string(gguf_get_val_str(gguf, id));
    }
};

void expect_equal(const std::string & path, const char * what, uint32_t file_value, uint32_t model_value) {
    if (file_value != model_value) {
        throw std::runtime_error(format("%s: heads are for a different model: %s is %u in the heads file but %u in the model",
                path.c_str(), what, file_value, model_value));
    }
}

locret_activation parse_activation(const std::string & path, const std::string & name) {
    if (name == "silu") { return LOCRET_ACT_SILU; }
    if (name == "gelu") { return LOCRET_ACT_GELU; }
    if (name == "relu") { return LOCRET_ACT_RELU; }
    throw std::runtime_error(format("%s: unknown activation '%s' (supported: silu, gelu, relu)", path.c_str(), name.c_str()));
}

// the meta tensor `name` with shape [ne0, ne1] (ne1 = 1 for vectors) and one of `types`, or nullptr
// when it is absent and optional
ggml_tensor * expect_tensor(ggml_context * meta, const std::string & path, const std::string & name,
        int64_t ne0, int64_t ne1, std::initializer_list<ggml_type> types, bool required) {
    ggml_tensor * t = ggml_get_tensor(meta, name.c_str());
    if (t == nullptr) {
        if (required) {
            throw std::runtime_error(format("%s: missing tensor '%s'", path.c_str(), name.c_str()));
        }
        return nullptr;
    }
    if (t->ne[0] != ne0 || t->ne[1] != ne1 || t->ne[2] != 1 || t->ne[3] != 1) {
        throw std::runtime_error(format("%s: tensor '%s' has shape [%" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 "], expected [%" PRId64 ", %" PRId64 "]",
                path.c_str(), name.c_str(), t->ne[0], t->ne[1], t->ne[2], t->ne[3], ne0, ne1));
    }
    bool type_ok = false;
    std::string allowed;
    for (ggml_type type : types) {
        type_ok = type_ok || t->type == type;
        allowed += std::string(allowed.empty() ? "" : ", ") + ggml_type_name(type);
    }
    if (!type_ok) {
        throw std::runtime_error(format("%s: tensor '%s' has type %s, expected one of %s",
                path.c_str(), name.c_str(), ggml_type_name(t->type), allowed.c_str()));
    }
    return t;
}

// the settings a heads file recommends (0 where it has none)
llama_locret_settings read_recommended(const heads_meta_reader & kv) {
    llama_locret_settings rec = {};
    rec.budget      = kv.u32("locret.recommended.budget",      false);
    rec.chunk       = kv.u32("locret.recommended.chunk",       false);
    rec.stabilizers = kv.u32("locret.recommended.stabilizers", false);
    rec.local       = kv.u32("locret.recommended.local",       false);
    rec.pool        = kv.u32("locret.recommended.pool",        false);
    if (rec.pool > 1 && rec.pool % 2 == 0) {
        throw std::runtime_error(format("%s: locret.recommended.pool must be odd (a window centred on each token), got %u",
                kv.path.c_str(), rec.pool));
    }
    rec.pool_from   = kv.u32("locret.recommended.pool_from",   false);
    if (rec.pool_from > 0 && rec.pool <= 1) {
        throw std::runtime_error(format("%s: locret.recommended.pool_from (%u budgets) needs locret.recommended.pool",
                kv.path.c_str(), rec.pool_from));
    }
    const std::string query = kv.str("locret.recommended.query", false);
    if (query != "" && query != "auto" && query != "none") {
        throw std::runtime_error(format("%s: locret.recommended.query must be \"auto\" or \"none\", got \"%s\"",
                kv.path.c_str(), query.c_str()));
    }
    rec.query_auto  = query == "auto";
    const std::string positions = kv.str("locret.recommended.positions", false);
    if (!positions.empty()) {
        int32_t mode  = 0;
        int32_t limit = 0;
        if (llama_locret_positions_parse(positions.c_str(), &mode, &limit) != 0) {
            throw std::runtime_error(format("%s: locret.recommended.positions: %s", kv.path.c_str(),
                    llama_locret_last_error()));
        }
        rec.positions      = 1 + (uint32_t) mode;
        rec.position_limit = limit > 0 ? (uint32_t) limit : 0;
    }
    return rec;
}

std::string layer_tensor_name(int il, const char * suffix) {
    return format("%sblk.%d.%s", LOCRET_TENSOR_PREFIX, il, suffix);
}

// the base model the heads were made for must be the loaded model, with uniform layers, and the file's inputs must be
// laid out as the runtime feeds them
void check_base_model(const heads_meta_reader & kv, const llama_model & model, uint32_t n_layer) {
    const std::string & path = kv.path;
    const llama_hparams & hp = model.hparams;
    const std::string model_arch = llm_arch_name(model.arch);
    const std::string base_arch  = kv.str("locret.base.architecture");
    if (base_arch != model_arch) {
        throw std::runtime_error(format("%s: heads are for architecture '%s' but the model is '%s'",
                path.c_str(), base_arch.c_str(), model_arch.c_str()));
    }
    for (uint32_t il = 1; il < n_layer; ++il) {
        if (hp.n_head(il) != hp.n_head(0) || hp.n_head_kv(il) != hp.n_head_kv(0) ||
            hp.n_embd_head_k(il) != hp.n_embd_head_k(0) || hp.n_embd_head_v(il) != hp.n_embd_head_v(0)) {
            throw std::runtime_error(format("%s: the model's layers differ in head counts or sizes (layer %u); "
                    "Locret heads support uniform layers only", path.c_str(), il));
        }
    }
    expect_equal(path, "n_layer",    kv.u32("locret.base.n_layer"),    n_layer);
    expect_equal(path, "n_head",     kv.u32("locret.base.n_head"),     hp.n_head(0));
    expect_equal(path, "n_head_kv",  kv.u32("locret.base.n_head_kv"),  hp.n_head_kv(0));
    expect_equal(path, "head_dim_k", kv.u32("locret.base.head_dim_k"), hp.n_embd_head_k(0));
    expect_equal(path, "head_dim_v", kv.u32("locret.base.head_dim_v"), hp.n_embd_head_v(0));

    const std::string input_layout = kv.str("locret.input_layout");
    if (input_layout != "q,k,v pre-rope") {
        throw std::runtime_error(format("%s: unsupported input layout '%s' (expected 'q,k,v pre-rope')", path.c_str(), input_layout.c_str()));
    }
    const std::string qk_layout = kv.str("locret.qk_layout");
    if (qk_layout != "llama.cpp") {
        throw std::runtime_error(format("%s: Q/K columns are in '%s' order; the runtime needs 'llama.cpp' order "
                "(convert the heads with convert/heads_to_gguf.py)", path.c_str(), qk_layout.c_str()));
    }
}

// the heads' sizes from the model (d_in = n_q + n_k + n_v) and the file (d_R, activation, recommended settings)
void set_head_sizes(llama_locret_heads & heads, const llama_model & model, const heads_meta_reader & kv) {
    const std::string & path = kv.path;
    const llama_hparams & hp = model.hparams;
    heads.path       = path;
    heads.model      = &model;
    heads.n_head_kv  = hp.n_head_kv(0);
    heads.n_q        = hp.n_head(0) * hp.n_embd_head_k(0);
    heads.n_k        = hp.n_head_kv(0) * hp.n_embd_head_k(0);
    heads.n_v        = hp.n_head_kv(0) * hp.n_embd_head_v(0);
    heads.d_in       = heads.n_q + heads.n_k + heads.n_v;
    heads.d_r        = kv.u32("locret.hidden_size");
    heads.activation = parse_activation(path, kv.str("locret.activation"));
    if (heads.d_r == 0) {
        throw std::runtime_error(format("%s: locret.hidden_size is 0", path.c_str()));
    }
    heads.recommended = read_recommended(kv);
}

// tensors as stored in the file
struct file_layer { ggml_tensor * fc1_w, * fc1_b, * fc2_w, * fc2_b; };

// every layer's tensors in the file, validated before allocating anything: fc1.weight [d_in, d_R],
// fc2.weight [d_R, n_head_kv], optional F32 fc1.bias [d_R] and fc2.bias [n_head_kv], the same biases in every layer
std::vector<file_layer> check_layer_tensors(ggml_context * meta, const std::string & path,
        const llama_locret_heads & heads, uint32_t n_layer) {
    const auto weight_types = { GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16, GGML_TYPE_Q8_0 };
    std::vector<file_layer> meta_layers(n_layer);
    for (uint32_t il = 0; il < n_layer; ++il) {
        file_layer & l = meta_layers[il];
        l.fc1_w = expect_tensor(meta, path, layer_tensor_name(il, "fc1.weight"), heads.d_in, heads.d_r,       weight_types, true);
        l.fc2_w = expect_tensor(meta, path, layer_tensor_name(il, "fc2.weight"), heads.d_r,  heads.n_head_kv, weight_types, true);
        l.fc1_b = expect_tensor(meta, path, layer_tensor_name(il, "fc1.bias"),   heads.d_r,       1, { GGML_TYPE_F32 }, false);
        l.fc2_b = expect_tensor(meta, path, layer_tensor_name(il, "fc2.bias"),   heads.n_head_kv, 1, { GGML_TYPE_F32 }, false);
        if ((l.fc1_b == nullptr) != (meta_layers[0].fc1_b == nullptr) || (l.fc2_b == nullptr) != (meta_layers[0].fc2_b == nullptr)) {
            throw std::runtime_error(format("%s: layer %u and layer 0 disagree on which biases exist", path.c_str(), il));
        }
    }
    const ggml_tensor * extra = ggml_get_tensor(meta, layer_tensor_name(n_layer, "fc1.weight").c_str());
    if (extra != nullptr) {
        throw std::runtime_error(format("%s: heads file has more layers than the model (%u)", path.c_str(), n_layer));
    }
    return meta_layers;
}

// whether the layers can be slices of stacked tensors (locret_heads_stack): one buffer type for all layers and each
// weight with one type in every layer
bool can_stack(const llama_model & model, const std::vector<file_layer> & meta_layers) {
    bool stack = true;
    for (uint32_t il = 0; il < (uint32_t) meta_layers.size(); ++il) {
        const file_layer & l = meta_layers[il];
        stack = stack && model.select_buft(il) == model.select_buft(0) && l.fc1_w->type == meta_layers[0].fc1_w->type &&
                l.fc2_w->type == meta_layers[0].fc2_w->type;
    }
    return stack;
}

using buft_ctx_map = std::map<ggml_backend_buffer_type_t, ggml_context *>;

// the context for buffer type `buft`, created (and owned by heads.ctxs) on first use: one context per buffer type,
// as each layer's head lives where that layer's weights live
ggml_context * heads_ctx_of(llama_locret_heads & heads, buft_ctx_map & ctx_for_buft, ggml_backend_buffer_type_t buft,
        uint32_t n_layer) {
    ggml_context *& ctx = ctx_for_buft[buft];
    if (ctx == nullptr) {
        // four tensors per layer (fc1, fc2 and their biases), as tensors or as slices of four stacked ones
        ggml_init_params ip = { /*.mem_size =*/ (4 + 4 * n_layer) * ggml_tensor_overhead(), /*.mem_buffer =*/ nullptr,
                                /*.no_alloc =*/ true };
        ctx = ggml_init(ip);
        if (ctx == nullptr) {
            throw std::runtime_error("failed to create a ggml context for the retaining heads");
        }
        heads.ctxs.emplace_back(ctx);
    }
    return ctx;
}

// the stacked tensors in `ctx` (fc1 [d_in, d_R, n_layer], fc2 [d_R, n_head_kv, n_layer], biases [ne0, 1, n_layer]),
// and each layer's tensors as views of them
void create_stacked_tensors(llama_locret_heads & heads, ggml_context * ctx, const std::vector<file_layer> & meta_layers) {
    const uint32_t n_layer = (uint32_t) meta_layers.size();
    const file_layer & l0 = meta_layers[0];
    locret_heads_stack & st = heads.stack;
    st.fc1_w = ggml_new_tensor_3d(ctx, l0.fc1_w->type, heads.d_in, heads.d_r, n_layer);
    st.fc2_w = ggml_new_tensor_3d(ctx, l0.fc2_w->type, heads.d_r, heads.n_head_kv, n_layer);
    st.fc1_b = l0.fc1_b ? ggml_new_tensor_3d(ctx, GGML_TYPE_F32, heads.d_r, 1, n_layer) : nullptr;
    st.fc2_b = l0.fc2_b ? ggml_new_tensor_3d(ctx, GGML_TYPE_F32, heads.n_head_kv, 1, n_layer) : nullptr;
    ggml_set_name(st.fc1_w, "locret.stack.fc1.weight");
    ggml_set_name(st.fc2_w, "locret.stack.fc2.weight");
    if (st.fc1_b) { ggml_set_name(st.fc1_b, "locret.stack.fc1.bias"); }
    if (st.fc2_b) { ggml_set_name(st.fc2_b, "locret.stack.fc2.bias"); }
    // layer il's tensor: the il-th [ne0, ne1] slice, named as in the file
    auto slice = [&](ggml_tensor * t, uint32_t il, const ggml_tensor * named) -> ggml_tensor * {
        if (t == nullptr) {
            return nullptr;
        }
        ggml_tensor * v = ggml_view_2d(ctx, t, t->ne[0], t->ne[1], t->nb[1], il * t->nb[2]);
        ggml_set_name(v, ggml_get_name(named));
        return v;
    };
    for (uint32_t il = 0; il < n_layer; ++il) {
        const file_layer & src = meta_layers[il];
        locret_head_layer & dst = heads.layers[il];
        dst.fc1_w = slice(st.fc1_w, il, src.fc1_w);
        dst.fc1_b = slice(st.fc1_b, il, src.fc1_b);
        dst.fc2_w = slice(st.fc2_w, il, src.fc2_w);
        dst.fc2_b = slice(st.fc2_b, il, src.fc2_b);
    }
}

// each layer's tensors on their own, shaped and named as in the file, in the context of that layer's buffer type
void create_layer_tensors(llama_locret_heads & heads, const llama_model & model, buft_ctx_map & ctx_for_buft,
        const std::vector<file_layer> & meta_layers) {
    const uint32_t n_layer = (uint32_t) meta_layers.size();
    for (uint32_t il = 0; il < n_layer; ++il) {
        ggml_context * ctx = heads_ctx_of(heads, ctx_for_buft, model.select_buft(il), n_layer);
        const file_layer & src = meta_layers[il];
        locret_head_layer & dst = heads.layers[il];
        auto dup = [&](const ggml_tensor * t) -> ggml_tensor * {
            if (t == nullptr) {
                return nullptr;
            }
            ggml_tensor * d = ggml_dup_tensor(ctx, t);
            ggml_set_name(d, ggml_get_name(t));
            return d;
        };
        dst.fc1_w = dup(src.fc1_w);
        dst.fc1_b = dup(src.fc1_b);
        dst.fc2_w = dup(src.fc2_w);
        dst.fc2_b = dup(src.fc2_b);
    }
}

// one weights buffer per context (kept in heads.bufs); returns their total size in bytes
size_t alloc_head_buffers(llama_locret_heads & heads, const buft_ctx_map & ctx_for_buft) {
    size_t total_bytes = 0;
    for (auto & [buft, ctx] : ctx_for_buft) {
        ggml_backend_buffer_ptr buf(ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft));
        if (!buf) {
            throw std::runtime_error(format("failed to allocate a %s buffer for the retaining heads", ggml_backend_buft_name(buft)));
        }
        ggml_backend_buffer_set_usage(buf.get(), GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        total_bytes += ggml_backend_buffer_get_size(buf.get());
        heads.bufs.emplace_back(std::move(buf));
    }
    return total_bytes;
}

// read the tensor data from the file into the backend buffers, folding it into heads.fingerprint
void read_head_data(llama_locret_heads & heads, const gguf_context * gguf, const std::string & path,
        const std::vector<file_layer> & meta_layers) {
    FILE * f = std::fopen(path.c_str(), "rb");
    if (f == nullptr) {
        throw std::runtime_error(format("%s: cannot open the file", path.c_str()));
    }
    std::unique_ptr<FILE, int (*)(FILE *)> file(f, std::fclose);
    std::fseek(f, 0, SEEK_END);
    const size_t file_size = (size_t) std::ftell(f);
    const size_t data_offset = gguf_get_data_offset(gguf);
    std::vector<uint8_t> staging;
    // read a file tensor into `staging`
    auto read_tensor = [&](const ggml_tensor * t) {
        const int64_t id = gguf_find_tensor(gguf, ggml_get_name(t));
        const size_t offset = data_offset + gguf_get_tensor_offset(gguf, id);
        const size_t nbytes = ggml_nbytes(t);
        if (offset + nbytes > file_size) {
            throw std::runtime_error(format("%s: tensor '%s' lies beyond the end of the file (truncated file)", path.c_str(), ggml_get_name(t)));
        }
        staging.resize(nbytes);
        if (std::fseek(f, (long) offset, SEEK_SET) != 0 || std::fread(staging.data(), 1, nbytes, f) != nbytes) {
            throw std::runtime_error(format("%s: failed to read tensor '%s'", path.c_str(), ggml_get_name(t)));
        }
        heads.fingerprint = locret_fingerprint(heads.fingerprint, staging.data(), nbytes);
    };
    for (uint32_t il = 0; il < (uint32_t) meta_layers.size(); ++il) {
        const file_layer & src = meta_layers[il];
        const locret_head_layer & dst = heads.layers[il];
        for (auto [file_t, dev_t] : { std::make_pair(src.fc1_w, dst.fc1_w), std::make_pair(src.fc1_b, dst.fc1_b),
                                      std::make_pair(src.fc2_w, dst.fc2_w), std::make_pair(src.fc2_b, dst.fc2_b) }) {
            if (file_t == nullptr) {
                continue;
            }
            read_tensor(file_t);
            ggml_backend_tensor_set(dev_t, staging.data(), 0, staging.size());
        }
    }
}

void load_heads(llama_locret_heads & heads, const llama_model & model, const std::string & path) {
    ggml_context * meta_raw = nullptr;
    gguf_init_params params = { /*.no_alloc =*/ true, /*.ctx =*/ &meta_raw };
    gguf_ptr gguf(gguf_init_from_file(path.c_str(), params));
    if (!gguf) {
        throw std::runtime_error(format("%s: cannot read the file as GGUF (missing, truncated or not GGUF)", path.c_str()));
    }
    ggml_context_ptr meta(meta_raw);
    const heads_meta_reader kv = { gguf.get(), path };

    const int64_t version_id = gguf_find_key(gguf.get(), "locret.format_version");
    if (version_id < 0) {
        throw std::runtime_error(format("%s: the file has no retaining heads (no locret.format_version key)", path.c_str()));
    }
    const uint32_t version = kv.u32("locret.format_version");
    if (version != LOCRET_FORMAT_VERSION) {
        throw std::runtime_error(format("%s: heads format version %u is not supported (this build reads version %u)",
                path.c_str(), version, LOCRET_FORMAT_VERSION));
    }

    const uint32_t n_layer = model.hparams.n_layer();
    check_base_model(kv, model, n_layer);
    set_head_sizes(heads, model, kv);
    const std::vector<file_layer> meta_layers = check_layer_tensors(meta.get(), path, heads, n_layer);

    // one context per buffer type: each layer's head lives where that layer's weights live. When that is one buffer
    // type for all and each weight has one type in every layer, the layers are slices of stacked tensors
    // (locret_heads_stack)
    const bool stack = can_stack(model, meta_layers);
    buft_ctx_map ctx_for_buft;
    heads.layers.resize(n_layer);
    if (stack) {
        create_stacked_tensors(heads, heads_ctx_of(heads, ctx_for_buft, model.select_buft(0), n_layer), meta_layers);
    } else {
        create_layer_tensors(heads, model, ctx_for_buft, meta_layers);
    }
    const size_t total_bytes = alloc_head_buffers(heads, ctx_for_buft);

    read_head_data(heads, gguf.get(), path, meta_layers);

    LLAMA_LOG_INFO("%s: loaded retaining heads from '%s': %u layers%s, d_in = %u, d_R = %u, %s, %.2f MiB\n", __func__,
            path.c_str(), n_layer, stack ? " (stacked)" : "", heads.d_in, heads.d_r, ggml_type_name(heads.layers[0].fc1_w->type),
            total_bytes / 1024.0 / 1024.0);
}

} // namespace

int32_t llama_locret_file_has_heads(const char * path) {
    gguf_init_params params = { /*.no_alloc =*/ true, /*.ctx =*/ nullptr };
    gguf_ptr gguf(gguf_init_from_file(path, params));
    if (!gguf) {
        return -1;
    }
    return gguf_find_key(gguf.get(), "locret.format_version") >= 0 ? 1 : 0;
}

int32_t llama_locret_file_recommended(const char * path, llama_locret_settings * out) {
    locret_set_error("");
    *out = {};
    gguf_init_params params = { /*.no_alloc =*/ true, /*.ctx =*/ nullptr };
    gguf_ptr gguf(path != nullptr ? gguf_init_from_file(path, params) : nullptr);
    if (!gguf) {
        locret_set_error(format("%s: cannot read the file as GGUF (missing, truncated or not GGUF)", path ? path : "(null)"));
        return -1;
    }
    if (gguf_find_key(gguf.get(), "locret.format_version") < 0) {
        return 0;
    }
    try {
        const std::string name = path;
        *out = read_recommended(heads_meta_reader{ gguf.get(), name });
    } catch (const std::exception & e) {
        locret_set_error(e.what());
        return -1;
    }
    return 1;
}

llama_locret_heads * llama_locret_heads_load(const llama_model * model, const char * path) {
    locret_set_error("");
    if (model == nullptr || path == nullptr) {
        locret_set_error("llama_locret_heads_load: model and path must not be NULL");
        return nullptr;
    }
    auto heads = std::make_unique<llama_locret_heads>();
    try {
        load_heads(*heads, *model, path);
    } catch (const std::exception & e) {
        LLAMA_LOG_ERROR("%s: %s\n", __func__, e.what());
        locret_set_error(e.what());
        return nullptr;
    }
    return heads.release();
}

void llama_locret_heads_free(llama_locret_heads * heads) {
    delete heads;
}

int32_t llama_locret_heads_hidden_size(const llama_locret_heads * heads) {
    return heads ? (int32_t) heads->d_r : 0;
}

llama_locret_settings llama_locret_heads_recommended(const llama_locret_heads * heads) {
    return heads ? heads->recommended : llama_locret_settings{};
}

uint64_t llama_locret_heads_fingerprint(const llama_locret_heads * heads) {
    return heads ? heads->fingerprint : 0;
}
