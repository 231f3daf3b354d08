"""Locret eviction through the C API (ggml_ext/include/llama-locret.h): register settings for a model,
read a context's statistics, and (for tests and heatmaps) what each layer and KV head retains."""
from __future__ import annotations

import ctypes
import functools
import os
from typing import Any, NamedTuple

import numpy as np

from .heads import Heads, HeadsError, _Settings, _lib, _last_error


class _Resolved(ctypes.Structure):
    _fields_ = [("n_cells", ctypes.c_uint32), ("n_seq", ctypes.c_uint32), ("budget_max", ctypes.c_uint32),
                ("stabilizers", ctypes.c_uint32), ("local", ctypes.c_uint32), ("n_ubatch", ctypes.c_uint32),
                ("n_cells_window", ctypes.c_uint32), ("kv_bytes", ctypes.c_uint64), ("window_bytes", ctypes.c_uint64),
                ("store_bytes", ctypes.c_uint64)]


class _Buffers(ctypes.Structure):
    _fields_ = [("evict_compute", ctypes.c_size_t), ("move_tables", ctypes.c_size_t), ("score_store", ctypes.c_size_t),
                ("compact_seq", ctypes.c_uint32), ("query_store", ctypes.c_size_t)]


class _Params(ctypes.Structure):
    _fields_ = [("heads", ctypes.c_void_p), ("budget", ctypes.c_int32),
                ("stabilizers", ctypes.c_int32), ("local", ctypes.c_int32),
                ("policy", ctypes.c_int), ("pool", ctypes.c_int32), ("policy_settings", ctypes.c_char_p),
                ("budget_schedule", ctypes.c_char_p), ("defaults", _Settings),
                ("positions", ctypes.c_int32), ("position_limit", ctypes.c_int32)]


class _PolicyTraits(ctypes.Structure):
    # struct llama_locret_policy_traits, field for field
    _fields_ = [("needs_heads", ctypes.c_bool), ("per_layer_budgets", ctypes.c_bool),
                ("reads_prompt_whole", ctypes.c_bool), ("sets_own_stabilizers", ctypes.c_bool),
                ("pools_scores", ctypes.c_bool), ("reads_cells_in_order", ctypes.c_bool),
                ("takes_pinned_query", ctypes.c_bool), ("has_settings", ctypes.c_bool)]


class PolicyTraits(NamedTuple):
    """What a policy is (llama_locret_policy_get_traits), for code that must not know policies by name."""
    needs_heads: bool           # its scores come from retaining heads: a budget without heads is refused
    per_layer_budgets: bool     # a budget schedule may give each layer its own budget
    reads_prompt_whole: bool    # it reads each prompt whole before it evicts: its cache holds the context per sequence
                                # (a prompt must fit in it), no chunk is compressed (the ubatch may exceed the budget)
    sets_own_stabilizers: bool  # it sets the stabilizers (and local tail) itself and refuses them
    pools_scores: bool          # --locret-pool averages its scores
    reads_cells_in_order: bool  # --locret-positions keep and inplace are refused with it
    takes_pinned_query: bool    # a pinned query (Locret-Q) applies to it
    has_settings: bool          # it has settings of its own (NAME:key=value)


class _Stats(ctypes.Structure):
    _fields_ = [("enabled", ctypes.c_bool), ("n_evictions", ctypes.c_uint64),
                ("n_units_evicted", ctypes.c_uint64), ("n_cells_used", ctypes.c_uint32),
                ("n_cells", ctypes.c_uint32), ("pos_logical", ctypes.c_int64),
                ("kv_bytes", ctypes.c_uint64), ("budget", ctypes.c_uint32),
                ("stabilizers", ctypes.c_uint32), ("local", ctypes.c_uint32),
                ("n_ubatch", ctypes.c_uint32), ("policy", ctypes.c_int),
                ("n_seq", ctypes.c_uint32), ("t_select_us", ctypes.c_uint64), ("t_compact_us", ctypes.c_uint64),
                ("t_readback_us", ctypes.c_uint64), ("n_pinned", ctypes.c_uint32), ("pool", ctypes.c_uint32),
                ("policy_settings", ctypes.c_char * 64),  # char[64]: the next field, a uint64, stays aligned
                ("n_compactions", ctypes.c_uint64), ("n_rows_moved", ctypes.c_uint64), ("n_rows_rotated", ctypes.c_uint64),
                ("n_rows_kept", ctypes.c_uint64), ("n_host_syncs", ctypes.c_uint64),
                ("positions", ctypes.c_int), ("position_limit", ctypes.c_uint32), ("pos_rope_next", ctypes.c_int64),
                ("n_repositions", ctypes.c_uint64), ("n_evictions_total", ctypes.c_uint64),
                ("n_units_evicted_total", ctypes.c_uint64), ("pool_window", ctypes.c_uint32),
                ("pool_from", ctypes.c_uint32)]


_SIGNATURES = {
    "llama_locret_configure_default": ([ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(_Params),
                                        ctypes.POINTER(ctypes.c_void_p)], ctypes.c_int32),
    "llama_locret_policy_from_name": ([ctypes.c_char_p, ctypes.POINTER(ctypes.c_int)], ctypes.c_int32),
    "llama_locret_policy_from_spec": ([ctypes.c_char_p, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_char_p)],
                                      ctypes.c_int32),
    "llama_locret_policy_settings_help": ([ctypes.c_int], ctypes.c_char_p),
    "llama_locret_policy_get_traits": ([ctypes.c_int, ctypes.POINTER(_PolicyTraits)], ctypes.c_int32),
    "llama_locret_policy_name": ([ctypes.c_int], ctypes.c_char_p),
    "llama_locret_policy_count": ([], ctypes.c_int32),
    "llama_locret_policy_help": ([ctypes.c_int], ctypes.c_char_p),
    "llama_locret_resolve_file": ([ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(_Params), ctypes.c_void_p,
                                   ctypes.POINTER(_Resolved)], ctypes.c_int32),
    "llama_locret_resolve_file_layers": ([ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(_Params), ctypes.c_void_p,
                                          ctypes.POINTER(_Resolved), ctypes.POINTER(ctypes.c_uint64),
                                          ctypes.POINTER(ctypes.c_uint32), ctypes.c_int32], ctypes.c_int32),
    "llama_locret_budget_for_mib": ([ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(_Params), ctypes.c_void_p,
                                     ctypes.c_double, ctypes.POINTER(_Resolved)], ctypes.c_int32),
    "llama_locret_check_params": ([ctypes.c_void_p, ctypes.POINTER(_Params), ctypes.c_void_p], ctypes.c_int32),
    "llama_locret_kv_cells": ([ctypes.c_void_p, ctypes.POINTER(_Params), ctypes.c_uint32, ctypes.c_uint32],
                              ctypes.c_int64),
    "llama_locret_find_question": ([ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int32], ctypes.c_int32),
    "llama_locret_find_prompt_question": ([ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int32],
                                          ctypes.c_int32),
    "llama_locret_prompt_layout": ([ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                                   ctypes.c_int32], ctypes.c_int32),
    "llama_locret_chat_query_message": ([ctypes.POINTER(ctypes.c_char_p), ctypes.c_int32, ctypes.c_bool],
                                        ctypes.c_int32),
    "llama_locret_pin_room": ([], ctypes.c_int32),
    "llama_locret_query_layout": ([ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int32], ctypes.c_int32),
    "llama_locret_is_evicting": ([ctypes.c_void_p], ctypes.c_bool),
    "llama_locret_model_configure": ([ctypes.c_void_p, ctypes.POINTER(_Params)], ctypes.c_int32),
    "llama_locret_get_stats": ([ctypes.c_void_p], _Stats),
    "llama_locret_retained": ([ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32,
                               ctypes.POINTER(ctypes.c_int32), ctypes.c_int32], ctypes.c_int32),
    "llama_locret_debug_read_kv": ([ctypes.c_void_p, ctypes.c_int32, ctypes.c_bool,
                                    ctypes.POINTER(ctypes.c_float), ctypes.c_int32], ctypes.c_int32),
    "llama_locret_get_seq_stats": ([ctypes.c_void_p, ctypes.c_int32], _Stats),
    "llama_locret_seq_room": ([ctypes.c_void_p, ctypes.c_int32], ctypes.c_int32),
    "llama_locret_retained_seq": ([ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32,
                                   ctypes.POINTER(ctypes.c_int32), ctypes.c_int32], ctypes.c_int32),
    "llama_locret_debug_read_kv_seq": ([ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_bool,
                                        ctypes.POINTER(ctypes.c_float), ctypes.c_int32], ctypes.c_int32),
    "llama_locret_debug_inject_fault": ([ctypes.c_void_p, ctypes.c_int], ctypes.c_int32),
    "llama_locret_debug_read_scores": ([ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_float),
                                        ctypes.c_int32], ctypes.c_int32),
    "llama_locret_debug_read_query": ([ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_float),
                                       ctypes.c_int32, ctypes.POINTER(ctypes.c_float)], ctypes.c_int32),
    "llama_locret_pin_query": ([ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32], ctypes.c_int32),
    "llama_locret_seq_prompt": ([ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32], ctypes.c_int32),
    "llama_locret_query_tokens": ([ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32), ctypes.c_int32, ctypes.c_char_p,
                                   ctypes.c_int32], ctypes.c_int32),
    "llama_locret_model_set_budget_schedule": ([ctypes.c_void_p, ctypes.c_char_p], ctypes.c_int32),
    "llama_locret_positions_parse": ([ctypes.c_char_p, ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32)],
                                     ctypes.c_int32),
    "llama_locret_model_set_positions": ([ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32], ctypes.c_int32),
    "llama_locret_debug_rope_positions": ([ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32,
                                           ctypes.POINTER(ctypes.c_int32), ctypes.c_int32], ctypes.c_int32),
    "llama_locret_layer_budget": ([ctypes.c_void_p, ctypes.c_int32], ctypes.c_int32),
    "llama_locret_layer_cells": ([ctypes.c_void_p, ctypes.c_int32], ctypes.c_int32),
    "llama_locret_debug_fill_masked": ([ctypes.c_void_p, ctypes.c_int32, ctypes.c_float, ctypes.c_float],
                                       ctypes.c_int32),
    "llama_locret_debug_compute_buffers": ([ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                            ctypes.POINTER(ctypes.c_size_t)], None),
    "llama_locret_debug_buffers": ([ctypes.c_void_p], _Buffers),
    "llama_locret_debug_compute_buffer": ([ctypes.c_void_p, ctypes.c_int32, ctypes.c_char_p, ctypes.c_size_t,
                                           ctypes.POINTER(ctypes.c_size_t)], ctypes.c_int32),
    "llama_locret_debug_window": ([ctypes.c_void_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32),
                                   ctypes.POINTER(ctypes.c_int32), ctypes.c_int32], ctypes.c_int32),
}

# the policy when none is given (--locret-policy's default; `configure` policy None)
DEFAULT_POLICY = "heads"
# enum llama_locret_fault, in value order (test only: llama_locret_debug_inject_fault)
FAULTS = ("none", "evict_alloc", "evict_compute", "ubatch", "state_read")
_ready = False


def _api() -> ctypes.CDLL:
    global _ready
    lib = _lib()
    if not _ready:
        for name, (argtypes, restype) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = restype
        _ready = True
    return lib


def policies() -> tuple[str, ...]:
    """The eviction policies, in `enum llama_locret_policy` order, from the library's registry."""
    api = _api()
    return tuple(api.llama_locret_policy_name(i).decode() for i in range(api.llama_locret_policy_count()))


def policy_help(name: str) -> str:
    """One line saying what scores the units under a policy (the tools' --locret-policy help)."""
    return _api().llama_locret_policy_help(policy_value(name)).decode()


def policy_settings_help(name: str) -> str:
    """One line listing a policy's own settings, each as key=N with its range and default, from the policy itself
    (llama_locret_policy_settings_help); "" for a policy without settings."""
    return _api().llama_locret_policy_settings_help(policy_value(name)).decode()


def policy_traits(spec: str | None = None) -> PolicyTraits:
    """The traits of a policy, "NAME" or "NAME:SETTINGS" (None: the default policy, DEFAULT_POLICY), from the library
    (llama_locret_policy_get_traits: the answers its rule book reads); HeadsError with the library's reason for a
    spec that is not a policy (`parse_policy`)."""
    return _traits_of(policy_value(DEFAULT_POLICY if spec is None else spec))


@functools.lru_cache(maxsize=None)
def _traits_of(value: int) -> PolicyTraits:
    out = _PolicyTraits()
    if _api().llama_locret_policy_get_traits(value, ctypes.byref(out)) != 0:
        raise HeadsError(_last_error())
    return PolicyTraits(*(bool(getattr(out, name)) for name, _ in _PolicyTraits._fields_))


def __getattr__(name: str):
    # POLICIES reads the registry when first asked for, so that importing this module loads no library
    if name == "POLICIES":
        return policies()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def resolve_file(model_path: str | os.PathLike, **settings) -> dict:
    """What a context evicting with these settings resolves to (`_resolve_file`), remembered per model file (its
    path, size and modification time) and settings: `locret plan` asks again for the same settings while it weighs
    what to change, and each answer reads the model's metadata."""
    try:
        st = os.stat(model_path)
        heads = settings.get("heads")
        hst = os.stat(heads) if heads else None
    except OSError as e:
        raise HeadsError(f"cannot read '{e.filename}': {e.strerror}") from None
    key = (os.fspath(model_path), st.st_size, st.st_mtime_ns,
           None if hst is None else (os.fspath(heads), hst.st_size, hst.st_mtime_ns),
           tuple(sorted((k, os.fspath(v) if isinstance(v, os.PathLike) else v) for k, v in settings.items())))
    if key not in _RESOLVED:
        _RESOLVED[key] = _resolve_file(model_path, **settings)
    return dict(_RESOLVED[key])


_RESOLVED: dict = {}


def _resolve_file(model_path: str | os.PathLike, *, heads: str | os.PathLike | None = None, budget: int,
                 n_ctx: int, n_ubatch: int, n_batch: int | None = None, n_seq: int = 1, kv_type: str = "f16",
                 swa_full: bool | None = None, **settings) -> dict:
    """What a context evicting with these settings resolves to, decided by the library's rule book
    (llama_locret_resolve_file: the function context creation uses) from the model file's hyperparameters and the
    heads' recommended settings (`heads`, else those embedded in the model): n_cells (per sequence), n_seq,
    budget_max (the largest layer budget), stabilizers, local, n_ubatch, and the bytes per sequence it allocates:
    kv_bytes (K/V of the evicting layers), window_bytes (the window layers' cache, n_cells_window cells), store_bytes
    (scores and queries), layer_kv_bytes (each layer's K/V) and layer_budgets (the units each evicting layer keeps, in
    layer order), all from one metadata load (llama_locret_resolve_file_layers). swa_full None:
    llama.cpp's default, a window cache as large as the evicting one (the tools' default is False). `settings`:
    stabilizers, local, policy (a name or "NAME:SETTINGS"), pool, budget_schedule, positions as in `configure`.
    Settings the rule book refuses raise HeadsError with the same message context creation would give."""
    p = _rule_params(budget=budget, **settings)
    cp = _context_params(n_ctx=n_ctx, n_ubatch=n_ubatch, n_batch=n_batch, n_seq=n_seq, kv_type=kv_type,
                         swa_full=swa_full)
    out = _Resolved()
    # one metadata load gives all three (llama_locret_resolve_file_layers); no model has more layers than this
    layers = (ctypes.c_uint64 * 1024)()
    budgets = (ctypes.c_uint32 * 1024)()
    n_layer = _api().llama_locret_resolve_file_layers(os.fsencode(model_path),
                                                      os.fsencode(heads) if heads is not None else b"", ctypes.byref(p),
                                                      ctypes.byref(cp), ctypes.byref(out), layers, budgets, len(layers))
    if n_layer < 0:
        raise HeadsError(_last_error())
    if n_layer > len(layers):
        raise HeadsError(f"the model has {n_layer} layers, more than {len(layers)}")
    # a layer that does not evict keeps no budget (0); every evicting layer keeps at least its stabilizers
    return dict(_resolved_dict(out), layer_kv_bytes=tuple(int(b) for b in layers[:n_layer]),
                layer_budgets=tuple(int(b) for b in budgets[:n_layer] if b > 0))


def budget_for_mib(model_path: str | os.PathLike, mib: float, *, heads: str | os.PathLike | None = None,
                   cparams: Any = None, n_ctx: int = 0, n_ubatch: int = 512, n_batch: int | None = None,
                   n_seq: int = 1, kv_type: str = "f16", swa_full: bool | None = None, **settings) -> dict:
    """--locret-budget-mib (llama_locret_budget_for_mib): the largest budget whose memory per sequence (K/V of the
    budget and the chunk, padded to 256 cells, the window layers' cache and the F32 score store) is at most `mib` MiB,
    for the model in `model_path` and these settings (`_resolve_file`'s; `cparams`, a llama_context_params, replaces
    n_ctx, n_ubatch, n_batch, n_seq, kv_type and swa_full). Returns what `resolve_file` returns for it, plus "budget". One unit
    more would need 256 cells more, which do not fit. HeadsError with the reason when even the smallest budget does not
    fit (the message gives its size), for a schedule file, for SAGE-KV, or settings the rule book refuses."""
    p = _rule_params(budget=0, **settings)
    cp = cparams if cparams is not None else _context_params(n_ctx=n_ctx, n_ubatch=n_ubatch, n_batch=n_batch,
                                                             n_seq=n_seq, kv_type=kv_type, swa_full=swa_full)
    out = _Resolved()
    budget = _api().llama_locret_budget_for_mib(os.fsencode(model_path),
                                                os.fsencode(heads) if heads is not None else b"", ctypes.byref(p),
                                                ctypes.byref(cp), float(mib), ctypes.byref(out))
    if budget < 0:
        raise HeadsError(_last_error())
    return dict(_resolved_dict(out), budget=int(budget))


def _rule_params(*, budget: int, stabilizers: int | None = None, local: int | None = None, policy: str | None = None,
                 pool: int | None = None, budget_schedule: str | os.PathLike | None = None,
                 positions: str | None = None) -> _Params:
    mode, limit = parse_positions(positions)
    value, settings = parse_policy(DEFAULT_POLICY if policy is None else policy)
    # the structure keeps the bytes its char pointers were given alive as long as it lives
    return _Params(heads=None, budget=budget, stabilizers=_arg(stabilizers), local=_arg(local), policy=value,
                   pool=_arg(pool), policy_settings=settings.encode() or None,
                   budget_schedule=None if budget_schedule is None else os.fsencode(budget_schedule),
                   positions=mode, position_limit=limit)


def _context_params(*, n_ctx: int, n_ubatch: int, n_batch: int | None, n_seq: int, kv_type: str,
                    swa_full: bool | None = None):
    import llama_cpp
    from gguf import GGMLQuantizationType

    try:
        kv = int(GGMLQuantizationType[kv_type.upper()])
    except KeyError:
        raise HeadsError(f"unknown KV cache type '{kv_type}'") from None
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_ubatch, cp.n_seq_max, cp.type_k, cp.type_v = n_ctx, n_ubatch, n_seq, kv, kv
    cp.n_batch = max(n_ubatch, n_seq) if n_batch is None else n_batch
    if swa_full is not None:  # llama.cpp's default (and llama-cpp-python's): a full-size window cache
        cp.swa_full = swa_full
    return cp


def _resolved_dict(out: _Resolved) -> dict:
    return {name: int(getattr(out, name)) for name, _ in _Resolved._fields_}


def planned_kv_cells(model_path: str | os.PathLike, **settings) -> int:
    """The KV cells, over all sequences, that a context evicting with these settings allocates (`resolve_file`'s
    settings; what -fit plans memory with)."""
    r = resolve_file(model_path, **settings)
    return r["n_cells"] * r["n_seq"]


def _arg(value: int | None) -> int:
    return -1 if value is None else int(value)


def parse_positions(positions: str | None) -> tuple[int, int]:
    """(mode, limit) of a --locret-positions value ("compact", "inplace", "keep", "keep:N"; None: the default, (-1, -1)), parsed
    by the library's rule; HeadsError with the reason for another."""
    if positions is None:
        return -1, -1
    mode, limit = ctypes.c_int32(-1), ctypes.c_int32(-1)
    if not isinstance(positions, str) or \
            _api().llama_locret_positions_parse(positions.encode(), ctypes.byref(mode), ctypes.byref(limit)) != 0:
        raise HeadsError(_last_error() if isinstance(positions, str) else
                         f"Locret positions must be compact, inplace, keep or keep:N (got {positions!r})")
    return mode.value, limit.value


def parse_policy(spec: str) -> tuple[int, str]:
    """(`enum llama_locret_policy` value, settings) of a policy given as "NAME" or "NAME:SETTINGS", SETTINGS being the
    policy's own settings as key=value pairs separated by commas ("" when none are given: the policy's defaults).
    Parsed and checked by the library (llama_locret_policy_from_spec), which alone knows each policy's settings;
    HeadsError with its reason: an unknown name (naming the valid ones), a setting the policy does not have, a value
    out of its range, a setting given twice."""
    if not isinstance(spec, str):
        raise HeadsError(f"the Locret policy must be a name, one of {', '.join(policies())}, or NAME:SETTINGS "
                         f"(got {spec!r})")
    raw = spec.encode()  # alive while the library's settings pointer, which points into it, is read
    value, settings = ctypes.c_int(0), ctypes.c_char_p()
    if _api().llama_locret_policy_from_spec(raw, ctypes.byref(value), ctypes.byref(settings)) != 0:
        raise HeadsError(_last_error())
    return value.value, (settings.value or b"").decode()


def policy_value(name: str) -> int:
    """The `enum llama_locret_policy` value of a policy, "NAME" or "NAME:SETTINGS" (`parse_policy`, whose settings are
    checked too); HeadsError with the reason (an unknown name names the valid ones)."""
    return parse_policy(name)[0]


def configure(model: int, model_path: str | os.PathLike, *, heads: str | os.PathLike | None = None,
              budget: int | None = None, stabilizers: int | None = None, local: int | None = None,
              policy: str | None = None, pool: int | None = None,
              budget_schedule: str | os.PathLike | None = None, positions: str | None = None) -> Heads | None:
    """Register Locret settings for the contexts created next from `model` (a `llama_model *`), the way the
    llama.cpp tools do: heads from `heads`, else the ones embedded in `model_path`. None leaves a setting
    to its default (`budget` None: no eviction; `policy` None: "heads"; `pool` None: no score pooling).
    `policy` "random", "streaming", "lagkv", "sage" or "snapkv" evicts without heads (given heads are then not loaded);
    "sage" (SAGE-KV) reads each prompt whole, in a cache sized for n_ctx, and chooses once at its end. A policy's own
    settings follow its name, "NAME:key=value[,key=value...]" (`parse_policy`; each policy's keys:
    `policy_settings_help`, docs/policies.md); without them it takes its defaults. `pool` N (odd): each unit is
    scored by the mean of the heads' scores over the N tokens around it. `budget_schedule`: "uniform" (None),
    "pyramid" (PyramidKV's per-layer budgets) or a file of per-layer budgets, summing to `budget` times the evicting
    layers (see `set_budget_schedule`). `positions`: "compact" (None: the paper's positions 0..n-1 after every
    eviction, moved to cells 0..n-1), "inplace" (the same positions, units re-rotated in their cells; the default for
    heads, random and streaming), "keep" or "keep:N" (units keep the positions they were read at; see
    `set_positions`). Returns the heads
    loaded (keep them while the contexts live)."""
    # every setting in one structure, given once: the library finds the heads and checks the whole (the tools' call)
    params = _rule_params(budget=_arg(budget), stabilizers=stabilizers, local=local, policy=policy, pool=pool,
                          budget_schedule=budget_schedule, positions=positions)
    out = ctypes.c_void_p()
    heads_path = os.fsencode(heads) if heads is not None else b""
    if _api().llama_locret_configure_default(model, os.fsencode(model_path), heads_path, ctypes.byref(params),
                                             ctypes.byref(out)) != 0:
        raise HeadsError(_last_error())
    return Heads(out.value, os.fspath(heads) if heads is not None else os.fspath(model_path)) if out.value else None


def set_positions(model: int, positions: str) -> None:
    """Where the units an eviction keeps sit, for the contexts created next from `model`, after `configure`:
    "inplace" (positions 0..n-1 after every eviction, each key re-rotated in its cell, the chunk's survivors copied
    into the holes: the default where the policy takes it), "compact" (the same positions, the units moved to cells
    0..n-1), "keep" (each keeps the position it was read at; the chunk's
    survivors fill the holes, so an eviction moves at most a chunk of rows and re-rotates none; positions are compacted
    only when the next part would reach the model's trained context) or "keep:N" (that limit N). HeadsError with the
    reason (another word, no budget, a policy that reads units in position order, a limit below b + ubatch at context
    creation)."""
    mode, limit = parse_positions(positions)
    if _api().llama_locret_model_set_positions(model, mode, limit) != 0:
        raise HeadsError(_last_error())


def set_budget_schedule(model: int, schedule: str | os.PathLike) -> None:
    """Per-layer budgets for the contexts created next from `model`, after `configure`: "uniform", "pyramid"
    (PyramidKV: the first evicting layer keeps about 2b, the last b/20 raised to the stabilizers + 1, linear
    between) or a file of whole numbers, one per evicting layer. The layers' budgets sum to b times their
    count; the layers are held in a few caches, each sized for its layers' largest budget (a layer below it has the
    cells it does not keep masked out of its attention; see layer_cells). HeadsError with the reason (unknown name, unreadable file, no budget, policy lagkv or sage)."""
    if _api().llama_locret_model_set_budget_schedule(model, os.fsencode(schedule)) != 0:
        raise HeadsError(_last_error())


def layer_budget(ctx: int, layer: int) -> int:
    """The units `layer` keeps in this context (its schedule's budget, or b); -1 for a layer it does not evict."""
    return int(_api().llama_locret_layer_budget(ctx, layer))


def layer_cells(ctx: int, layer: int) -> int:
    """The KV cells per sequence `layer`'s cache allocates in this context (with a budget schedule, its layer group's:
    the group's largest budget plus the ubatch); -1 for a layer it does not evict."""
    return int(_api().llama_locret_layer_cells(ctx, layer))


def fill_masked(ctx: int, k_value: float, v_value: float, seq_id: int = 0) -> int:
    """Test only: write k_value / v_value into every K / V element of the cells of each layer's cache that sequence
    `seq_id`'s attention must not read (those a budget schedule masks in the layer, and those past the cells in use).
    Returns the cells written, summed over layers."""
    n = _api().llama_locret_debug_fill_masked(ctx, seq_id, k_value, v_value)
    if n < 0:
        raise HeadsError(_last_error())
    return n


def stats(ctx: int, seq_id: int = 0) -> dict[str, int | bool | str]:
    """Sequence `seq_id`'s enabled, n_evictions, n_units_evicted (summed over layers and KV heads; both count since
    the sequence was last emptied, so a new prompt in a reset Llama starts from zero), n_cells_used,
    n_cells (per sequence), pos_logical (next logical position), kv_bytes (the whole cache), the resolved
    budget/stabilizers/local/n_ubatch, policy (its name: "heads", "random", "streaming", "lagkv", "sage", "snapkv"), n_seq
    (sequences the context keeps), n_pinned (Locret-Q: leading positions never evicted), pool (the sequence's score
    pooling window, 0: none; pool_window the context's, pooling prompts of pool_from budgets or more, 0: every
    prompt) and policy_settings (the policy's own settings as resolved, "key=value,..."; "" for a policy
    without settings); and the work done so far: t_select_us,
    t_compact_us, t_readback_us (time spent), n_compactions (compaction graphs run), and what evictions cost since
    the context was made: n_rows_moved (K/V rows written to another cell), n_rows_rotated (keys re-rotated),
    n_rows_kept (units retained; a row is one layer, KV head and unit) and n_host_syncs (times an eviction waited
    for the backend or read data back); positions ("inplace", "compact" or "keep"), position_limit, pos_rope_next (the RoPE
    position of the next token) and n_repositions (evictions that compacted kept positions at the limit)."""
    s = _api().llama_locret_get_seq_stats(ctx, seq_id)
    out = {name: getattr(s, name) for name, _ in _Stats._fields_}
    name = _api().llama_locret_policy_name(s.policy)
    out["policy"] = name.decode() if name is not None else str(s.policy)
    out["policy_settings"] = s.policy_settings.decode()
    out["positions"] = _api().llama_locret_positions_name(s.positions).decode()
    return out


def seq_room(ctx: int, seq_id: int = 0) -> int:
    """Speculative decoding: the most tokens the next generation batch of sequence `seq_id` (the sampled token and its
    draft, every token asking for logits) may hold so that no eviction falls inside it: once the rejected tokens are
    removed, the cache is what decoding the accepted ones one by one leaves. -1 when the context does not evict."""
    return int(_api().llama_locret_seq_room(ctx, seq_id))


def rope_positions(ctx: int, layer: int, head: int, seq_id: int = 0) -> np.ndarray:
    """Test only: the RoPE positions the keys of the units `retained` lists were rotated at, in the same order."""
    n = _api().llama_locret_debug_rope_positions(ctx, seq_id, layer, head, None, 0)
    if n < 0:
        raise HeadsError(_last_error())
    out = (ctypes.c_int32 * max(n, 1))()
    if _api().llama_locret_debug_rope_positions(ctx, seq_id, layer, head, out, n) != n:
        raise HeadsError(_last_error())
    return np.frombuffer(out, dtype=np.int32, count=n).copy()


def state_stats(stats_: dict) -> dict:
    """The part of `stats()` that is the sequence's state, which a saved and loaded state reproduces: all but
    the work done (the t_ timers and the n_compactions, n_rows_* and n_host_syncs counters, which count this
    context's own work)."""
    work = ("n_compactions", "n_rows_moved", "n_rows_rotated", "n_rows_kept", "n_host_syncs", "n_repositions",
            "n_evictions_total", "n_units_evicted_total")
    return {k: v for k, v in stats_.items() if not k.startswith("t_") and k not in work}


def pin_query(ctx: int, n_tokens: int, seq_id: int = 0) -> None:
    """Locret-Q: positions [0, n_tokens) of sequence `seq_id` are never evicted (they count in the budget).
    Before the sequence's first eviction; lasts until the sequence is emptied. HeadsError with the reason."""
    if _api().llama_locret_pin_query(ctx, seq_id, int(n_tokens)) != 0:
        raise HeadsError(_last_error())


def seq_prompt(ctx: int, n_tokens: int, seq_id: int = 0) -> bool:
    """Sequence `seq_id` starts with a prompt of `n_tokens` tokens: where the heads recommend pooling for long prompts
    only (`recommended["pool_from"]`), this decides it, once, before the sequence holds a token (the library's rule,
    llama_locret_seq_prompt). Returns whether the sequence's scores are pooled. HeadsError when the context does not
    evict."""
    pooled = _api().llama_locret_seq_prompt(ctx, seq_id, int(n_tokens))
    if pooled < 0:
        raise HeadsError(_last_error())
    return pooled == 1


def query_tokens(vocab: int, tokens, query: str, limit: int) -> int:
    """Locret-Q: how many leading `tokens` of a prompt to pin, through the end of `query` placed in it (searched
    in the first `limit` tokens; `vocab` is a `llama_vocab *`). HeadsError when the query is empty or not there."""
    arr = (ctypes.c_int32 * len(tokens))(*tokens)
    n = _api().llama_locret_query_tokens(vocab, arr, len(tokens), query.encode(), int(limit))
    if n < 0:
        raise HeadsError(_last_error())
    return n


def model_vocab(llm):
    """The `llama_vocab *` of a llama-cpp-python model (a `llama_cpp.Llama` or anything holding its `_model`)."""
    import llama_cpp

    return llama_cpp.llama_model_get_vocab(llm._model.model)


def model_query_tokens(llm, tokens, query: str, limit: int) -> int:
    """`query_tokens` with the vocabulary of a llama-cpp-python model."""
    return query_tokens(model_vocab(llm), tokens, query, limit)


def retained(ctx: int, layer: int, head: int, seq_id: int = 0) -> np.ndarray:
    """Logical positions of the units that (layer, KV head) holds in sequence `seq_id`, in cell order."""
    n = _api().llama_locret_retained_seq(ctx, seq_id, layer, head, None, 0)
    if n < 0:
        raise HeadsError(_last_error())
    out = np.zeros(n, dtype=np.int32)
    if n and _api().llama_locret_retained_seq(ctx, seq_id, layer, head,
                                               out.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), n) != n:
        raise HeadsError(_last_error())
    return out


def read_kv(ctx: int, layer: int, n_cells: int, *, values: bool = False, width: int, seq_id: int = 0) -> np.ndarray:
    """Layer's K (or V) cache of sequence `seq_id` for cells [0, n_cells), dequantized: float32 [n_cells, width]."""
    out = np.zeros((n_cells, width), dtype=np.float32)
    got = _api().llama_locret_debug_read_kv_seq(ctx, seq_id, layer, values,
                                                out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), n_cells)
    if got != width:
        raise HeadsError(_last_error() or f"read_kv: width {got} != {width}")
    return out


def read_scores(ctx: int, layer: int, n_cells: int, *, n_head_kv: int, seq_id: int = 0) -> np.ndarray:
    """The scores eviction ranks layer's units of sequence `seq_id` by (the heads' or LagKV's), for cells
    [0, n_cells): float32 [n_cells, n_head_kv]."""
    out = np.zeros((n_cells, n_head_kv), dtype=np.float32)
    got = _api().llama_locret_debug_read_scores(ctx, seq_id, layer, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                                                n_cells)
    if got != n_head_kv:
        raise HeadsError(_last_error() or f"read_scores: {got} KV heads, expected {n_head_kv}")
    return out


def read_query(ctx: int, layer: int, seq_id: int = 0) -> tuple[np.ndarray, float]:
    """The post-RoPE queries a policy captured for sequence `seq_id` in `layer`, as its scoring graph reads them (SAGE-KV:
    the last token placed; SnapKV: 64 rows for a pinned question's last tokens, zero when none, then the last part's
    last 32 tokens, the newest row last in each): (float32, flat [rows * n_head * d_head_k], the layer's attention
    scale)."""
    width = _api().llama_locret_debug_read_query(ctx, seq_id, layer, None, 0, None)
    if width < 0:
        raise HeadsError(_last_error())
    out = np.zeros(width, dtype=np.float32)
    scale = ctypes.c_float(0.0)
    _api().llama_locret_debug_read_query(ctx, seq_id, layer, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), width,
                                         ctypes.byref(scale))
    return out, float(scale.value)


def window(ctx: int, seq_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """An iSWA model's window cache for sequence `seq_id`: (logical positions, tokens) of its cells, in cell order."""
    n = _api().llama_locret_debug_window(ctx, seq_id, None, None, 0)
    if n < 0:
        raise HeadsError(_last_error())
    pos, tok = np.zeros(n, dtype=np.int32), np.zeros(n, dtype=np.int32)
    if n:
        _api().llama_locret_debug_window(ctx, seq_id, pos.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
                                         tok.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), n)
    return pos, tok


def compute_buffers(ctx: int) -> tuple[int, int]:
    """Debug: bytes of the context's compute buffers and of the eviction graphs' own (both sized at creation)."""
    main, evict = ctypes.c_size_t(0), ctypes.c_size_t(0)
    _api().llama_locret_debug_compute_buffers(ctx, ctypes.byref(main), ctypes.byref(evict))
    return int(main.value), int(evict.value)


def locret_buffers(ctx: int) -> dict:
    """Debug: bytes of an evicting context's own buffers: evict_compute (the eviction graphs), move_tables,
    score_store, and compact_seq (the most sequences one compaction moves); zeros when it does not evict."""
    b = _api().llama_locret_debug_buffers(ctx)
    return {name: int(getattr(b, name)) for name, _ in _Buffers._fields_}


def compute_buffers_by_type(ctx: int) -> dict[str, int]:
    """Debug: the context's compute buffer bytes per buffer type ("CPU", "CUDA0", "CUDA_Host", ...)."""
    out: dict[str, int] = {}
    name, size = ctypes.create_string_buffer(128), ctypes.c_size_t(0)
    i, n = 0, 1
    while i < n:
        n = _api().llama_locret_debug_compute_buffer(ctx, i, name, len(name), ctypes.byref(size))
        if n <= 0:
            break
        out[name.value.decode()] = out.get(name.value.decode(), 0) + int(size.value)
        i += 1
    return out


def inject_fault(ctx: int, fault: str) -> None:
    """Test only: make the next matching operation fail (see FAULTS and llama_locret_debug_inject_fault)."""
    if fault not in FAULTS:
        raise HeadsError(f"unknown fault {fault!r}; valid: {', '.join(FAULTS)}")
    if _api().llama_locret_debug_inject_fault(ctx, FAULTS.index(fault)) != 0:
        raise HeadsError(_last_error())
