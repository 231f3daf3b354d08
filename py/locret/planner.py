"""`locret plan`: Locret settings for a model on a device, and the peak memory they will need.

The settings come from the device profile's size class for the model (devices/*.toml), each one
overridable. The predicted peak memory is the sum of:

- weights: the tensor bytes that the model GGUF's header announces (+ the retaining heads file's),
  placed per layer the way llama.cpp places them for the GPU-layer count;
- KV cache: under Locret llama.cpp allocates pad(b + B, 256) cells whatever the context, and each
  cell of each layer holds one K row and one V row: cells x sum over layers of
  (row_size(type, n_embd_k_gqa) + row_size(type, n_embd_v_gqa)), as llama_kv_cache sizes its tensors;
- compute and output buffers: llama.cpp's own estimate. A child process loads the model with
  `no_alloc` (metadata only; llama.cpp then simulates every allocation instead of making it), creates
  a context with the same context, chunk, budget, heads and KV type, and reports the buffer sizes
  that llama.cpp logs ("compute buffer size = ...") and the KV bytes it sized. The child process
  keeps llama.cpp's global log hook and any abort away from the caller;
- sampling: every sequence's sampler holds arrays over the vocabulary (20 B per token, measured);
- Locret's own buffers, from the same child's log: the eviction graphs and move tables (one
  compaction's sequences, at most COMPACT_MAX_SEQ) and the score store with the units' positions
  (every slot).

The profile's memory.available_gib is the limit; a plan over it is refused with what to change.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from . import devices
from .devices import Device, DeviceError
from .gguf_header import ModelFileError, read_header

MIB = 1 << 20
GIB = 1 << 30
# K cache types that an evicting context refuses (ggml_ext/src/locret-settings.cpp): 4 bits compound under re-rotation
FOUR_BIT_KV_TYPES = ("q4_0", "q4_1", "iq4_nl")
MAX_SLOTS = 256              # LLAMA_MAX_SEQ: the most sequences (server slots) a llama.cpp context takes
KV_PAD = 256                 # llama.cpp pads the KV cache to 256 cells; Locret sizes it pad(b + B, 256)
DEFAULT_CONTEXT = 131072     # logical context when none is given ("128k"); memory does not depend on it
EXIT_DOES_NOT_FIT = 3        # 1 is a bad input, 3 a valid plan that does not fit the device
_RESULT_MARK = "LOCRET_PLAN_MEASURE "


class PlanError(ValueError):
    """An impossible setting or an unusable input; the message says which and what to do."""


# --- inputs --------------------------------------------------------------------------------------

def parse_context(text: str | int) -> int:
    """'128k' -> 131072, '1m' -> 1048576, '131072' -> 131072 (k and m are powers of two, as context
    sizes are usually meant)."""
    m = re.fullmatch(r"\s*([0-9]+)\s*([kKmM]?)\s*", str(text))
    if not m:
        raise PlanError(f"context '{text}' is not a number of tokens like 131072, 128k or 1m")
    value = int(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20}[m.group(2).lower()]
    if value < 1:
        raise PlanError(f"context must be at least 1 token (got '{text}')")
    if value > 0xFFFFFFFF:
        raise PlanError(f"context '{text}' does not fit llama.cpp's 32-bit n_ctx")
    return value


def parse_gpu_layers(text: str | int | None) -> int | None:
    """'all' -> -1 (llama.cpp's 'every layer'), a number >= 0 as is, None stays None."""
    if text is None:
        return None
    if str(text).strip().lower() == "all":
        return -1
    try:
        value = int(str(text))
    except ValueError:
        raise PlanError(f"GPU layers must be 'all' or a number >= 0 (got '{text}')") from None
    if value < 0:
        raise PlanError(f"GPU layers must be 'all' or a number >= 0 (got {value})")
    return value


# --- what the GGUF header says --------------------------------------------------------------------

def _type_sizes():
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # (block size, bytes per block) per ggml type

    return GGML_QUANT_SIZES, GGMLQuantizationType


def row_size(type_name: str, n: int) -> int:
    """Bytes of n elements of a ggml type, as ggml_row_size (n must be a whole number of blocks)."""
    sizes, types = _type_sizes()
    block, type_size = sizes[types[type_name.upper()]]
    return n // block * type_size


_LAYER = re.compile(r"^(?:locret\.)?blk\.(\d+)\.")


@dataclass(frozen=True)
class ModelFacts:
    """What the planner needs from a model GGUF (and a heads GGUF)."""

    path: Path
    arch: str
    name: str
    n_layer: int
    n_ctx_train: int
    n_embd_k_gqa: tuple[int, ...]   # per layer: n_head_kv(il) * head_dim_k
    n_embd_v_gqa: tuple[int, ...]
    n_params: int                   # model tensors only (merged heads excluded)
    tensors: tuple[tuple[str, int], ...]       # (name, bytes) of the model's own tensors
    head_tensors: tuple[tuple[str, int], ...]  # (name, bytes) of locret.* tensors embedded in the file

    @property
    def weight_bytes(self) -> int:
        return sum(b for _, b in self.tensors)

    @property
    def tied_output(self) -> bool:
        """No output.weight: llama.cpp reuses token_embd as the output matrix (one more copy on a GPU)."""
        return not any(n == "output.weight" for n, _ in self.tensors)


def read_model(path: Path) -> ModelFacts:
    header = read_header(path)
    kv = header.kv
    arch = kv.get("general.architecture")
    if not isinstance(arch, str):
        raise PlanError(f"{path}: no general.architecture: not a model GGUF")
    if kv.get("general.type") == "locret_heads":
        raise PlanError(f"{path} is a retaining heads file, not a model: give it with --heads")

    def hp(key: str, default=None):
        value = kv.get(f"{arch}.{key}", default)
        if value is None:
            raise PlanError(f"{path}: the header has no {arch}.{key}; cannot size the KV cache")
        return value

    n_layer = int(hp("block_count"))

    def per_layer(value, what: str) -> list[int]:
        values = list(value) if isinstance(value, list) else [int(value)] * n_layer
        if len(values) != n_layer:
            raise PlanError(f"{path}: {arch}.{what} has {len(values)} entries for {n_layer} layers")
        return [int(v) for v in values]

    n_embd = int(hp("embedding_length"))
    n_head = per_layer(hp("attention.head_count"), "attention.head_count")
    n_head_kv = per_layer(hp("attention.head_count_kv", n_head), "attention.head_count_kv")
    # llama.cpp's defaults: head size n_embd / n_head unless the file states key/value lengths
    dim_k = int(hp("attention.key_length", n_embd // max(n_head[0], 1)))
    dim_v = int(hp("attention.value_length", n_embd // max(n_head[0], 1)))
    own = [(t.name, t.n_bytes, t.n_elements) for t in header.tensors if not t.name.startswith("locret.")]
    heads = [(t.name, t.n_bytes) for t in header.tensors if t.name.startswith("locret.")]
    return ModelFacts(path=path, arch=arch, name=str(kv.get("general.name") or path.stem), n_layer=n_layer,
                      n_ctx_train=int(hp("context_length", 0)),
                      n_embd_k_gqa=tuple(h * dim_k for h in n_head_kv),
                      n_embd_v_gqa=tuple(h * dim_v for h in n_head_kv),
                      n_params=sum(ne for _, _, ne in own),
                      tensors=tuple((n, b) for n, b, _ in own), head_tensors=tuple(heads))


def read_heads(path: Path) -> tuple[tuple[str, int], ...]:
    """(name, bytes) of a standalone heads file's tensors."""
    header = read_header(path)
    kind = header.kv.get("general.type")
    if kind != "locret_heads":
        raise PlanError(f"{path} is not a retaining heads file (general.type is {kind!r})")
    return tuple((t.name, t.n_bytes) for t in header.tensors)


# --- settings -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Settings:
    size_class: str
    size_class_covers: bool      # False: the model is above every class of the profile
    context: int
    budget: int
    ubatch: int
    stabilizers: int
    kv_type: str
    gpu_layers: int              # -1: all
    overridden: tuple[str, ...]  # which ones the caller set
    policy: str = "heads"        # eviction policy; "sage" (SAGE-KV) reads each prompt whole before it evicts
    schedule: str = "uniform"    # budget schedule: uniform, pyramid, or a file of per-layer budgets
    largest_budget: int = 0      # the largest layer budget of a schedule (0: uniform, the budget itself)
    slots: int = 1               # sequences served at once (llama-server -np): one stream of n_cells each

    @property
    def n_cells(self) -> int:
        """Cells of one sequence's stream."""
        # SAGE-KV's cache holds the whole context; every other policy's the (largest layer) budget and one chunk
        held = self.context if self.policy == "sage" else max(self.budget, self.largest_budget) + self.ubatch
        return -(-held // KV_PAD) * KV_PAD

    @property
    def n_ctx(self) -> int:
        """llama.cpp's -c: with several slots it is split between them (non-unified KV), so each gets `context`."""
        return self.context * self.slots

    def llama_args(self, heads: Path | None) -> list[str]:
        """The same settings as llama.cpp tool flags."""
        args = [f"--locret-heads {heads}"] if heads is not None and self.policy == "heads" else []
        args += [f"--locret-budget {self.budget}", f"-ub {self.ubatch}"]
        if self.policy != "heads":
            args.append(f"--locret-policy {self.policy}")
        if max(self.ubatch, self.slots) > 2048:
            # llama.cpp caps the ubatch at the batch (-b, 2048 by default in the tools) and asserts when the
            # context has more sequences than the batch has tokens
            args.append(f"-b {max(self.ubatch, self.slots)}")
        if self.policy != "sage":   # SAGE-KV's recent window is its own (b/4)
            args.append(f"--locret-stabilizers {self.stabilizers}")
        if self.schedule != "uniform":
            args.append(f"--locret-budget-schedule {self.schedule}")
        if self.slots > 1:
            args.append(f"-np {self.slots}")
        return args + [f"-ctk {self.kv_type}", f"-ctv {self.kv_type}",
                       f"-ngl {'all' if self.gpu_layers < 0 else self.gpu_layers}", f"-c {self.n_ctx}"]


def largest_layer_budget(schedule: str, budget: int, stabilizers: int) -> int:
    """The largest layer budget of a schedule (what the engine sizes the cache for): PyramidKV's first layer,
    2b minus the last layer's max(b/20, n_s + 1) (one unit more for rounding), or a file's largest entry."""
    if schedule == "uniform":
        return budget
    if schedule == "pyramid":
        return int(2 * budget - max(budget / 20, stabilizers + 1)) + 1
    try:
        words = [w for line in Path(schedule).read_text().splitlines() for w in line.split("#")[0].replace(",", " ").split()]
        return max(int(w) for w in words)
    except (OSError, ValueError) as e:
        raise PlanError(f"budget schedule '{schedule}' is neither uniform, pyramid nor a readable file of whole "
                        f"numbers ({e})") from None


def resolve_settings(device: Device, facts: ModelFacts, *, context=None, budget=None, ubatch=None,
                     stabilizers=None, kv_type=None, gpu_layers=None, policy=None, schedule=None,
                     slots: int = 1) -> Settings:
    """The profile's defaults for the model's size class, with the given overrides; PlanError for
    settings that cannot work."""
    sc, covers = device.size_class_for(facts.n_params)
    given = dict(context=context, budget=budget, ubatch=ubatch, stabilizers=stabilizers, kv_type=kv_type,
                 gpu_layers=gpu_layers)
    overridden = tuple(k for k, v in given.items() if v is not None)
    policy = "heads" if policy is None else str(policy)
    ctx = parse_context(context) if context is not None else DEFAULT_CONTEXT
    b = sc.budget if budget is None else int(budget)
    ub = sc.ubatch if ubatch is None else int(ubatch)
    if b < 1:
        raise PlanError(f"the budget must be at least 1 retained unit (got {b})")
    if ub < 1:
        raise PlanError(f"the ubatch (chunk) must be at least 1 token (got {ub})")
    if b + ub > 0x7FFFFFFF:
        raise PlanError(f"the budget ({b}) plus the ubatch ({ub}) exceeds what llama.cpp can address (2^31 - 1 cells)")
    if ub > b and policy != "sage":   # SAGE-KV compresses no chunk: it reads the prompt whole
        raise PlanError(f"the ubatch ({ub}) is larger than the budget ({b}): each chunk is compressed into the "
                        "budget, so give a budget of at least one ubatch (or a smaller --ubatch)")
    if ub > ctx:
        raise PlanError(f"the ubatch ({ub}) is larger than the context ({ctx})")
    from .eviction import POLICIES
    if policy not in POLICIES:
        raise PlanError(f"unknown eviction policy '{policy}': one of {', '.join(POLICIES)}")
    if policy == "sage":
        # SAGE-KV: b/4 sinks, b/2 chosen, b/4 recent (its own split); the whole prompt is cached before it evicts
        if stabilizers is not None:
            raise PlanError("SAGE-KV keeps its own recent window (b/4 units): --stabilizers does not apply to it")
        if b < 8:
            raise PlanError(f"with SAGE-KV the budget ({b}) must be at least 8 units")
        if ctx < b + ub:
            raise PlanError(f"SAGE-KV keeps the whole prompt before it evicts: the context ({ctx}) must be at least the "
                            f"budget plus the ubatch ({b} + {ub})")
        n_s = b // 4
    elif stabilizers is None:
        # the profile's value, fitted to the chunk and half the budget as llama.cpp fits its defaults
        n_s = min(sc.stabilizers, ub, b // 2)
    else:
        n_s = int(stabilizers)
        if n_s < 0 or n_s >= b or n_s > ub:
            raise PlanError(f"the stabilizers ({n_s}) must be >= 0, below the budget ({b}) and fit in one ubatch ({ub})")
    kv = (sc.kv_type if kv_type is None else str(kv_type)).lower()
    if kv not in devices.KV_TYPES:
        raise PlanError(f"unknown KV cache type '{kv}': one of {', '.join(devices.KV_TYPES)}")
    if kv in FOUR_BIT_KV_TYPES:
        raise PlanError(f"KV cache type {kv}: an evicting cache refuses a 4-bit K cache (every move re-quantizes the "
                        "key and the error compounds); use q8_0 or f16")
    block = _type_sizes()[0][_type_sizes()[1][kv.upper()]][0]
    bad = [w for w in set(facts.n_embd_k_gqa + facts.n_embd_v_gqa) if w % block]
    if bad:
        raise PlanError(f"KV cache type {kv} stores rows in blocks of {block}, but this model's K/V rows are "
                        f"{sorted(bad)[0]} wide: use f16")
    ngl = sc.gpu_layers if gpu_layers is None else parse_gpu_layers(gpu_layers)
    if device.build.backend == "cpu" and ngl != 0:
        raise PlanError(f"{device.name} has no GPU: GPU layers must be 0")
    schedule = "uniform" if schedule is None else str(schedule)
    if schedule != "uniform" and policy not in ("heads", "random", "streaming"):
        raise PlanError(f"a budget schedule works with the heads, random and streaming policies, not {policy}")
    slots = int(slots)
    if not 1 <= slots <= MAX_SLOTS:
        raise PlanError(f"slots must be between 1 and {MAX_SLOTS} (llama.cpp's limit on sequences), got {slots}")
    if ctx * slots > 0xFFFFFFFF:
        raise PlanError(f"{slots} slots of {ctx} tokens exceed llama.cpp's context size (2^32 - 1 in all)")
    return Settings(size_class=sc.name, size_class_covers=covers, context=ctx, budget=b, ubatch=ub,
                    stabilizers=n_s, kv_type=kv, gpu_layers=ngl, overridden=overridden, policy=policy,
                    schedule=schedule, largest_budget=0 if schedule == "uniform" else largest_layer_budget(schedule, b, n_s),
                    slots=slots)


# --- memory ---------------------------------------------------------------------------------------

def kv_bytes_per_layer(facts: ModelFacts, n_cells: int, kv_type: str, slots: int = 1) -> list[int]:
    """Per layer, what llama_kv_cache allocates: a K tensor [n_embd_k_gqa, cells, streams] and a V tensor
    [n_embd_v_gqa, cells, streams] of the cache type, one stream per slot (Locret refuses unified KV with several
    sequences)."""
    return [slots * n_cells * (row_size(kv_type, k) + row_size(kv_type, v))
            for k, v in zip(facts.n_embd_k_gqa, facts.n_embd_v_gqa)]


def predict_kv_bytes(facts: ModelFacts, settings: Settings) -> int:
    return sum(kv_bytes_per_layer(facts, settings.n_cells, settings.kv_type, settings.slots))


def _on_gpu(n_layer: int, gpu_layers: int, backend: str) -> tuple[set[int], bool]:
    """Repeating layers and whether the output layer go to the GPU, as llama.cpp assigns them: with N GPU
    layers, layers il >= n_layer + 1 - N (the output layer counting as il = n_layer); -1 is all."""
    if backend == "cpu":
        return set(), False
    n = n_layer + 1 if gpu_layers < 0 else min(gpu_layers, n_layer + 1)
    start = n_layer + 1 - n
    return {il for il in range(n_layer) if il >= start}, n >= 1


@dataclass
class Part:
    what: str
    device_bytes: int   # in GPU memory (discrete devices only)
    host_bytes: int     # in system RAM (everything, on unified and CPU devices)
    how: str


def place(facts: ModelFacts, heads: tuple[tuple[str, int], ...], settings: Settings, device: Device,
          kv_per_layer: list[int]) -> list[Part]:
    """Weights, heads and KV cache split between GPU memory and host RAM."""
    gpu_layers, output_on_gpu = _on_gpu(facts.n_layer, settings.gpu_layers, device.build.backend)

    def on_gpu(name: str) -> bool:
        m = _LAYER.match(name)
        if m:
            return int(m.group(1)) in gpu_layers
        return name.startswith("output") and output_on_gpu  # token_embd (input layer) stays on the CPU

    w_dev = sum(b for n, b in facts.tensors if on_gpu(n))
    w_host = facts.weight_bytes - w_dev
    how = f"tensor bytes in {facts.path.name}"
    if facts.tied_output and output_on_gpu:
        # the output layer reuses token_embd: llama.cpp loads a second copy of it on the output device
        w_dev += sum(b for n, b in facts.tensors if n == "token_embd.weight")
        how += " + the tied output matrix's GPU copy"
    h_dev = sum(b for n, b in heads if on_gpu(n))
    kv_dev = sum(b for il, b in enumerate(kv_per_layer) if il in gpu_layers)
    parts = [Part("weights", w_dev, w_host, how),
             Part("retaining heads", h_dev, sum(b for _, b in heads) - h_dev, "tensor bytes of the heads"),
             Part("KV cache", kv_dev, sum(kv_per_layer) - kv_dev,
                  f"{settings.n_cells} cells = pad("
                  f"{settings.context if settings.policy == 'sage' else f'{max(settings.budget, settings.largest_budget)} + {settings.ubatch}'}, "
                  f"{KV_PAD}) x "
                  + (f"{settings.slots} slots x " if settings.slots > 1 else "")
                  + f"{facts.n_layer} layers x (K {facts.n_embd_k_gqa[0]} + V {facts.n_embd_v_gqa[0]}) x {settings.kv_type}")]
    if device.memory.kind != "discrete":
        # one memory: what llama.cpp puts in CUDA buffers is the same RAM
        for p in parts:
            p.host_bytes, p.device_bytes = p.host_bytes + p.device_bytes, 0
    return parts


# --- llama.cpp's own estimate ---------------------------------------------------------------------

@dataclass
class Measured:
    """What llama.cpp reported for a no_alloc model + context with the plan's settings."""

    compute: dict[str, int]       # buffer type -> bytes ("CPU", "CUDA0", "CUDA_Host", ...)
    output: dict[str, int]
    kv_bytes: int                 # ggml_nbytes of the cache's K and V tensors (llama_locret_get_stats)
    kv_log_bytes: int             # "llama_kv_cache: size = ... MiB"
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
            return Measured(**data)
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
    from . import eviction
    from .heads import HeadsError, _last_error

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
    try:
        sage = request.get("policy") == "sage"
        heads = eviction.configure(model, request["model"], heads=None if sage else request["heads"],
                                   budget=request["budget"], stabilizers=None if sage else request["stabilizers"],
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
    cp.n_threads = cp.n_threads_batch = 1
    cp.type_k = cp.type_v = int(types[request["kv_type"].upper()])
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        return {"error": _last_error() or errors()}
    stats = eviction.stats(ctx)
    text = "".join(t for _, t in lines)
    compute: dict[str, int] = {}
    output: dict[str, int] = {}
    for name, mib in re.findall(r"(\S+) compute buffer size = +([0-9.]+) MiB", text):
        compute[name] = compute.get(name, 0) + round(float(mib) * MIB)
    for name, mib in re.findall(r"(\S+) +output buffer size = +([0-9.]+) MiB", text):
        output[name] = output.get(name, 0) + round(float(mib) * MIB)
    kv_log = re.findall(r"llama_kv_cache: size = +([0-9.]+) MiB", text)
    # Locret's own buffers beside the cache, as its creation log states them
    evict = re.findall(r"Locret eviction graphs: compute buffers ([0-9.]+) MiB, move tables ([0-9.]+) MiB, "
                       r"score store ([0-9.]+) MiB, up to ([0-9]+) sequences per compaction", text)
    result = dict(compute=compute, output=output, kv_bytes=int(stats["kv_bytes"]),
                  kv_log_bytes=round(float(kv_log[-1]) * MIB) if kv_log else 0, n_cells=int(stats["n_cells"]),
                  stabilizers=int(stats["stabilizers"]), local=int(stats["local"]),
                  model_size=int(L.llama_model_size(model)), n_params=int(L.llama_model_n_params(model)),
                  locret=dict(zip(("eviction graphs", "move tables", "score store"),
                                  (round(float(x) * MIB) for x in evict[-1][:3]))) if evict else {},
                  compact_seq=int(evict[-1][3]) if evict else 1,
                  n_vocab=int(L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))))
    L.llama_free(ctx)
    del heads
    L.llama_model_free(model)
    return result


# --- the plan -------------------------------------------------------------------------------------

@dataclass
class Plan:
    device: Device
    model: ModelFacts
    heads_path: Path | None
    head_tensors: tuple[tuple[str, int], ...]
    settings: Settings
    parts: list[Part]
    measured: Measured | None
    notes: list[str] = field(default_factory=list)

    @property
    def pool(self) -> str:
        """Which memory the profile's limit applies to."""
        return "device" if self.device.memory.kind == "discrete" else "host"

    def total(self, pool: str | None = None) -> int:
        pool = pool or self.pool
        return sum(p.device_bytes if pool == "device" else p.host_bytes for p in self.parts)

    @property
    def limit(self) -> int:
        return self.device.memory.available_bytes

    @property
    def fits(self) -> bool:
        return self.measured is not None and self.total() <= self.limit

    def as_dict(self) -> dict:
        return dict(device=self.device.name, model=str(self.model.path), n_params=self.model.n_params,
                    heads=str(self.heads_path) if self.heads_path else None, settings=asdict(self.settings),
                    n_cells=self.settings.n_cells, parts=[asdict(p) for p in self.parts],
                    measured=asdict(self.measured) if self.measured else None, limit_bytes=self.limit,
                    limit_pool=self.pool, total_bytes=self.total(), fits=self.fits, notes=self.notes,
                    refusal=None if self.fits else refusal(self))


def resolve_heads(model_arg: str, model_path: Path, facts: ModelFacts, heads: str | None, *,
                  query: bool = False) -> tuple[Path | None, str]:
    """The heads file to score with (None: the model embeds heads) and where it came from. `query`: for
    Locret-Q, the shipped heads trained with the question in front where the model has them, else the plain."""
    from . import models

    if heads is not None:
        return Path(heads), "given"
    if facts.head_tensors:
        return None, "embedded in the model"
    # the repository's trained heads, for a registered model given by name or by its file
    for name in models.SHIPPED_HEADS:
        shipped = models.shipped_heads(name)
        if shipped is None:
            continue
        query_heads = models.shipped_heads(name, query=True) if query else None
        if query_heads is not None:
            shipped, what = query_heads, "shipped Locret-Q heads for this model (heads/)"
        else:
            what = "shipped for this model (heads/)"
        if model_arg == name:
            return shipped, what
        try:
            if models.resolve(name, fetch=False).resolve() == model_path.resolve():
                return shipped, what
        except ModelFileError:
            continue  # that model is not installed
    raise PlanError(f"no retaining heads for {model_path.name}: give --heads H.gguf (Locret scores the KV cache "
                    "with them; `locret convert` makes them)")


def parse_slots(text: str | int | None) -> int | str:
    """--slots: a count, or 'max' (the most that fit the device's memory)."""
    if text is None:
        return 1
    if str(text).strip().lower() == "max":
        return "max"
    try:
        return int(text)
    except ValueError:
        raise PlanError(f"slots must be a whole number or 'max', got '{text}'") from None


def plan(device: str, model: str, *, heads: str | None = None, context=None, budget=None, ubatch=None,
         stabilizers=None, kv_type=None, gpu_layers=None, measure_buffers: bool = True, policy=None,
         schedule=None, slots: int | str = 1) -> Plan:
    """Resolve settings and predict the peak memory of a model on a device; see the module doc. slots='max'
    plans the most slots (sequences served at once) whose memory fits the device, up to llama.cpp's 256."""
    kw = dict(heads=heads, context=context, budget=budget, ubatch=ubatch, stabilizers=stabilizers, kv_type=kv_type,
              gpu_layers=gpu_layers, measure_buffers=measure_buffers, policy=policy, schedule=schedule)
    slots = parse_slots(slots)
    if slots != "max":
        return _plan(device, model, slots=slots, **kw)
    one = _plan(device, model, slots=1, **kw)
    if one.total() > one.limit or (measure_buffers and not one.fits):
        return one     # not even one slot: the refusal says what to change
    n = _slots_that_fit(one)
    while True:
        # measured again at n: llama.cpp's compute buffers may grow with the number of sequences
        p = _plan(device, model, slots=n, **kw)
        if p.total() <= p.limit or n == 1:
            break
        step = _variant_total(p, slots=n + 1) - p.total()
        n = max(1, min(n - 1, n - -(-(p.total() - p.limit) // max(step, 1))))
    why = (f"llama.cpp's limit of {MAX_SLOTS} sequences" if n == MAX_SLOTS
           else f"one more slot adds {_fmt(_variant_total(p, slots=n + 1) - p.total())} and would exceed the limit")
    p.notes.append(f"slots: {n}, the most that fit ({why})")
    return p


def _slots_that_fit(p: Plan) -> int:
    """The largest slot count whose pool total stays under the limit, from the plan's parts scaled to each count (the
    KV cache and the score store grow with every slot, the eviction buffers only up to one compaction's sequences),
    the measured compute buffers kept. The total grows with the slots: a bisection finds the count."""
    if _variant_total(p, slots=MAX_SLOTS) <= p.limit:
        return MAX_SLOTS
    lo, hi = 1, MAX_SLOTS - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _variant_total(p, slots=mid) <= p.limit:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _plan(device: str, model: str, *, heads, context, budget, ubatch, stabilizers, kv_type, gpu_layers,
          measure_buffers, policy, schedule, slots: int) -> Plan:
    from . import models

    dev = devices.load(device)
    model_path = models.resolve(model, fetch=False)
    facts = read_model(model_path)
    settings = resolve_settings(dev, facts, context=context, budget=budget, ubatch=ubatch,
                                stabilizers=stabilizers, kv_type=kv_type, gpu_layers=gpu_layers, policy=policy,
                                schedule=schedule, slots=slots)
    if settings.policy == "heads":
        heads_path, heads_origin = resolve_heads(model, model_path, facts, heads)
        head_tensors = read_heads(heads_path) if heads_path is not None else facts.head_tensors
    else:
        heads_path, heads_origin, head_tensors = None, f"none (policy {settings.policy} needs no heads)", ()
    kv_layers = kv_bytes_per_layer(facts, settings.n_cells, settings.kv_type, settings.slots)
    parts = place(facts, head_tensors, settings, dev, kv_layers)
    out = Plan(device=dev, model=facts, heads_path=heads_path, head_tensors=head_tensors,
               settings=settings, parts=parts, measured=None)
    out.notes.append(f"retaining heads: {heads_origin}")
    if settings.policy == "sage":
        out.notes.append(f"SAGE-KV reads each prompt whole before it evicts: the KV cache holds the context "
                         f"({settings.n_cells} cells), not the budget; the budget bounds what generation keeps after "
                         "the prompt (lower --context to use less memory)")
    if settings.schedule != "uniform":
        out.notes.append(f"budget schedule {settings.schedule}: the layers keep {settings.budget} units on average, "
                         f"the largest {settings.largest_budget}; the KV cache is sized for the largest in every layer "
                         f"({settings.n_cells} cells), the cells a smaller layer does not keep are masked out")
    if not settings.size_class_covers:
        out.notes.append(f"{facts.n_params / 1e9:.1f}B parameters is above every size class of {dev.name}: "
                         f"using the largest class's settings ({settings.size_class})")
    if settings.n_cells > facts.n_ctx_train > 0:
        out.notes.append(f"the cache holds positions up to {settings.n_cells - 1}, beyond the model's training "
                         f"window ({facts.n_ctx_train}): a smaller "
                         f"{'context' if settings.policy == 'sage' else 'budget'} keeps RoPE within it")
    if settings.context <= settings.budget:
        out.notes.append(f"the context ({settings.context}) fits in the budget: nothing will be evicted")
    if out.total() > out.limit or not measure_buffers:
        # weights and KV alone are over the limit: no estimate of the buffers can change the answer
        out.notes.append("compute buffers not measured" + (": weights and KV cache alone exceed the limit"
                                                           if out.total() > out.limit else ""))
        return out
    m = measure(model_path, heads_path, settings)
    out.measured = m
    _add_buffers(out, m)
    _add_locret_buffers(out, m)
    predicted_kv = sum(kv_layers)
    if m.kv_bytes and abs(m.kv_bytes - predicted_kv) > 0.05 * m.kv_bytes:
        out.notes.append(f"llama.cpp sized the KV cache at {_fmt(m.kv_bytes)}, not the predicted {_fmt(predicted_kv)}")
    return out


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
# the most sequences one compaction moves (llama_locret_memory::COMPACT_MAX_SEQ; a test checks the creation log agrees)
COMPACT_MAX_SEQ = 4
LOCRET_PART = "Locret eviction"      # the eviction graphs' compute buffers and move tables: one compaction's sequences
LOCRET_SCORES_PART = "Locret scores"  # the score store and the units' positions: every slot's


def _add_locret_buffers(out: Plan, m: Measured) -> None:
    """Locret's own memory beside the cache, from its creation log. Two parts, since they grow differently with the
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


def _fmt(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.2f} MiB"


# --- what to change when it does not fit ----------------------------------------------------------

def _variant_total(p: Plan, **changes) -> int:
    """The checked pool's total with other settings, keeping the measured buffers (they shrink with the
    cache, so this is on the safe side)."""
    s = replace(p.settings, **changes)
    if "budget" in changes and s.schedule == "pyramid":
        s = replace(s, largest_budget=largest_layer_budget(s.schedule, s.budget, s.stabilizers))
    parts = place(p.model, p.head_tensors, s, p.device, kv_bytes_per_layer(p.model, s.n_cells, s.kv_type, s.slots))
    buffers = [x for x in p.parts if x.what in ("compute buffers", "output buffer")]
    total = sum(x.device_bytes if p.pool == "device" else x.host_bytes for x in parts + buffers)
    # Locret's own buffers grow with the cells: the scores' with every slot's, the eviction's with one compaction's
    scale = {SAMPLING_PART: s.slots / p.settings.slots,
             LOCRET_SCORES_PART: (s.n_cells * s.slots) / (p.settings.n_cells * p.settings.slots),
             LOCRET_PART: (s.n_cells * min(s.slots, COMPACT_MAX_SEQ))
             / (p.settings.n_cells * min(p.settings.slots, COMPACT_MAX_SEQ))}
    for x in p.parts:
        if x.what in scale:
            total += round(scale[x.what] * (x.device_bytes if p.pool == "device" else x.host_bytes))
    return total


def _pool_weights(p: Plan) -> int:
    weights = next(x for x in p.parts if x.what == "weights")
    return weights.device_bytes if p.pool == "device" else weights.host_bytes


def advice(p: Plan) -> list[str]:
    """Concrete changes that bring the plan under the limit, cheapest in quality first."""
    s, tips = p.settings, []
    # the largest budget that fits: the pool total is linear in the cell count, so solve for it
    step = _variant_total(p, budget=s.budget + KV_PAD) - p.total()   # bytes of 256 more cells
    if step > 0:
        fixed = p.total() - step * (s.n_cells // KV_PAD)               # everything but the cache's pool share
        cells = (p.limit - fixed) // step * KV_PAD
        b = cells - s.ubatch                      # the top budget of that 256-cell step
        if s.policy != "sage" and b >= s.ubatch and b > s.stabilizers and _variant_total(p, budget=b) <= p.limit:
            tips.append(f"a smaller budget (--budget {b})")
    if s.policy == "sage":
        tips.append("a shorter context (--context): SAGE-KV caches all of it before it evicts")
    if row_size("q8_0", 256) < row_size(s.kv_type, 256) and _variant_total(p, kv_type="q8_0") <= p.limit:
        tips.append("KV cache type q8_0 (--kv-type q8_0)")
    if p.pool == "device":
        n_layer = p.model.n_layer
        current = n_layer + 1 if s.gpu_layers < 0 else s.gpu_layers
        for n in range(current - 1, -1, -1):
            if _variant_total(p, gpu_layers=n) <= p.limit:
                tips.append(f"fewer GPU layers (--gpu-layers {n}; the others run on the CPU, slower)")
                break
    tips.append("a smaller or more quantized model")
    return tips


def refusal(p: Plan) -> str:
    where = "GPU memory" if p.pool == "device" else "memory"
    head = (f"does not fit on {p.device.name}: predicted peak {_fmt(p.total())} > {_fmt(p.limit)} of {where} available "
            f"to the model (memory.available_gib in {p.device.path.name})")
    tips = advice(p)
    if _pool_weights(p) > p.limit and p.pool != "device":
        return f"{head}; the weights alone ({_fmt(_pool_weights(p))}) exceed it: use a smaller or more quantized model"
    unmeasured = "" if p.measured else " (compute buffers come on top: plan again with the new settings)"
    return f"{head}; to fit, use " + ", or ".join(tips) + unmeasured


# --- report ---------------------------------------------------------------------------------------

def format_plan(p: Plan) -> str:
    d, m, s = p.device, p.model, p.settings
    mem = d.memory
    lines = [f"device    {d.name}: {d.description}",
             f"          {mem.available_gib:.2f} GiB of {mem.total_gib:g} GiB available to the model "
             f"({mem.kind} memory, {mem.bandwidth_gbs:g} GB/s)",
             f"model     {m.path.name}: {m.arch}, {m.n_layer} layers, {m.n_params / 1e9:.3g}B parameters, "
             f"trained window {m.n_ctx_train} -> size class {s.size_class}",
             f"heads     {p.heads_path if p.heads_path else 'embedded in the model'}",
             f"settings  budget {s.budget}, chunk (ubatch) {s.ubatch}, stabilizers {s.stabilizers}, KV cache "
             f"{s.kv_type}, GPU layers {'all' if s.gpu_layers < 0 else s.gpu_layers}, context {s.context}"
             + (f" per slot, {s.slots} slots" if s.slots > 1 else ""),
             f"          from {d.name}'s {s.size_class} defaults"
             + (f"; given: {', '.join(s.overridden)}" if s.overridden else ""),
             f"llama.cpp {' '.join(s.llama_args(p.heads_path))}",
             "predicted peak memory:"]
    discrete = mem.kind == "discrete"
    if discrete:
        lines.append(f"  {'':18s} {'GPU':>11s} {'host RAM':>11s}")
    for part in p.parts:
        cols = (f"{_fmt(part.device_bytes):>11s} {_fmt(part.host_bytes):>11s}" if discrete
                else f"{_fmt(part.host_bytes):>11s}")
        lines.append(f"  {part.what:18s} {cols}   {part.how}")
    if p.measured is not None:
        lines.append(f"  (llama.cpp: KV cache {_fmt(p.measured.kv_bytes)} in {p.measured.n_cells} cells, model tensors "
                     f"{_fmt(p.measured.model_size)}, local tail {p.measured.local})")
    total = (f"{_fmt(p.total('device')):>11s} {_fmt(p.total('host')):>11s}" if discrete else f"{_fmt(p.total()):>11s}")
    lines.append(f"  {'total':18s} {total}")
    verdict = ("fits" if p.fits else "does NOT fit") if p.measured is not None or p.total() > p.limit else "not checked"
    lines.append(f"limit     {_fmt(p.limit)} ({'GPU memory' if discrete else 'memory'} available on {d.name}): "
                 f"{verdict} ({100.0 * p.total() / p.limit:.1f} % used)")
    lines += [f"note      {n}" for n in p.notes]
    return "\n".join(lines)


def run_cli(args) -> int:
    """`locret plan` (arguments from cli.py): print the plan; exit 0 if it fits, 3 if not, 1 on bad input."""
    try:
        p = plan(args.device, args.model, heads=args.heads, context=args.context, budget=args.budget,
                 ubatch=args.ubatch, stabilizers=args.stabilizers, kv_type=args.kv_type, gpu_layers=args.gpu_layers,
                 policy=getattr(args, "policy", None), schedule=getattr(args, "budget_schedule", None),
                 slots=getattr(args, "slots", None) or 1)
    except (DeviceError, PlanError, ModelFileError, RuntimeError) as e:
        print(f"locret: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(p.as_dict(), indent=1) if args.json else format_plan(p))
    if not p.fits:
        print(f"locret: error: {refusal(p)}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--measure"] and len(sys.argv) == 3:
        try:
            result = _measure_main(json.loads(sys.argv[2]))
        except Exception as e:  # reported to the parent as one line
            result = {"error": f"{type(e).__name__}: {e}"}
        print(_RESULT_MARK + json.dumps(result), flush=True)
        sys.exit(0)
    print("usage: python -m locret.planner --measure JSON  (internal; use `locret plan`)", file=sys.stderr)
    sys.exit(2)
