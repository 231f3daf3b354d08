"""Shape-alike benchmark models: random-weight GGUFs with the exact shapes of the models the Locret paper ran.

Speed and memory do not depend on weight values, so a model with Llama-3.1-8B-Instruct's or
Phi-3-mini-128K-instruct's exact shapes, RoPE settings and weight type gives the paper's settings on any machine
without downloading the real weights. This module holds the table of shapes (SHAPES) and the writer:

- ``write_shape_model(name, out)``: the model GGUF, streamed tensor by tensor with gguf-py's GGUFWriter (tensor
  infos first, then each tensor's data written and dropped). Matrices (attention, FFN, token embedding, output) are
  Q4_0 by default (Q8_0 or F16 on request), generated directly as random *valid* quantized blocks: random 4-bit
  (8-bit) codes and a small random f16 scale per block, chosen so that each row's dot product with a unit-RMS input
  has unit RMS (activations stay finite through every layer). No tensor is ever materialized in float. Norms are
  F32 ones; the RoPE tensors are the real ones. Peak memory is one tensor (Llama-3.1-8B Q4_0: the 295 MB embedding).
- ``write_random_heads(model, out)``: untrained retaining heads for that model (d_R 1024, as published), made by
  the project's converter in-process (``locret.convert``: ``make-random``, then conversion), so they pass the same
  checks as trained heads in llama.cpp's loader.
- ``make_shape_models(name, out_dir)``: both, into a folder named by a key of the whole specification (shape, weight
  type, seed, d_R, builder version); a second call finds them there at once. ``scripts/make_shape_models.py`` is its
  command line.

The tokenizer is fake but real to llama.cpp: an SPM (``llama``) vocabulary of the shape's size, ``<unk>`` 0, ``<s>``
1, ``</s>`` 2, the byte tokens ``<0x00>``..``<0xFF>`` (byte fallback: any text tokenizes), ``t{i}`` pieces for the
rest, and for Phi-3 its end-of-sequence token ``<|endoftext|>`` at 32000 (llama.cpp's vocabulary loader looks it up
in models named Phi-3). llama-bench feeds random token ids; llama-cli runs, with meaningless output.

Shapes (the Hugging Face configs of the real models; llama.cpp's convert_hf_to_gguf.py decides the GGUF keys):

- ``llama3.1-8b``: Llama-3.1-8B-Instruct, ``llama``, 32 layers, n_embd 4096, 32 heads / 8 KV heads of 128,
  FFN 14336, vocab 128256, RMS eps 1e-5, rope theta 500000, context 131072; llama3 RoPE scaling (factor 8,
  low/high frequency factors 1 and 4, original context 8192) as the ``rope_freqs.weight`` tensor computed the way the
  converter's LlamaModel.generate_extra_tensors does (``llama3_rope_factors``); untied output. 8,030,261,248
  parameters, as the real model.
- ``phi3-mini-128k``: Phi-3-mini-128K-instruct, ``phi3``, 32 layers, n_embd 3072, 32 heads / 32 KV heads of 96,
  FFN 8192, vocab 32064, RMS eps 1e-5, rope theta 10000, context 131072, original context 4096, sliding window
  262144 (llama.cpp disables Phi SWA); LongRoPE ``rope_factors_long.weight`` / ``rope_factors_short.weight``
  (48 values each) and ``phi3.rope.scaling.attn_factor`` = sqrt(1 + ln(131072/4096) / ln 4096) ~ 1.1902, as the
  converter's Phi3MiniModel writes them (no ``rope.scaling.type`` key: that class does not write one); fused
  ``blk.N.attn_qkv`` [n_embd -> 3 n_embd] and fused ``blk.N.ffn_up`` (gate and up, [n_embd -> 2 FFN]) as
  llama.cpp's phi3 loader expects; untied output. 3,821,079,552 parameters, as the real model.
  The LongRoPE factors are those of the current config.json of microsoft/Phi-3-mini-128k-instruct (the June 2024
  update, which GGUF repackagers call "Phi-3.1"; the April 2024 release had other factors), taken from public
  material that quotes that config (a Microsoft evaluation script's LONGROPE_PARAMS, and a llama.cpp walkthrough
  quoting the config and dumping the converted GGUF: attn_factor 1.190238118171692, sliding_window 262144); they
  were not checked against the Hugging Face file itself, which cannot be reached from where this was written.
- ``llama3.1-8b-mini``: the same attention geometry scaled down for prefill benchmarks on a 2-core CPU (53 times
  fewer weight multiply-adds per token than the full model, 16 times fewer attention ones per cached token):
  8 layers, 8 heads / 2 KV heads of 128 (GQA 4:1 kept), n_embd 1024, FFN 3584 (the FFN/n_embd ratio 3.5 kept),
  vocab 32000, all RoPE settings unchanged.
- ``smollm2-135m``: SmolLM2-135M-Instruct, the project's default model, for GPU machines its 98 MB file cannot
  travel to: ``llama``, 30 layers, n_embd 576, 9 heads / 3 KV heads of 64, FFN 1536, vocab 49152, RMS eps 1e-5,
  rope theta 100000, context 8192, no RoPE scaling, output tied to the token embedding (Q8_0, as llama-quantize
  wrote it in the shipped file); its matrices Q4_1 as the shipped file with ``--weight-type q4_1``. 134,515,008
  parameters, as the real model.
- ``phi3-mini-128k-mini``: 8 layers, 8 heads / 8 KV heads of 96 (no GQA, as Phi-3-mini), n_embd 768, FFN 2048
  (ratio 8/3 kept), vocab 32064, LongRoPE factors, attention factor and contexts unchanged.
- ``smollm2-soak``: the default model's architecture made small enough that 10M tokens of chat pass through an
  evicting context in about an hour on a 2-core CPU (``scripts/soak.py --standin``): 4 layers, n_embd 192, 3 heads /
  1 KV head of 64 (GQA 3:1 and head size kept), FFN 512 (ratio 8/3 kept), vocab 49152, rope theta 100000, 8K
  window, tied output.

Dependencies: numpy and gguf-py for the model (gguf is imported from ``third_party/llama.cpp/gguf-py`` when it is
not installed); torch and safetensors for the heads (the converter's ``make-random`` and checkpoint reader); tqdm
for progress bars when present.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from . import cachelock
from ._library import REPO_ROOT

try:
    import gguf
except ImportError:  # a bare tree (no pip install): the pinned llama.cpp's own gguf-py
    sys.path.insert(0, str(REPO_ROOT / "third_party" / "llama.cpp" / "gguf-py"))
    import gguf

# bump when the bytes written for a given specification change (cached builds are then rebuilt)
BUILDER_VERSION = 1
PUBLISHED_D_R = 1024  # the Locret paper's retaining-head hidden size


class ShapeError(RuntimeError):
    """A shape model cannot be written; the message says why."""


# Phi-3-mini-128K-instruct's LongRoPE factors (rope_scaling.long_factor / short_factor of its config.json, one per
# rotated pair of a 96-wide head): see the module docstring for where they come from.
PHI3_MINI_128K_LONG_FACTOR = (
    1.0700000524520874, 1.1200000047683716, 1.149999976158142, 1.4199999570846558, 1.5699999332427979,
    1.7999999523162842, 2.129999876022339, 2.129999876022339, 3.009999990463257, 5.910000324249268,
    6.950000286102295, 9.070000648498535, 9.930000305175781, 10.710000038146973, 11.130000114440918,
    14.609999656677246, 15.409998893737793, 19.809999465942383, 37.279998779296875, 38.279998779296875,
    38.599998474121094, 40.12000274658203, 46.20000457763672, 50.940006256103516, 53.66000747680664,
    54.9373893737793, 56.89738845825195, 57.28738784790039, 59.98738479614258, 60.86738586425781,
    60.887386322021484, 61.71739196777344, 62.91739273071289, 62.957393646240234, 63.41739273071289,
    63.8173942565918, 63.83739471435547, 63.897396087646484, 63.93739700317383, 64.06739807128906,
    64.11434936523438, 64.12435150146484, 64.15435028076172, 64.19435119628906, 64.24435424804688,
    64.57435607910156, 64.69000244140625, 64.76000213623047,
)
PHI3_MINI_128K_SHORT_FACTOR = (
    1.1, 1.1, 1.1, 1.3000000000000003, 1.3500000000000003, 1.3500000000000003, 1.4000000000000004,
    1.5500000000000005, 2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001,
    2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001,
    2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001,
    2.000000000000001, 2.000000000000001, 2.000000000000001, 2.0500000000000007, 2.0500000000000007,
    2.0500000000000007, 2.0500000000000007, 2.0500000000000007, 2.0500000000000007, 2.1000000000000005,
    2.1000000000000005, 2.1500000000000004, 2.25, 2.25, 2.25, 2.25, 2.25, 2.3999999999999995, 2.4499999999999993,
    2.499999999999999, 2.6999999999999984, 2.6999999999999984, 2.7499999999999982, 2.799999999999998,
    2.8999999999999977, 3.049999999999997,
)


SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2 of every fake vocabulary
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2


@dataclass(frozen=True)
class Shape:
    """Everything about a model that the GGUF's keys and tensor shapes carry (weights are random)."""

    name: str
    stands_for: str
    arch: str                     # general.architecture: llama or phi3
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    rms_eps: float
    rope_theta: float
    n_ctx_train: int
    n_ctx_orig: int               # the pre-extension context of the RoPE scaling
    rope_scaling: str             # "llama3" (rope_freqs tensor), "longrope" (long/short factor tensors) or "none"
    llama3_factor: float = 0.0
    llama3_low_freq_factor: float = 0.0
    llama3_high_freq_factor: float = 0.0
    long_factor: tuple[float, ...] = ()
    short_factor: tuple[float, ...] = ()
    sliding_window: int | None = None   # phi3.attention.sliding_window as the converter writes it
    add_bos: bool = True
    eos: tuple[int, str] = (2, "</s>")  # (id, text) of the end-of-sequence token
    tied_output: bool = False     # no output.weight: llama.cpp reuses token_embd (SmolLM2)
    embd_type: str | None = None  # the token embedding's weight type when not the matrices' (llama-quantize's choice)

    def __post_init__(self):
        if self.arch not in ("llama", "phi3"):
            raise ShapeError(f"{self.name}: architecture {self.arch!r} is not supported (llama, phi3)")
        if self.n_embd != self.n_head * self.head_dim:
            raise ShapeError(f"{self.name}: n_embd {self.n_embd} != n_head {self.n_head} x head_dim {self.head_dim}")
        if self.n_head % self.n_head_kv:
            raise ShapeError(f"{self.name}: n_head {self.n_head} is not a multiple of n_head_kv {self.n_head_kv}")
        if self.rope_scaling == "longrope":
            if not (len(self.long_factor) == len(self.short_factor) == self.head_dim // 2):
                raise ShapeError(f"{self.name}: LongRoPE needs {self.head_dim // 2} long and short factors")
        elif self.rope_scaling not in ("llama3", "none"):
            raise ShapeError(f"{self.name}: unknown RoPE scaling {self.rope_scaling!r}")
        if self.arch == "phi3" and self.rope_scaling != "longrope":
            raise ShapeError(f"{self.name}: phi3 shapes carry LongRoPE factors")
        if self.n_vocab < 3 + 256:
            raise ShapeError(f"{self.name}: the vocabulary needs at least 259 tokens (3 special, 256 bytes)")
        if not (self.eos[0] == EOS_ID or 3 + 256 <= self.eos[0] < self.n_vocab):
            raise ShapeError(f"{self.name}: the end-of-sequence token id {self.eos[0]} is not in the vocabulary")

    @property
    def n_embd_kv(self) -> int:
        return self.n_head_kv * self.head_dim

    @property
    def attn_factor(self) -> float:
        """LongRoPE's attention factor as convert_hf_to_gguf.py's Phi3MiniModel computes it (1 without scaling)."""
        scale = self.n_ctx_train / self.n_ctx_orig
        return math.sqrt(1 + math.log(scale) / math.log(self.n_ctx_orig)) if scale > 1.0 else 1.0


_LLAMA31 = dict(arch="llama", head_dim=128, rms_eps=1e-5, rope_theta=500000.0, n_ctx_train=131072, n_ctx_orig=8192,
                rope_scaling="llama3", llama3_factor=8.0, llama3_low_freq_factor=1.0, llama3_high_freq_factor=4.0,
                add_bos=True)
_PHI3_128K = dict(arch="phi3", head_dim=96, rms_eps=1e-5, rope_theta=10000.0, n_ctx_train=131072, n_ctx_orig=4096,
                  rope_scaling="longrope", long_factor=PHI3_MINI_128K_LONG_FACTOR,
                  short_factor=PHI3_MINI_128K_SHORT_FACTOR, sliding_window=262144, add_bos=False,
                  eos=(32000, "<|endoftext|>"))

SHAPES: dict[str, Shape] = {s.name: s for s in [
    Shape("llama3.1-8b", "Llama-3.1-8B-Instruct", n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, n_ff=14336,
          n_vocab=128256, **_LLAMA31),
    Shape("phi3-mini-128k", "Phi-3-mini-128K-instruct", n_layer=32, n_embd=3072, n_head=32, n_head_kv=32,
          n_ff=8192, n_vocab=32064, **_PHI3_128K),
    Shape("llama3.1-8b-mini", "Llama-3.1-8B-Instruct, scaled down (head size, GQA 4:1 and RoPE kept)",
          n_layer=8, n_embd=1024, n_head=8, n_head_kv=2, n_ff=3584, n_vocab=32000, **_LLAMA31),
    Shape("smollm2-135m", "SmolLM2-135M-Instruct", arch="llama", n_layer=30, n_embd=576, n_head=9, n_head_kv=3,
          head_dim=64, n_ff=1536, n_vocab=49152, rms_eps=1e-5, rope_theta=100000.0, n_ctx_train=8192,
          n_ctx_orig=8192, rope_scaling="none", tied_output=True, embd_type="q8_0"),
    Shape("phi3-mini-128k-mini", "Phi-3-mini-128K-instruct, scaled down (head size 96 and LongRoPE kept)",
          n_layer=8, n_embd=768, n_head=8, n_head_kv=8, n_ff=2048, n_vocab=32064, **_PHI3_128K),
    Shape("smollm2-soak", "SmolLM2-135M-Instruct, scaled down for the 10M-token soak (GQA 3:1, head size, RoPE, "
          "vocabulary and window kept)", arch="llama", n_layer=4, n_embd=192, n_head=3, n_head_kv=1, head_dim=64,
          n_ff=512, n_vocab=49152, rms_eps=1e-5, rope_theta=100000.0, n_ctx_train=8192, n_ctx_orig=8192,
          rope_scaling="none", tied_output=True, embd_type="q8_0"),
]}


def shape(name_or_shape: str | Shape) -> Shape:
    if isinstance(name_or_shape, Shape):
        return name_or_shape
    if name_or_shape not in SHAPES:
        raise ShapeError(f"unknown shape {name_or_shape!r}; known: {', '.join(SHAPES)}")
    return SHAPES[name_or_shape]


# --- RoPE tensors ---------------------------------------------------------------------------------------------------

def llama3_rope_factors(head_dim: int, theta: float, factor: float, low_freq_factor: float, high_freq_factor: float,
                        n_ctx_orig: int) -> np.ndarray:
    """Llama-3.1's per-pair frequency divisors (the rope_freqs tensor), float32 like the converter computes them.

    Each rotated pair i has the frequency theta^(-2i/d) and the wavelength 2 pi / frequency. Wavelengths shorter than
    n_ctx_orig / high_freq_factor keep their frequency (divisor 1); longer than n_ctx_orig / low_freq_factor are
    divided by `factor`; in between, the divisor blends the two: with s = (n_ctx_orig / wavelength - low) /
    (high - low), the frequency becomes (1 - s) / factor + s times the original, so the divisor is its inverse.
    """
    f32 = np.float32
    exponents = np.arange(0, head_dim, 2, dtype=f32) / f32(head_dim)
    freqs = f32(1.0) / np.power(f32(theta), exponents, dtype=f32)
    wavelengths = f32(2 * math.pi) / freqs
    blend = (f32(n_ctx_orig) / wavelengths - f32(low_freq_factor)) / f32(high_freq_factor - low_freq_factor)
    blended = f32(1.0) / ((f32(1.0) - blend) / f32(factor) + blend)
    short_wave = wavelengths < f32(n_ctx_orig / high_freq_factor)
    long_wave = wavelengths > f32(n_ctx_orig / low_freq_factor)
    out = np.where(short_wave, f32(1.0), np.where(long_wave, f32(factor), blended))
    return out.astype(f32)


def rope_tensors(s: Shape) -> dict[str, np.ndarray]:
    """The F32 RoPE tensors of the shape's GGUF, by tensor name."""
    if s.rope_scaling == "none":
        return {}
    if s.rope_scaling == "llama3":
        return {"rope_freqs.weight": llama3_rope_factors(s.head_dim, s.rope_theta, s.llama3_factor,
                                                         s.llama3_low_freq_factor, s.llama3_high_freq_factor,
                                                         s.n_ctx_orig)}
    return {"rope_factors_long.weight": np.asarray(s.long_factor, dtype=np.float32),
            "rope_factors_short.weight": np.asarray(s.short_factor, dtype=np.float32)}


# --- the tensor plan ------------------------------------------------------------------------------------------------

WEIGHT_TYPES = {
    "q4_0": (gguf.GGMLQuantizationType.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
    "q4_1": (gguf.GGMLQuantizationType.Q4_1, gguf.LlamaFileType.MOSTLY_Q4_1),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
}
F32 = gguf.GGMLQuantizationType.F32


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]     # numpy order (rows, columns): llama.cpp's ne reversed
    ggml_type: gguf.GGMLQuantizationType
    kind: str                  # "matrix" (random), "norm" (ones) or "rope" (the real factors)

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        block, type_size = gguf.GGML_QUANT_SIZES[self.ggml_type]
        return self.n_elements // block * type_size


def plan_tensors(s: Shape, weight_type: str = "q4_0") -> list[PlannedTensor]:
    """Every tensor of the model GGUF, in file order, with the shapes llama.cpp's loader expects for the arch."""
    if weight_type not in WEIGHT_TYPES:
        raise ShapeError(f"unknown weight type {weight_type!r}; known: {', '.join(WEIGHT_TYPES)}")
    qtype = WEIGHT_TYPES[weight_type][0]

    def matrix(name: str, n_out: int, n_in: int, mtype: gguf.GGMLQuantizationType = qtype) -> PlannedTensor:
        block = gguf.GGML_QUANT_SIZES[mtype][0]
        if n_in % block:
            raise ShapeError(f"{s.name}: {name} has rows of {n_in} values, not a multiple of the {weight_type} "
                             f"block ({block})")
        return PlannedTensor(name, (n_out, n_in), mtype, "matrix")

    def norm(name: str) -> PlannedTensor:
        return PlannedTensor(name, (s.n_embd,), F32, "norm")

    e, q, kv, ff = s.n_embd, s.n_head * s.head_dim, s.n_embd_kv, s.n_ff
    embd_q = WEIGHT_TYPES[s.embd_type][0] if s.embd_type else qtype
    tensors = [matrix("token_embd.weight", s.n_vocab, e, embd_q)]
    for il in range(s.n_layer):
        b = f"blk.{il}"
        tensors.append(norm(f"{b}.attn_norm.weight"))
        if s.arch == "llama":
            tensors += [matrix(f"{b}.attn_q.weight", q, e), matrix(f"{b}.attn_k.weight", kv, e),
                        matrix(f"{b}.attn_v.weight", kv, e)]
        else:  # phi3: Q, K and V in one projection
            tensors.append(matrix(f"{b}.attn_qkv.weight", q + 2 * kv, e))
        tensors += [matrix(f"{b}.attn_output.weight", e, q), norm(f"{b}.ffn_norm.weight")]
        if s.arch == "llama":
            tensors += [matrix(f"{b}.ffn_gate.weight", ff, e), matrix(f"{b}.ffn_up.weight", ff, e)]
        else:  # phi3: gate and up in one projection
            tensors.append(matrix(f"{b}.ffn_up.weight", 2 * ff, e))
        tensors.append(matrix(f"{b}.ffn_down.weight", e, ff))
    tensors.append(norm("output_norm.weight"))
    if not s.tied_output:
        tensors.append(matrix("output.weight", s.n_vocab, e))
    tensors += [PlannedTensor(name, values.shape, F32, "rope") for name, values in rope_tensors(s).items()]
    return tensors


def n_parameters(s: Shape) -> int:
    """Parameters of the real model (every planned tensor but the RoPE factors, which are not weights)."""
    return sum(t.n_elements for t in plan_tensors(s, "f16") if t.kind != "rope")


# --- key/values and the tokenizer -----------------------------------------------------------------------------------

def vocabulary(s: Shape) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(tokens, scores, token types) of the fake SPM vocabulary; the end-of-sequence token where the real model has
    it (Phi-3: <|endoftext|> at 32000, which llama.cpp's vocabulary loader looks up for models named Phi-3)."""
    tokens = list(SPECIAL_TOKENS) + [f"<0x{b:02X}>" for b in range(256)]
    first_piece = len(tokens)
    tokens += [f"t{i}" for i in range(first_piece, s.n_vocab)]
    eos_id, eos_text = s.eos
    tokens[eos_id] = eos_text
    types = np.full(s.n_vocab, int(gguf.TokenType.NORMAL), dtype=np.int32)
    types[UNK_ID] = gguf.TokenType.UNKNOWN
    types[BOS_ID] = types[EOS_ID] = types[eos_id] = gguf.TokenType.CONTROL
    types[len(SPECIAL_TOKENS):first_piece] = gguf.TokenType.BYTE
    scores = np.zeros(s.n_vocab, dtype=np.float32)
    scores[first_piece:] = -np.arange(s.n_vocab - first_piece, dtype=np.float32)  # earlier pieces merge first
    return tokens, scores, types


def _add_key_values(w: gguf.GGUFWriter, s: Shape, weight_type: str) -> None:
    """The keys convert_hf_to_gguf.py writes for the real model (LlamaModel / Phi3MiniModel), then the vocabulary."""
    w.add_type("model")
    w.add_name(f"{s.stands_for} shape (random weights)")
    w.add_block_count(s.n_layer)
    w.add_context_length(s.n_ctx_train)
    w.add_embedding_length(s.n_embd)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_rope_dimension_count(s.head_dim)
    w.add_file_type(WEIGHT_TYPES[weight_type][1])
    if s.arch == "llama":
        w.add_vocab_size(s.n_vocab)
    if s.rope_scaling == "longrope":
        w.add_rope_scaling_orig_ctx_len(s.n_ctx_orig)
        w.add_rope_scaling_attn_factors(s.attn_factor)
    if s.sliding_window is not None:
        w.add_sliding_window(s.sliding_window)
    if WEIGHT_TYPES[weight_type][0] != gguf.GGMLQuantizationType.F16:
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    tokens, scores, types = vocabulary(s)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores.tolist())
    w.add_token_types(types.tolist())
    w.add_unk_token_id(UNK_ID)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(s.eos[0])
    w.add_add_bos_token(s.add_bos)
    w.add_add_eos_token(False)


# --- random tensor data ---------------------------------------------------------------------------------------------

# RMS of the integer codes: Q4_0 stores q in 0..15 and means (q - 8) * d (Q4_1 means q * d + m, written with
# m = -8 d: the same values); Q8_0 stores int8 q and means q * d.
# Uniform codes: E[(q - 8)^2] = 255/12 + 1/4 = 21.5, E[q^2] = 65535/12 + 1/4 = 5461.5.
_CODE_RMS = {gguf.GGMLQuantizationType.Q4_0: math.sqrt(21.5), gguf.GGMLQuantizationType.Q4_1: math.sqrt(21.5),
             gguf.GGMLQuantizationType.Q8_0: math.sqrt(5461.5),
             gguf.GGMLQuantizationType.F16: math.sqrt(5461.5)}


def _scale(n_in: int, ggml_type: gguf.GGMLQuantizationType) -> float:
    """Mean per-value scale giving weights of RMS 1/sqrt(n_in): a row's dot product with a unit-RMS input is O(1)."""
    return 1.0 / (_CODE_RMS[ggml_type] * math.sqrt(n_in))


def random_matrix(rows: int, n_in: int, ggml_type: gguf.GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """A random matrix in `ggml_type`: uint8 block bytes [rows, bytes per row] for Q4_0/Q4_1/Q8_0, float16 for F16.

    A quantized block is its f16 scale d (Q4_1: then its f16 offset m = -8 d) followed by the codes; the codes are
    random bytes (uniform 4-bit or 8-bit values) and d is drawn from 256 values between 0.5 and 1.5 times `_scale`,
    picked by one of the block's own random code bytes (no second random stream for 250 million blocks)."""
    base = _scale(n_in, ggml_type)
    if ggml_type == gguf.GGMLQuantizationType.F16:
        codes = rng.integers(-128, 128, size=(rows, n_in), dtype=np.int8)
        return codes.astype(np.float16) * np.float16(base)
    block, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    n_blocks = rows * n_in // block
    data = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    table = (base * np.linspace(0.5, 1.5, 256)).astype("<f2").view(np.uint8).reshape(256, 2)
    picked = data[:, 2].copy()
    data[:, 0:2] = table[picked]
    if ggml_type == gguf.GGMLQuantizationType.Q4_1:  # m = -8 d after d
        data[:, 2:4] = (-8 * base * np.linspace(0.5, 1.5, 256)).astype("<f2").view(np.uint8).reshape(256, 2)[picked]
    return data.reshape(rows, n_in // block * type_size)


def _tensor_data(t: PlannedTensor, s: Shape, rng: np.random.Generator) -> np.ndarray:
    if t.kind == "norm":
        return np.ones(t.shape, dtype=np.float32)
    if t.kind == "rope":
        return rope_tensors(s)[t.name]
    return random_matrix(t.shape[0], t.shape[1], t.ggml_type, rng)


def _progress(total: int, desc: str, enabled: bool):
    try:
        from tqdm import tqdm
    except ImportError:  # progress is optional
        enabled = False
    if not enabled:
        class _Silent:
            def update(self, n): pass
            def close(self): pass
        return _Silent()
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024)


def write_shape_model(shape_name: str | Shape, out_path: str | os.PathLike, *, weight_type: str = "q4_0",
                      seed: int = 0, progress: bool = True) -> Path:
    """Write the random-weight model of `shape_name` (a SHAPES name, or a Shape) to `out_path`; return the path.

    Written to `<out>.partial` and renamed when complete. Tensor data is generated and written one tensor at a time.
    """
    s = shape(shape_name)
    plan = plan_tensors(s, weight_type)
    out = Path(out_path)
    partial = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(partial, s.arch)
    try:
        _add_key_values(writer, s, weight_type)
        for t in plan:
            if t.kind == "matrix" and t.ggml_type != gguf.GGMLQuantizationType.F16:
                # quantized data is passed as its bytes, [rows, bytes per row]; gguf-py turns that into elements
                byte_shape = (t.shape[0], t.nbytes // t.shape[0])
                writer.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), t.nbytes, raw_dtype=t.ggml_type)
            else:
                dtype = np.float16 if t.ggml_type == gguf.GGMLQuantizationType.F16 else np.float32
                writer.add_tensor_info(t.name, t.shape, np.dtype(dtype), t.nbytes)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        rng = np.random.default_rng(seed)
        bar = _progress(sum(t.nbytes for t in plan), f"{s.name} {weight_type}", progress)
        for t in plan:
            data = _tensor_data(t, s, rng)
            assert data.nbytes == t.nbytes, (t.name, data.nbytes, t.nbytes)
            writer.write_tensor_data(data)
            bar.update(t.nbytes)
            del data
        bar.close()
        writer.close()
        os.replace(partial, out)
    finally:
        writer.close()
        partial.unlink(missing_ok=True)
    return out


# --- retaining heads ------------------------------------------------------------------------------------------------

def write_random_heads(model_path: str | os.PathLike, out_path: str | os.PathLike, *, d_r: int = PUBLISHED_D_R,
                       seed: int = 0, weight_type: str = "f16") -> Path:
    """Untrained retaining heads for the model GGUF at `model_path`, through the project's converter in-process:
    random heads in the published checkpoint format (bf16, nn.Linear init), then converted for that model (Q/K column
    permutation for llama, the model's shape checked) with the converter's default locret.recommended.* settings.
    Needs torch and safetensors."""
    from .convert.cli import DEFAULT_BUDGET, DEFAULT_CHUNK, DEFAULT_LOCAL, DEFAULT_STABILIZERS
    from .convert.conversion import ConversionRequest, convert, make_random
    from .convert.errors import ConversionError
    from .convert.gguf_output import Recommended

    model, out = Path(model_path), Path(out_path)
    try:
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=".heads-") as tmp:
            checkpoint = Path(tmp) / "random.safetensors"
            make_random(model, checkpoint, d_r, seed, "bf16")
            convert(ConversionRequest(
                heads=checkpoint, out=out, base=model, merge_into=None, weight_type=weight_type, name=None,
                skip_qk_permutation=False,
                recommended=Recommended(budget=DEFAULT_BUDGET, chunk=DEFAULT_CHUNK, stabilizers=DEFAULT_STABILIZERS,
                                        local=DEFAULT_LOCAL)))
    except ConversionError as e:
        raise ShapeError(f"random heads for {model}: {e}") from None
    return out


# --- both, cached ---------------------------------------------------------------------------------------------------

def cache_folder() -> Path:
    from . import models

    return models.cache_dir() / "shapes"


def build_key(s: Shape, weight_type: str, seed: int, d_r: int) -> str:
    blob = json.dumps({"shape": asdict(s), "weight_type": weight_type, "seed": seed, "d_r": d_r,
                       "builder": BUILDER_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class ShapeBuild:
    folder: Path
    model: Path
    heads: Path


def build_paths(shape_name: str | Shape, out_dir: str | os.PathLike | None = None, *, weight_type: str = "q4_0",
                seed: int = 0, d_r: int = PUBLISHED_D_R) -> ShapeBuild:
    """Where make_shape_models puts (or finds) the files of this specification."""
    s = shape(shape_name)
    folder = Path(out_dir) if out_dir is not None else cache_folder()
    folder = folder / f"{s.name}-{weight_type}-{build_key(s, weight_type, seed, d_r)}"
    return ShapeBuild(folder, folder / f"{s.name}-{weight_type}.gguf", folder / f"{s.name}-heads-d{d_r}.gguf")


def make_shape_models(shape_name: str | Shape, out_dir: str | os.PathLike | None = None, *,
                      weight_type: str = "q4_0", seed: int = 0, d_r: int = PUBLISHED_D_R,
                      progress: bool = True, log=None) -> tuple[Path, Path]:
    """(model GGUF, heads GGUF) of the shape, written into `out_dir` (default: the cache, $LOCRET_CACHE_DIR/shapes)
    under a folder named by the specification's key; found there at once when already made."""
    s = shape(shape_name)
    paths = build_paths(s, out_dir, weight_type=weight_type, seed=seed, d_r=d_r)

    def built() -> bool:
        return (paths.folder / "done.json").is_file() and paths.model.is_file() and paths.heads.is_file()

    cachelock.build_folder_once(paths.folder, built, lambda staging: _write_into(
        s, paths, staging, weight_type=weight_type, seed=seed, d_r=d_r, progress=progress, log=log))
    return paths.model, paths.heads


def _write_into(s: Shape, paths: ShapeBuild, staging: Path, *, weight_type: str, seed: int, d_r: int, progress: bool,
                log) -> None:
    log = log or (lambda msg: print(f"locret.shapes: {msg}", file=sys.stderr, flush=True))
    log(f"writing {s.name} ({s.stands_for}), {weight_type}, into {paths.folder}")
    started = time.perf_counter()
    write_shape_model(s, staging / paths.model.name, weight_type=weight_type, seed=seed, progress=progress)
    model_s = time.perf_counter() - started
    log(f"model written in {model_s:.1f} s; random heads d_R {d_r}")
    started = time.perf_counter()
    write_random_heads(staging / paths.model.name, staging / paths.heads.name, d_r=d_r, seed=seed)
    heads_s = time.perf_counter() - started
    (staging / "done.json").write_text(json.dumps(
        {"shape": asdict(s), "weight_type": weight_type, "seed": seed, "d_r": d_r, "builder": BUILDER_VERSION,
         "seconds": {"model": round(model_s, 2), "heads": round(heads_s, 2)}}, indent=1))


__all__ = ["SHAPES", "Shape", "ShapeError", "PlannedTensor", "plan_tensors", "n_parameters", "llama3_rope_factors",
           "rope_tensors", "write_shape_model", "write_random_heads", "make_shape_models", "build_paths"]
