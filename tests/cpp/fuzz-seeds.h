// What the fuzzers of the heads loader share (the seeded mutation fuzzer fuzz-locret-heads and the coverage-guided
// lf-locret-heads): a valid seed heads file for a model, and writing an input to a file.
#pragma once

#include "heads-header.h"
#include "llama.h"

#include "ggml.h"
#include "gguf.h"

#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

// the seed: random F32 heads for `model`, d_R 4
static std::vector<uint8_t> seed_heads(const llama_model * model, const std::string & path, size_t & data_offset) {
    const uint32_t n_layer   = llama_model_n_layer(model);
    const uint32_t n_head_kv = llama_model_n_head_kv(model);
    const uint32_t d_r       = 4;

    gguf_context * gguf = gguf_init_empty();
    const uint32_t d_in = heads_header(gguf, model, n_layer, d_r);
    gguf_set_val_u32 (gguf, "locret.recommended.budget", 1024);

    ggml_init_params ip = { /*.mem_size =*/ 4 * n_layer * (ggml_tensor_overhead() + (d_in + 2 * n_head_kv + 2) * d_r * sizeof(float)) + 4096,
                            /*.mem_buffer =*/ nullptr, /*.no_alloc =*/ false };
    ggml_context * ctx = ggml_init(ip);
    std::mt19937 rng(1234);
    std::normal_distribution<float> normal(0.0f, 0.1f);
    for (uint32_t il = 0; il < n_layer; ++il) {
        ggml_tensor * t[4] = {
            ggml_new_tensor_2d(ctx, GGML_TYPE_F32, d_in, d_r), ggml_new_tensor_2d(ctx, GGML_TYPE_F32, d_r, n_head_kv),
            ggml_new_tensor_1d(ctx, GGML_TYPE_F32, d_r),       ggml_new_tensor_1d(ctx, GGML_TYPE_F32, n_head_kv) };
        ggml_format_name(t[0], "locret.blk.%u.fc1.weight", il);
        ggml_format_name(t[1], "locret.blk.%u.fc2.weight", il);
        ggml_format_name(t[2], "locret.blk.%u.fc1.bias", il);
        ggml_format_name(t[3], "locret.blk.%u.fc2.bias", il);
        for (ggml_tensor * x : t) {
            for (int64_t i = 0; i < ggml_nelements(x); ++i) {
                ((float *) x->data)[i] = normal(rng);
            }
            gguf_add_tensor(gguf, x);
        }
    }
    gguf_write_to_file(gguf, path.c_str(), false);
    data_offset = gguf_get_meta_size(gguf);
    gguf_free(gguf);
    ggml_free(ctx);

    std::vector<uint8_t> bytes;
    FILE * f = std::fopen(path.c_str(), "rb");
    if (f == nullptr) {
        return bytes;
    }
    std::fseek(f, 0, SEEK_END);
    bytes.resize((size_t) std::ftell(f));
    std::fseek(f, 0, SEEK_SET);
    const size_t n = std::fread(bytes.data(), 1, bytes.size(), f);
    std::fclose(f);
    bytes.resize(n);
    return bytes;
}

static bool write_file(const std::string & path, const uint8_t * data, size_t size) {
    FILE * f = std::fopen(path.c_str(), "wb");
    if (f == nullptr) {
        return false;
    }
    const bool ok = size == 0 || std::fwrite(data, 1, size, f) == size;
    return std::fclose(f) == 0 && ok;
}

static bool write_file(const std::string & path, const std::vector<uint8_t> & bytes) {
    return write_file(path, bytes.data(), bytes.size());
}

