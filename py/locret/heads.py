"""Retaining heads through llama-cpp-python: attach heads to a `llama_cpp.Llama` and read the
causal importance scores (CIS) that llama.cpp computes in its graph.

    import locret
    from locret import heads
    import llama_cpp

    llm = llama_cpp.Llama(model_path=..., n_ctx=2048, n_ubatch=512)
    h = heads.attach(llm, "heads.gguf")          # or heads embedded in the model file: attach(llm)
    heads.record_scores(llm)
    llm.eval(llm.tokenize(b"some text"))
    scores, positions = heads.recorded_scores(llm)   # [n_layer, n_head_kv, n_tokens], [n_tokens]

The C API behind it is ggml_ext/include/llama-locret.h.
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path

import numpy as np

from ._library import LibraryError


class HeadsError(RuntimeError):
    """Heads could not be loaded or attached; the message says why."""


class _Settings(ctypes.Structure):
    """struct llama_locret_settings: the settings a heads file recommends."""
    _fields_ = [("budget", ctypes.c_uint32), ("chunk", ctypes.c_uint32), ("stabilizers", ctypes.c_uint32),
                ("local", ctypes.c_uint32), ("pool", ctypes.c_uint32), ("query_auto", ctypes.c_uint32),
                ("positions", ctypes.c_uint32), ("position_limit", ctypes.c_uint32), ("pool_from", ctypes.c_uint32)]


_SIGNATURES = {
    "llama_locret_last_error": ([], ctypes.c_char_p),
    "llama_locret_file_has_heads": ([ctypes.c_char_p], ctypes.c_int32),
    "llama_locret_heads_load": ([ctypes.c_void_p, ctypes.c_char_p], ctypes.c_void_p),
    "llama_locret_heads_free": ([ctypes.c_void_p], None),
    "llama_locret_heads_hidden_size": ([ctypes.c_void_p], ctypes.c_int32),
    "llama_locret_heads_recommended": ([ctypes.c_void_p], _Settings),
    "llama_locret_file_recommended": ([ctypes.c_char_p, ctypes.POINTER(_Settings)], ctypes.c_int32),
    "llama_locret_positions_name": ([ctypes.c_int], ctypes.c_char_p),
    "llama_locret_set_heads": ([ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int32),
    "llama_locret_get_heads": ([ctypes.c_void_p], ctypes.c_void_p),
    "llama_locret_record_scores": ([ctypes.c_void_p, ctypes.c_bool], None),
    "llama_locret_recorded_n_tokens": ([ctypes.c_void_p], ctypes.c_int32),
    "llama_locret_recorded_scores": ([ctypes.c_void_p, ctypes.POINTER(ctypes.c_float),
                                      ctypes.POINTER(ctypes.c_int32), ctypes.c_int32], ctypes.c_int32),
    "llama_locret_recorded_sequences": ([ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32), ctypes.c_int32],
                                        ctypes.c_int32),
}
_lib_cache: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    """The libllama that llama_cpp loaded (ours: `import locret` made sure), with our signatures."""
    global _lib_cache
    if _lib_cache is None:
        import llama_cpp.llama_cpp as llama_cpp_lib

        lib = llama_cpp_lib._lib
        for name, (argtypes, restype) in _SIGNATURES.items():
            try:
                fn = getattr(lib, name)
            except AttributeError:
                raise LibraryError(f"{lib._name} has no {name}: it is not the Locret-patched libllama") from None
            fn.argtypes = argtypes
            fn.restype = restype
        _lib_cache = lib
    return _lib_cache


def _last_error() -> str:
    return (_lib().llama_locret_last_error() or b"").decode(errors="replace")


def _handles(llm) -> tuple[int, int]:
    """(llama_model *, llama_context *) of a llama_cpp.Llama."""
    model = getattr(getattr(llm, "_model", None), "model", None)
    ctx = getattr(getattr(llm, "_ctx", None), "ctx", None)
    if not model or not ctx:
        raise HeadsError("expected a loaded llama_cpp.Llama (its model or context is closed)")
    return model, ctx


def file_has_heads(path: str | os.PathLike) -> bool:
    """True if the GGUF at `path` carries retaining heads (standalone or embedded in a model)."""
    got = _lib().llama_locret_file_has_heads(os.fsencode(path))
    if got < 0:
        raise HeadsError(f"{path}: cannot be read as GGUF")
    return got == 1


class Heads:
    """Retaining heads loaded for one model; freed when no longer referenced (after detaching)."""

    def __init__(self, ptr: int, path: str):
        self._ptr = ptr
        self.path = path
        self._finalizer = weakref.finalize(self, _lib().llama_locret_heads_free, ptr)

    def free(self) -> None:
        """Free the heads now (their weights may live on a device, or behind RPC); idempotent."""
        self._finalizer()

    @property
    def hidden_size(self) -> int:
        return _lib().llama_locret_heads_hidden_size(self._ptr)

    @property
    def recommended(self) -> dict[str, int | bool | str | None]:
        """The settings the file recommends (0 where it has none). positions: where kept units sit by default with
        these heads ("compact", "inplace", "keep" or "keep:N"; None: the model's and policy's default). pool_from: the
        pooling applies to prompts of at least this many budgets (0: to every prompt; `eviction.seq_prompt`)."""
        return _recommended_dict(_lib().llama_locret_heads_recommended(self._ptr))


def file_recommended(path: str | os.PathLike) -> dict[str, int | bool | str | None] | None:
    """The settings the heads in the GGUF at `path` recommend, read by the library as its loader reads them (no model
    needed); None when the file has no heads. Raises HeadsError with the library's reason when it would refuse the
    file (unreadable, or recommendations that contradict each other)."""
    s = _Settings()
    got = _lib().llama_locret_file_recommended(os.fsencode(path), ctypes.byref(s))
    if got < 0:
        raise HeadsError(_last_error() or f"{path}: cannot be read")
    return _recommended_dict(s) if got == 1 else None


def _recommended_dict(s: _Settings) -> dict[str, int | bool | str | None]:
    return {"budget": s.budget, "chunk": s.chunk, "stabilizers": s.stabilizers, "local": s.local, "pool": s.pool,
            "pool_from": s.pool_from, "query_auto": bool(s.query_auto), "positions": positions_text(s)}


def positions_text(s: _Settings) -> str | None:
    """A recommendation's positions as --locret-positions spells them (None where the file has none)."""
    if s.positions == 0:
        return None
    name = _lib().llama_locret_positions_name(s.positions - 1).decode()
    return f"{name}:{s.position_limit}" if s.position_limit else name


def attach(llm, path: str | os.PathLike | None = None) -> Heads:
    """Load heads from `path` (default: the model file's embedded heads) and attach them to `llm`.

    The returned Heads is also kept on `llm`, so it lives as long as the Llama does."""
    model, ctx = _handles(llm)
    path = os.fspath(path if path is not None else llm.model_path)
    ptr = _lib().llama_locret_heads_load(model, os.fsencode(path))
    if not ptr:
        raise HeadsError(_last_error() or f"cannot load retaining heads from {path}")
    heads = Heads(ptr, path)
    if _lib().llama_locret_set_heads(ctx, ptr) != 0:
        raise HeadsError(_last_error())
    llm._locret_heads = heads  # the context uses the heads: keep them alive with it
    return heads


def detach(llm) -> None:
    _, ctx = _handles(llm)
    _lib().llama_locret_set_heads(ctx, None)
    llm._locret_heads = None


def record_scores(llm, enable: bool = True) -> None:
    """Start (clearing earlier records) or stop recording the CIS of every decoded ubatch."""
    _, ctx = _handles(llm)
    _lib().llama_locret_record_scores(ctx, enable)


def recorded_scores(llm) -> tuple[np.ndarray, np.ndarray]:
    """(scores [n_layer, n_head_kv, n_tokens] float32, positions [n_tokens] int32) recorded so far."""
    import llama_cpp

    model, ctx = _handles(llm)
    n_tokens = _lib().llama_locret_recorded_n_tokens(ctx)
    n_layer = llama_cpp.llama_model_n_layer(model)
    n_head_kv = llama_cpp.llama_model_n_head_kv(model)
    scores = np.zeros((n_layer, n_head_kv, n_tokens), dtype=np.float32)
    positions = np.zeros(n_tokens, dtype=np.int32)
    if n_tokens:
        got = _lib().llama_locret_recorded_scores(
            ctx, scores.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
            positions.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), n_tokens)
        if got != n_tokens:
            raise HeadsError(_last_error())
    return scores, positions


def recorded_sequences(llm) -> np.ndarray:
    """The sequence of each recorded token, int32 [n_tokens], in the order of recorded_scores."""
    _, ctx = _handles(llm)
    n_tokens = _lib().llama_locret_recorded_n_tokens(ctx)
    seq_ids = np.zeros(n_tokens, dtype=np.int32)
    if n_tokens and _lib().llama_locret_recorded_sequences(
            ctx, seq_ids.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), n_tokens) != n_tokens:
        raise HeadsError(_last_error())
    return seq_ids


def make_random(model: str | os.PathLike, out: str | os.PathLike, *, d_r: int, seed: int) -> Path:
    """Write random (untrained) heads for `model` to the heads GGUF `out`, through the converter
    (`locret convert make-random`, then conversion). Eviction runs with them as with trained
    heads, which makes them fit for speed and memory measurements, not for answers."""
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "random.safetensors"
        for args in (["make-random", "--base", model, "--d-r", d_r, "--seed", seed, "-o", ckpt],
                     ["--base", model, "--heads", ckpt, "-o", out]):
            proc = subprocess.run([sys.executable, "-m", "locret", "convert", *map(str, args)], capture_output=True,
                                  text=True)
            if proc.returncode != 0:
                raise HeadsError(f"making random heads failed: {proc.stderr.strip()[-2000:]}")
    return Path(out)


def cached_random_heads(model_path: str | os.PathLike) -> str:
    """Random heads (d_R 256, seed 0) for the model, made once into the user cache: the untrained
    baseline of the evaluations (the paper's appendix ablation)."""
    from . import cachelock, models

    cache = models.cache_dir() / "heads"
    cache.mkdir(parents=True, exist_ok=True)
    out = cache / f"random-{Path(model_path).stem}-d256-seed0.gguf"
    def build() -> None:
        partial = out.with_name(out.name + ".partial.gguf")
        make_random(model_path, partial, d_r=256, seed=0)
        partial.replace(out)

    cachelock.build_once(out, out.exists, build)
    return str(out)

