// Compaction: after a selection, the rows of the retained units are moved to the cells the layout gives them and
// their keys are re-rotated by the change of their RoPE position (locret-memory.h: compact positions put the kept
// units in cells 0..n-1 in order; in-place and kept positions copy the chunk's survivors into the holes, and in place
// re-rotates the keys that stay where they are). A move carries the unit's K row, V row and score; re-rotation touches
// K only. Only rows that move or re-rotate are read or written (stacked layers also copy a padding row onto itself in
// the layers that move fewer rows than the most).
#pragma once

#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-cpp.h"

#include <cstdint>
#include <vector>

struct llama_context;
struct llama_cparams;
struct llama_model;
class  llama_kv_cache;
class  llm_graph_result;

// ggml_rope_ext parameters that rotate one layer's stored keys by a position change. The exact form (the default) is
// a pure rotation by the angles the model's own RoPE uses per position: YaRN's ramp, the frequency scale, llama3's
// rope_freqs and LongRoPE's factors are folded into per-pair frequency factors, and the magnitude factors that
// ggml_rope_ext applies with them (YaRN's mscale, rope.scaling.attn_factor) are left out, so that a key rotated
// again and again keeps the magnitude the model gave it once. LOCRET_DEBUG_NAIVE_ROPE=1 selects the model's own
// parameters instead (the key grows by the attention factor at every rotation): tests use it to show the difference.
struct locret_rerotation {
    bool  rope = false; // the layer has RoPE: its keys move with their positions
    int   n_rot = 0;
    int   mode  = 0;
    int   n_ctx_orig  = 0;
    float freq_base   = 10000.0f;
    float freq_scale  = 1.0f;
    float ext_factor  = 0.0f;
    float attn_factor = 1.0f;
    float beta_fast   = 32.0f;
    float beta_slow   = 1.0f;
    std::vector<float> freq_factors; // [n_rot/2], or empty for none
    // the same factors resident beside the layer's keys, set once when the memory is made (NULL when empty): a graph
    // input would be placed on the CPU backend and copied into a GPU's part of every graph that rotates, and ggml's
    // scheduler waits for that backend before each such copy
    ggml_tensor * factors = nullptr;
};

// the re-rotation of model layer il's keys for a context with these parameters (reads the model's frequency factors)
locret_rerotation locret_rerotation_make(const llama_model & model, const llama_cparams & cparams, uint32_t il);

// one evicting cache's layer, as the compaction sees it
struct locret_kv_layer {
    uint32_t      il        = 0; // model layer
    uint32_t      n_head_kv = 0;
    uint32_t      d_k       = 0; // head sizes
    uint32_t      d_v       = 0;
    ggml_tensor * k = nullptr;   // storage [d_k*n_head_kv, kv_size, n_stream]
    ggml_tensor * v = nullptr;   // storage [d_v*n_head_kv, kv_size, n_stream] (transposed per stream when v_trans)
    ggml_tensor * score = nullptr; // the units' scores F32 [n_head_kv, n_cells*n_stream], moved with them; or NULL
    locret_rerotation rot;
    // a budget schedule's layer groups (locret_layer_groups): the group whose cache holds the layer, and that cache's
    // cells per stream (kv_size above); the cells every sequence's bookkeeping uses (n_cells) without groups
    uint32_t group   = 0;
    int64_t  kv_size = 0;
};

// Host memory that a device reads from or writes into at every eviction: page-locked (a device's host buffer type)
// when the cache lives on a device, so that a copy is one DMA transfer instead of a copy staged through pageable
// memory; ordinary memory otherwise. Grows only; its contents are not kept when it grows.
class locret_host_block {
public:
    // at least `size` bytes, pinned through `host_buft` when given and possible (else ordinary memory)
    void * reserve(ggml_backend_buffer_type_t host_buft, size_t size);
    void * data() const { return base; }
    bool   pinned() const { return buf != nullptr; }

private:
    ggml_backend_buffer_ptr buf;
    std::vector<uint8_t>    plain;
    void *                  base = nullptr;
    size_t                  size = 0;
};

// the pinned host buffer type for copies to and from the device that holds `t`, or NULL when `t` is in host memory
ggml_backend_buffer_type_t locret_host_buft_for(const ggml_tensor * t);

// Every layer's storage of one kind (K, V or scores) seen as one tensor, layer i at index i of dimension 2: possible
// when llama.cpp allocated the layers evenly spaced in one buffer, each of one shape and type (the usual case: the cache
// creates each layer's K and V one after the other in one context). The compaction graph then moves the rows of all
// layers with one get_rows and one set_rows per kind instead of one pair per layer, so its node count does not grow with
// the layers (on a GPU each node is a kernel launch: 16 nodes a layer made SmolLM2's 480). Aliases of the cache's own
// memory, nothing allocated; NULL where the layers are not evenly spaced (the graph is built layer by layer then).
// LOCRET_DEBUG_COMPACT_PER_LAYER=1 leaves them NULL (tests compare both forms).
struct locret_layer_stack {
    ggml_tensor * k       = nullptr; // [d_k, n_rows, n_layer] in the cache's type
    ggml_tensor * k_words = nullptr; // the same rows as 4-byte words [row bytes / 4, n_rows, n_layer], or NULL
    ggml_tensor * v       = nullptr; // [d_v, n_rows, n_layer]; NULL for a transposed V
    ggml_tensor * v_words = nullptr;
    ggml_tensor * score   = nullptr; // F32 [1, n_rows, n_layer]
    bool    rotates   = false;       // every layer re-rotates with the same parameters, exactly for a change of 0
    int64_t n_rows    = 0;           // (stream, cell, KV head) rows per layer
    ggml_context_ptr ctx;
};

// the rows one eviction moves: for every layer, a (cell, KV head) row of every stream is identified by
// (stream*kv_size + cell)*n_head_kv + head. Each layer has room for the most moves it can have (every retained unit
// of every sequence), so nothing is allocated at an eviction. The arrays of all layers are also three tensors that
// the compaction graph reads through per-layer views: in the cache's own buffer type, so that a device reads them
// in place (a graph input would go to the CPU backend and be copied to the device inside the graph). For a cache in
// host memory the arrays are those tensors; for one on a device they are pinned host memory, uploaded per eviction.
struct locret_moves {
    struct layer_moves {
        int32_t * src   = nullptr; // the row a unit leaves
        int64_t * dst   = nullptr; // the row it goes to (I64 like llama.cpp's own set_rows indices: a backend may
                                   // then fuse the re-rotation with the write)
        int32_t * delta = nullptr; // its new physical (RoPE) position minus its old one
        // with layer groups (locret_layer_groups) the K/V rows in the layer's own cache, whose cells differ from the
        // ones above (the bookkeeping's, where the scores are) by the group's gap: the same moves, rows of
        // (stream*kv_size + cell)*n_head_kv + head of that cache; NULL without groups (K/V read src and dst)
        int32_t * kv_src = nullptr;
        int64_t * kv_dst = nullptr;
        size_t    n     = 0;
        size_t    n_copy = 0;      // entries [0, n_copy) write rows to other rows (V and the scores go with them);
                                   // [n_copy, n) re-rotate keys where they are (in-place positions): K only
        size_t    cap   = 0;
        size_t    at    = 0;       // first element of the layer in the tensors
    };
    std::vector<layer_moves> layer; // per layer (index into the layer list)

    // keys re-rotated where they are (--locret-positions inplace), per layer: staged while a turn's sequences are
    // placed and appended after all of the turn's moves by finish(), so that the entries that move rows come first
    struct in_place_rows {
        std::vector<int64_t> row;    // (stream*n_cells + cell)*n_head_kv + head, as src and dst
        std::vector<int64_t> kv_row; // the same row in the layer's own cache (layer groups), else unused
        std::vector<int32_t> delta;
        size_t n = 0;
    };
    std::vector<in_place_rows> in_place; // per layer; empty unless allocate_in_place() was called
    void allocate_in_place();            // room for every layer's worst case (its cap), after allocate()
    // after a turn's placement: each layer's n_copy set, then its staged in-place rotations appended (and unstaged)
    void finish();
    bool rotate = true;             // some move re-rotates its key (kept positions mostly copy: no RoPE in the graph)
    // with the layers stacked: entries per layer in the tables, each layer's moves and then copies of a row onto
    // itself that no move writes (a change of 0 positions), so that every layer moves as many rows; 0 = per layer
    size_t n_stack = 0;
    locret_layer_stack stack;

    ggml_tensor * t_src   = nullptr; // I32 [sum of cap]
    ggml_tensor * t_dst   = nullptr; // I64 [sum of cap]
    ggml_tensor * t_delta = nullptr; // I32 [sum of cap]
    ggml_tensor * t_kv_src = nullptr; // I32 [sum of cap], with layer groups only
    ggml_tensor * t_kv_dst = nullptr; // I64 [sum of cap], with layer groups only

    // room for cap[i] moves in layer i, the tensors in `cache_buft` (with the K/V rows' own tables when kv_rows: layer
    // groups); throws when the memory cannot be had
    void allocate(const std::vector<size_t> & cap, ggml_backend_buffer_type_t cache_buft, bool kv_rows);
    // copies the moves of every layer into the tensors (nothing to copy when the arrays are the tensors): queued on
    // `queue` when set, in order before the compaction graph that reads them, else each copy waited for. A queued copy
    // reads the arrays when the backend gets to it: they must not change until the backend has been waited for
    // (uploads_queued(); the memory's next eviction waits before it writes them)
    void upload() const;
    bool uploads_queued() const { return staged && queue != nullptr; }
    ggml_backend_t queue = nullptr; // the backend the tables' buffer belongs to (set by the memory; NULL: none found)
    // the aliases over the layers' storage (locret_layer_stack), once the layers and the tables are known
    void make_stack(const std::vector<locret_kv_layer> & layers, bool v_trans, int64_t kv_size, int64_t n_stream);
    // the graph's form for the moves now in the tables: stacked when the aliases and the tables allow it (then the
    // padding is written and n_stack set), else per layer (n_stack 0)
    void prepare(const std::vector<locret_kv_layer> & layers);
    void clear(); // no moves; the room stays
    bool empty() const;
    size_t count() const;
    size_t device_bytes() const; // memory of the tensors

private:
    bool                    staged = false; // the arrays are apart from the tensors (host memory), copied by upload()
    locret_host_block       host;           // their memory then
    ggml_context_ptr        ctx;
    ggml_backend_buffer_ptr buf;
};

enum locret_compact_status {
    LOCRET_COMPACT_OK,
    LOCRET_COMPACT_NOT_RUN, // the graph could not be allocated or started: the cache is unchanged
    LOCRET_COMPACT_FAILED,  // the computation failed part-way: rows may be half moved
};

// LOCRET_PROFILE=1: every eviction prints the time of its steps to stderr (selection graph, host selection, compaction
// inputs and graph), to find where eviction time goes on a device
bool locret_profile();

// The graph that applies `moves` to the K/V storage of `kv` and to the layers' scores (gather the moving rows,
// re-rotate the keys, write them to their new rows), built into `res`.
// moves.prepare() chose the form: with n_stack > 0 one op per kind over the stacked layers, else layer by layer.
ggml_cgraph * locret_build_compact_graph(llm_graph_result * res, llama_kv_cache * kv, bool v_trans,
                                         const std::vector<locret_kv_layer> & layers, const locret_moves & moves);

// Build and compute that graph on `sched` (the memory's own scheduler). `fail_alloc` / `fail_compute` make the
// corresponding step report a failure without running (fault injection for tests).
locret_compact_status locret_compact(ggml_backend_sched_t sched, llm_graph_result * res, llama_kv_cache * kv, bool v_trans,
                                     const std::vector<locret_kv_layer> & layers, locret_moves & moves,
                                     bool fail_alloc, bool fail_compute);
