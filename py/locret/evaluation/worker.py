"""One evaluation run, (method, budget, length group), in a process of its own, so that its peak memory
is measured alone and a crash in llama.cpp cannot take the runner down.

The parent sends a RunSpec and the items; the worker answers on a queue with ("sample", dict) per item,
then ("done", dict) with the process's peak memory, or ("error", message)."""
from __future__ import annotations

import os
import resource
import shutil
import subprocess
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import AUTO_QUERY_METHODS, HEADS_METHODS, QUERY_METHODS, decoding
from .items import Item, outcome

HEATMAP_BINS = 128
POOL_RECOMMENDED = -1  # --pool auto: each heads file's recommended window (the Locret-Q heads 15, the plain ones none)  # logical-position bins of a retained-unit heatmap


@dataclass(frozen=True)
class RunSpec:
    model_path: str
    method: str                  # one of METHODS
    budget: int | None           # None for full attention
    heads: str | None            # heads file for "locret", "locret-q", "locret-pyramid" / "random-heads"
    stabilizers: int | None
    local: int | None
    n_ctx: int
    ubatch: int
    threads: int
    kv_type: str | None = None   # "f16", "q8_0", ... (None: llama.cpp's f16)
    gpu_layers: int = 0
    heatmap_ids: tuple[str, ...] = ()
    heatmap_dir: str | None = None
    labels: dict = field(default_factory=dict)  # copied into every sample record
    pool: int | None = None      # score pooling window of the heads methods (None: none; POOL_RECOMMENDED: the heads
                                 # file's recommendation)
    policy_settings: str = ""    # the method's policy settings, "key=value[,key=value...]" ("": the policy's defaults)
    positions: str | None = None # where kept units sit (locret_positions; None: the library's default)
    schedule: str | None = None  # the budget schedule: a file (locret-schedule, METHOD@schedule) or "pyramid"
                                 # (locret-pyramid, METHOD@pyramid); None: uniform
    variant: str = ""            # METHOD@variant's schedule variant (SCHEDULE_VARIANTS), "" for a plain method

    @property
    def name(self) -> str:
        method = f"{self.method}@{self.variant}" if self.variant else self.method
        return method if self.budget is None else f"{method}-b{self.budget}"


def make_llm(spec: RunSpec):
    import llama_cpp

    from ..llama import Llama

    # swa_full off: a sliding-window model's window layers keep their window, as llama-server and llama-cli allocate
    # them (llama-cpp-python's default sizes them like the whole cache: Gemma-3's KV figures were 1.5-3.3x too large)
    kwargs = dict(n_ctx=spec.n_ctx, n_batch=spec.ubatch, n_ubatch=spec.ubatch, n_threads=spec.threads,
                  n_threads_batch=spec.threads, flash_attn=True, n_gpu_layers=spec.gpu_layers, swa_full=False,
                  verbose=False)
    if spec.kv_type:
        kwargs["type_k"] = kwargs["type_v"] = getattr(llama_cpp, f"GGML_TYPE_{spec.kv_type.upper()}")
    if spec.method == "full":
        return Llama(spec.model_path, **kwargs)
    query = dict(locret_query="off") if spec.method in HEADS_METHODS else {}  # not the heads' recommended auto
    return Llama(spec.model_path, **locret_settings(spec), **query, **kwargs)


def policy_of(method: str) -> str:
    """The engine's policy an evicting method runs (its name in the library's registry)."""
    if method in HEADS_METHODS:
        return "heads"
    if method == "snapkv-q-auto":
        return "snapkv"  # the pinned question is its observation window
    return method


def locret_settings(spec: RunSpec) -> dict:
    """The Locret settings (locret.Llama's locret_* arguments) of an evicting method's run. The method's policy
    settings (--policy-settings) go through as they are, after its policy's name ("NAME:SETTINGS"): the library
    parses and checks them."""
    policy = policy_of(spec.method)
    if spec.policy_settings:
        policy = f"{policy}:{spec.policy_settings}"
    out = dict(locret_budget=spec.budget, locret_stabilizers=spec.stabilizers, locret_local=spec.local,
               locret_positions=spec.positions)
    if spec.method in HEADS_METHODS:
        # what the run asks for and nothing the heads recommend: no pooling unless --pool (and no query but
        # locret-q's own, pinned by the worker: make_llm), so that a run means the same whatever heads file it reads
        pool = None if spec.pool == POOL_RECOMMENDED else spec.pool or 0  # None: the library takes the heads' own
        return out | dict(locret_heads=spec.heads, locret_policy=policy, locret_pool=pool,
                          locret_budget_schedule=spec.schedule)
    return out | dict(locret_policy=policy)


def kv_heads(llm) -> tuple[int, int]:
    arch = llm.metadata["general.architecture"]
    n_layer = int(llm.metadata[f"{arch}.block_count"])
    n_head_kv = int(llm.metadata.get(f"{arch}.attention.head_count_kv", llm.metadata[f"{arch}.attention.head_count"]))
    return n_layer, n_head_kv


def evicting_layers(llm) -> list[int]:
    """The layers whose cache Locret evicts (all of them, except the window layers of a sliding-window model,
    which keep llama.cpp's own window cache). Asked of a context that holds sequence 0."""
    from ..heads import HeadsError

    n_layer, _ = kv_heads(llm)
    out = []
    for il in range(n_layer):
        try:
            llm.locret_retained(il, 0)
        except HeadsError:
            continue
        out.append(il)
    return out


def _retained_histogram(llm, n_layer: int, n_head_kv: int, n_prompt: int) -> np.ndarray:
    """[n_layer, n_head_kv, HEATMAP_BINS]: units held in each logical-position bin of the prompt over the
    bin's width (about the share held; bins of fractional width can read slightly above 1). Summed over
    the bins and times the width, it is the number of prompt units held."""
    edges = np.linspace(0, n_prompt, HEATMAP_BINS + 1)
    width = np.maximum(np.diff(edges), 1e-9)
    out = np.zeros((n_layer, n_head_kv, HEATMAP_BINS), dtype=np.float32)
    for il in evicting_layers(llm):  # window layers stay zero
        for ih in range(n_head_kv):
            pos = llm.locret_retained(il, ih)
            counts, _ = np.histogram(pos[pos < n_prompt], bins=edges)
            out[il, ih] = counts / width
    return out


def query_of(spec: RunSpec, item: Item) -> str:
    """The question a Locret-Q method places and pins: the task's, or the one the auto rule found ("": none, the
    prompt as it is)."""
    if spec.method == "locret-q":
        return item.query
    return item.auto_query if spec.method in AUTO_QUERY_METHODS else ""


def prompt_of(spec: RunSpec, item: Item) -> list[int]:
    """The prompt a method answers: Locret-Q's has the question at the start of the user turn."""
    if spec.method in AUTO_QUERY_METHODS:
        return list(item.auto_query_tokens) if item.auto_query else list(item.tokens)
    if spec.method != "locret-q":
        return list(item.tokens)
    if not item.query_tokens:
        raise ValueError(f"{item.id}: locret-q needs a question to place (generated tasks have one; benchmarks not)")
    return list(item.query_tokens)


def _pin_query(llm, spec: RunSpec, query: str, tokens: list[int]) -> None:
    """Locret-Q: pin the prompt's tokens through the question (the C library's rule, as the tools) when the
    prompt starts the sequence (after llm.reset(), the next eval empties it first)."""
    from .. import eviction

    llm.locret_pin_next_prompt(eviction.model_query_tokens(llm, tokens, query, spec.budget))


def _prefill(llm, spec: RunSpec, item: Item, evicting: bool, heat: list | None) -> int:
    """Evaluate the prompt; returns the most cells in use seen (0 without eviction). An evicting run feeds one
    chunk (ubatch) per call (the same chunks as one call: each call starts on a chunk boundary) so that its
    cell count is read after every chunk, as the cache's peak (budget + a chunk before each eviction), not
    only at the end; with `heat`, the retained units are read after each chunk too."""
    tokens = prompt_of(spec, item)
    llm.locret_pin_next_prompt(None)
    if query_of(spec, item):
        _pin_query(llm, spec, query_of(spec, item), tokens)
    if not evicting:
        llm.eval(tokens)
        return 0
    n_layer, n_head_kv = kv_heads(llm)
    most = 0
    for start in range(0, len(tokens), spec.ubatch):
        part = tokens[start: start + spec.ubatch]
        llm.eval(part, prompt_continues=start + spec.ubatch < len(tokens))
        most = max(most, int(llm.locret_stats()["n_cells_used"]))
        if heat is not None:
            heat.append(_retained_histogram(llm, n_layer, n_head_kv, len(tokens)))
    return most


def run_item(llm, spec: RunSpec, item: Item, evicting: bool) -> dict:
    llm.reset()  # the next eval empties the sequence, and with it the cache's eviction count
    heat: list | None = [] if evicting and item.id in spec.heatmap_ids and spec.heatmap_dir else None
    t0 = time.perf_counter()
    cells_prefill = _prefill(llm, spec, item, evicting, heat)
    t1 = time.perf_counter()
    answer, n_gen = decoding.greedy(llm, item.max_new_tokens)
    t2 = time.perf_counter()
    stats = llm.locret_stats() if evicting else {}
    out = dict(spec.labels, item=item.id, source=item.source, length=item.length, depth=item.depth,
               prompt_tokens=len(prompt_of(spec, item)), answer=answer, answers=list(item.answers),
               new_tokens=n_gen, prefill_s=round(t1 - t0, 4), decode_s=round(t2 - t1, 4),
               prefill_tok_s=round(len(prompt_of(spec, item)) / max(t1 - t0, 1e-9), 2),
               decode_tok_s=round(n_gen / (t2 - t1), 2) if n_gen and t2 > t1 else None,
               cells_used_max=max(cells_prefill, int(stats.get("n_cells_used", 0))) if evicting else None,
               n_cells=int(stats["n_cells"]) if evicting else None,
               evictions=int(stats["n_evictions"]) if evicting else 0,
               pinned=int(stats["n_pinned"]) if evicting else 0, pool=int(stats["pool"]) if evicting else 0,
               kv_bytes=int(stats["kv_bytes"]) if evicting else None, extra=item.extra)
    # the real-text needle tasks: right, a confusion (another needle's value, a number of the document) or a miss
    out.update(outcome(item, answer))
    if spec.method in AUTO_QUERY_METHODS:
        # what the auto rule found, and whether it is the task's own question
        out["query_found"] = item.auto_query
        out["query_is_the_tasks"] = bool(item.auto_query) and item.auto_query.strip() == item.query.strip()
    if evicting:
        # what each evicting layer keeps (a budget schedule's per-layer budgets; the budget everywhere otherwise)
        out["layer_budgets"] = [b for b in (llm.locret_layer_budget(il) for il in range(kv_heads(llm)[0])) if b >= 0]
    if heat:
        safe = item.id.replace("/", "_")
        path = Path(spec.heatmap_dir) / f"{spec.name}__{safe}.npz"
        np.savez_compressed(path, retained=np.stack(heat).astype(np.float16), ubatch=spec.ubatch,
                            prompt_tokens=len(prompt_of(spec, item)), method=spec.name, item=item.id)
        out["heatmap"] = path.name
    return out


def _gpu_bytes() -> int | None:
    """GPU memory this process holds (llama.cpp allocates its buffers up front, so the end of a run is its
    peak), from nvidia-smi; None without an NVIDIA GPU."""
    import os

    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(os.getpid()) and parts[1].isdigit():
            return int(parts[1]) << 20
    return 0


def _exit_with_parent(poll_s: float = 1.0) -> None:
    """End this process when the evaluation that started it is gone: a parent killed by a signal runs no cleanup, and a
    worker left behind would go on computing for nobody (re-parented, its parent id changes)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def main(spec: RunSpec, items: list[Item], queue) -> None:
    """Process entry point."""
    _exit_with_parent()
    try:
        llm = make_llm(spec)
    except Exception as e:  # HeadsError, ValueError from llama-cpp-python: the parent reports it
        queue.put(("error", f"{spec.name}: cannot create the context: {e}"))
        return
    try:
        evicting = llm.locret_enabled
        if spec.method != "full" and not evicting:
            queue.put(("error", f"{spec.name}: the context does not evict (is libllama the patched build?)"))
            return
        for item in items:
            queue.put(("sample", run_item(llm, spec, item, evicting)))
        kv = int(llm.locret_stats()["kv_bytes"]) if evicting else None
        queue.put(("done", {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                            "gpu_bytes": _gpu_bytes(), "kv_bytes": kv}))
    except Exception:
        queue.put(("error", f"{spec.name}: {traceback.format_exc(limit=4)}"))
    finally:
        llm.close()
