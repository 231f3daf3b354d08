"""`locret plan`'s measurement: llama.cpp's own estimate of its buffers, from a child process that loads the model
with `no_alloc` and creates a context with the plan's settings, and the plan's parts made from what it reports."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .inputs import PlanError, _type_sizes
from .memory import MIB, Part, Settings, _fmt, _on_gpu

if TYPE_CHECKING:
    from .advice import Plan

_RESULT_MARK = "LOCRET_PLAN_MEASURE "


# --- llama.cpp's own estimate ---------------------------------------------------------------------

@dataclass
class Measured:
    """What llama.cpp reported for a no_alloc model + context with the plan's settings."""

    compute: dict[str, int]       # buffer type -> bytes ("CPU", "CUDA0", "CUDA_Host", ...), llama_locret_debug_compute_buffer
    output: dict[str, int]        # the same for the output buffer (logits), from the creation log
    kv_bytes: int                 # ggml_nbytes of the cache's K and V tensors (llama_locret_get_stats)
    n_cells: int
    stabilizers: int
    local: int
    model_size: int               # llama_model_size(): bytes of the model's tensors
    n_params: int
    locret: dict[str, int] = field(default_factory=dict)  # Locret's own buffers: eviction graphs, move tables, score store
    compact_seq: int = 1          # sequences one compaction graph moves (its buffers are sized for them, not every slot)
    n_vocab: int = 0


def _is_host_buffer(name: str) -> bool:
    return name == "CPU" or name.endswith("_Host") or name.startswith("CPU")


def measure(model: Path, heads: Path | None, settings: Settings, timeout: float = 600) -> Measured:
    """Run llama.cpp (in a child process) on the model with the plan's settings, allocating nothing."""
    request = dict(model=str(model), heads=str(heads) if heads else None, context=settings.context,
                   budget=settings.budget, ubatch=settings.ubatch, stabilizers=settings.stabilizers,
                   kv_type=settings.kv_type, gpu_layers=settings.gpu_layers, policy=settings.policy,
                   schedule=settings.schedule, slots=settings.slots)
    return Measured(**_in_child(request, timeout))


def plain_kv_bytes(model: Path, context: int, slots: int = 1, ubatch: int = 512, kv_type: str = "f16",
                   timeout: float = 600) -> int:
    """The K and V bytes plain llama.cpp (no eviction) allocates for `slots` slots of `context` tokens each, as
    llama-server -c context*slots -np slots holds them: llama.cpp's own figure, summed from the size lines its caches
    log when a no_alloc context is created (exact from their counts, `_cell_layer_bytes`). A sliding-window model's
    window layers hold their window and a ubatch, not the context (the tools' default, no --swa-full): a full cache of
    every layer would overstate it. Remembered per model file and settings."""
    st = Path(model).stat()
    key = (str(model), st.st_size, st.st_mtime_ns, int(context), int(slots), int(ubatch), str(kv_type).lower())
    if key not in _PLAIN_KV:
        request = dict(model=str(model), plain=True, context=int(context), slots=int(slots), ubatch=int(ubatch),
                       kv_type=str(kv_type).lower(), gpu_layers=0)
        _PLAIN_KV[key] = int(_in_child(request, timeout)["kv_bytes"])
    return _PLAIN_KV[key]


_PLAIN_KV: dict = {}


def _in_child(request: dict, timeout: float) -> dict:
    """`_measure_main(request)` in a child process (an abort inside llama.cpp must not take the caller with it)."""
    # an abort inside llama.cpp would otherwise attach gdb to print a backtrace: the message is enough
    env = {**os.environ, "GGML_NO_BACKTRACE": "1"}
    try:
        proc = subprocess.run([sys.executable, "-m", "locret.planner", "--measure", json.dumps(request)],
                              capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, env=env)
    except subprocess.TimeoutExpired:
        raise PlanError(f"llama.cpp's memory estimate did not finish in {timeout:.0f} s") from None
    for line in proc.stdout.splitlines():
        if line.startswith(_RESULT_MARK):
            data = json.loads(line[len(_RESULT_MARK):])
            if "error" in data:
                raise PlanError(f"llama.cpp refused the plan: {data['error']}")
            return data
    lines = proc.stderr.strip().splitlines() or ["(no output)"]
    reason = next((x for x in lines if "GGML_ASSERT" in x or "error" in x.lower()), lines[-1]).strip()
    raise PlanError(f"llama.cpp's memory estimate failed (exit {proc.returncode}): {reason}")


def _measure_main(request: dict) -> dict:
    """Child process: load with no_alloc, create the context, collect what llama.cpp reports."""
    import ctypes

    # `python -m locret.planner` has imported the package first, which pointed llama_cpp at our libllama
    try:
        import llama_cpp.llama_cpp as L
    except (OSError, FileNotFoundError) as e:
        return {"error": f"the patched libllama could not be loaded ({e}); run `bash scripts/setup.sh`"}
    from .. import eviction
    from ..heads import HeadsError, _last_error

    lines: list[tuple[int, str]] = []

    @ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
    def on_log(level, text, user_data):
        lines.append((level, (text or b"").decode(errors="replace")))

    def errors() -> str:
        # the first error says what went wrong; later ones only say that loading failed
        for wanted in (4, 3):  # GGML_LOG_LEVEL_ERROR, then _WARN
            bad = [t.strip() for lv, t in lines if lv == wanted and t.strip()]
            if bad:
                return bad[0]
        return "no message"

    L.llama_log_set(on_log, None)
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.no_alloc = True                         # simulate allocations: nothing is read or allocated
    mp.load_mode = L.LLAMA_LOAD_MODE_NONE      # no_alloc cannot map the file
    mp.n_gpu_layers = int(request["gpu_layers"])
    model = L.llama_model_load_from_file(request["model"].encode(), mp)
    if not model:
        return {"error": f"could not load the model: {errors()}"}
    plain = bool(request.get("plain"))   # plain llama.cpp: nothing configured, the KV cache's size wanted
    heads = None
    if not plain:
        try:
            # a policy without heads loads none; one that sets its own stabilizers (e.g. SAGE-KV) is given none
            traits = eviction.policy_traits(request.get("policy"))
            heads = eviction.configure(model, request["model"], heads=request["heads"] if traits.needs_heads else None,
                                       budget=request["budget"],
                                       stabilizers=None if traits.sets_own_stabilizers else request["stabilizers"],
                                       policy=request.get("policy"),
                                       budget_schedule=None if request.get("schedule", "uniform") == "uniform"
                                       else request["schedule"])
        except HeadsError as e:
            return {"error": str(e)}
    types = _type_sizes()[1]
    cp = L.llama_context_default_params()
    slots = int(request.get("slots", 1))
    cp.n_ctx = int(request["context"]) * slots      # split between the slots, as llama-server -np does
    cp.n_batch = cp.n_ubatch = int(request["ubatch"])
    cp.n_batch = max(cp.n_batch, slots)             # llama.cpp asserts when a context has more sequences than -b
    cp.n_seq_max = slots
    cp.kv_unified = False                           # one stream per slot: what Locret takes with several sequences
    cp.swa_full = False                             # the tools' window cache (llama.cpp's own default is full size)
    cp.n_threads = cp.n_threads_batch = 1
    cp.type_k = cp.type_v = int(types[request["kv_type"].upper()])
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        return {"error": _last_error() or errors()}
    # the KV cache's bytes and cells, the model's size, the compute buffers per buffer type and Locret's own buffers:
    # the C API's numbers
    if plain:
        # llama_kv_cache logs "size = X MiB (N cells, L layers, S/T seqs)" for each cache it makes (two for iSWA): N
        # cells in each of T streams of L layers. With every layer's K and V as wide (both models here), the bytes
        # are exact from the counts; else the MiB it prints (to 0.01 MiB a cache)
        text = "".join(t for _, t in lines)
        row = _cell_layer_bytes(request["model"], request["kv_type"])
        kv = 0
        for mib, cells, layers, streams in re.findall(
                r"llama_kv_cache: size = +([0-9.]+) MiB \( *(\d+) cells, +(\d+) layers, +\d+/(\d+) seqs\)", text):
            kv += round(float(mib) * MIB) if row is None else int(cells) * int(streams) * int(layers) * row
        L.llama_free(ctx)
        L.llama_model_free(model)
        return {"kv_bytes": kv}
    stats = eviction.stats(ctx)
    compute = eviction.compute_buffers_by_type(ctx)
    own = eviction.locret_buffers(ctx)
    # no API gives the output buffer (logits): the creation log does
    text = "".join(t for _, t in lines)
    output: dict[str, int] = {}
    for name, mib in re.findall(r"(\S+) +output buffer size = +([0-9.]+) MiB", text):
        output[name] = output.get(name, 0) + round(float(mib) * MIB)
    evicting = bool(stats["enabled"])
    result = dict(compute=compute, output=output, kv_bytes=int(stats["kv_bytes"]), n_cells=int(stats["n_cells"]),
                  stabilizers=int(stats["stabilizers"]), local=int(stats["local"]),
                  model_size=int(L.llama_model_size(model)), n_params=int(L.llama_model_n_params(model)),
                  locret={"eviction graphs": own["evict_compute"], "move tables": own["move_tables"],
                          "score store": own["score_store"]} if evicting else {},
                  compact_seq=own["compact_seq"] if evicting else 1,
                  n_vocab=int(L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))))
    L.llama_free(ctx)
    del heads
    L.llama_model_free(model)
    return result


def _cell_layer_bytes(model_path: str, kv_type: str) -> int | None:
    """K and V bytes of one cell in one layer when every layer's K and V rows are as wide (a cache's bytes are then
    exact from the counts its size line gives); None when they differ (then the MiB the line gives)."""
    from .inputs import read_model, row_size

    facts = read_model(Path(model_path))
    widths = set(zip(facts.n_embd_k_gqa, facts.n_embd_v_gqa))
    if len(widths) != 1:
        return None
    k, v = widths.pop()
    return row_size(kv_type, k) + row_size(kv_type, v)


def _add_buffers(out: Plan, m: Measured) -> None:
    host = sum(b for n, b in m.compute.items() if _is_host_buffer(n))
    dev = sum(b for n, b in m.compute.items() if not _is_host_buffer(n))
    names = ", ".join(f"{n} {_fmt(b)}" for n, b in m.compute.items()) or "none reported"
    how = f"llama.cpp's estimate ({names})"
    gpu_layers, _ = _on_gpu(out.model.n_layer, out.settings.gpu_layers, out.device.build.backend)
    if out.device.build.backend == "cuda" and dev == 0 and gpu_layers:
        # this build has no CUDA backend: the CPU backend's buffer for the same graph stands in for the GPU's
        out.notes.append("compute buffers measured with this build's CPU backend; run `locret plan` on the device "
                         "(CUDA build) for the GPU's own figure")
        dev, host = host, 0
    if out.device.memory.kind != "discrete":
        host, dev = host + dev, 0
    out.parts.append(Part("compute buffers", dev, host, how))
    out.parts.append(Part("output buffer", 0, sum(m.output.values()), "llama.cpp's estimate (logits)"))
    if m.n_vocab:
        slots = out.settings.slots
        out.parts.append(Part(SAMPLING_PART, 0, slots * m.n_vocab * SAMPLING_BYTES_PER_TOKEN,
                              f"{slots} sequence{'s' if slots > 1 else ''} x {m.n_vocab} tokens x "
                              f"{SAMPLING_BYTES_PER_TOKEN} B (the samplers' candidate arrays, measured)"))


# Each sequence's sampler holds arrays over the vocabulary (llama.cpp's token candidates, sorted copies): llama-server
# measured 0.85-0.95 MiB more per slot after one request on every slot than idle, at 49152 tokens (1 and 64 slots):
# 18-20 bytes per token. Invisible at one slot, 215 MiB at 256: a plan for many slots that left it out was exceeded.
SAMPLING_PART = "sampling"
SAMPLING_BYTES_PER_TOKEN = 20
# the most sequences one compaction moves (locret_evictor::COMPACT_MAX_SEQ; a test checks the creation log agrees)
COMPACT_MAX_SEQ = 4
LOCRET_PART = "Locret eviction"      # the eviction graphs' compute buffers and move tables: one compaction's sequences
LOCRET_SCORES_PART = "Locret scores"  # the score store and the units' positions: every slot's


def _add_locret_buffers(out: Plan, m: Measured) -> None:
    """Locret's own memory beside the cache, as measured (the eviction graphs' compute buffers from the C API, the
    move tables and the score store from its creation log). Two parts, since they grow differently with the
    slots: the eviction graphs' compute buffers and the move tables are sized for the sequences of one compaction
    (at most a few, whatever the slots: `compact_seq`), the score store (a float per cell, KV head and evicting layer)
    and on the host the units' logical positions (an int32 in the same shape) for every slot."""
    if not m.locret:
        return
    graphs, moves, scores = (m.locret.get(k, 0) for k in ("eviction graphs", "move tables", "score store"))
    positions = scores
    kv = next(x for x in out.parts if x.what == "KV cache")
    cuda = out.device.build.backend == "cuda"
    on_device = out.device.memory.kind == "discrete" and kv.device_bytes > 0
    seqs = f" ({m.compact_seq} sequence{'s' if m.compact_seq > 1 else ''} per compaction)"
    if on_device:
        # beside the cache on the GPU; the host fills the move tables in pinned memory and uploads them
        out.parts.append(Part(LOCRET_PART, graphs + moves, moves,
                              f"eviction graphs {_fmt(graphs)}, move tables {_fmt(moves)} (+ host staging){seqs}"))
        out.parts.append(Part(LOCRET_SCORES_PART, scores, positions,
                              f"score store {_fmt(scores)}, positions {_fmt(positions)} (host)"))
    else:
        out.parts.append(Part(LOCRET_PART, 0, graphs + moves + (moves if cuda else 0),
                              f"eviction graphs {_fmt(graphs)}, move tables {_fmt(moves)}"
                              + (" (+ host staging)" if cuda else "") + seqs))
        out.parts.append(Part(LOCRET_SCORES_PART, 0, scores + positions,
                              f"score store {_fmt(scores)}, positions {_fmt(positions)}"))


def main(argv: list[str]) -> int:
    """`python -m locret.planner --measure JSON` (the child process of `measure`): one result line on stdout."""
    if argv[1:2] == ["--measure"] and len(argv) == 3:
        try:
            result = _measure_main(json.loads(argv[2]))
        except Exception as e:  # reported to the parent as one line
            result = {"error": f"{type(e).__name__}: {e}"}
        print(_RESULT_MARK + json.dumps(result), flush=True)
        return 0
    print("usage: python -m locret.planner --measure JSON  (internal; use `locret plan`)", file=sys.stderr)
    return 2
