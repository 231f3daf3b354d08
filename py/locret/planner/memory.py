"""`locret plan`'s memory model: the settings (the profile's defaults and the caller's overrides), the KV cache's
bytes per layer and the placement of weights, heads and cache between GPU memory and host RAM."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from .. import devices
from ..devices import Device
from .inputs import _LAYER, ModelFacts, PlanError, _type_sizes, parse_context, parse_gpu_layers, row_size

MIB = 1 << 20
GIB = 1 << 30
MAX_SLOTS = 256              # LLAMA_MAX_SEQ: the most sequences (server slots) a llama.cpp context takes
KV_PAD = 256                 # llama.cpp pads the KV cache to 256 cells; Locret sizes it pad(b + B, 256)
DEFAULT_CONTEXT = 131072     # logical context when none is given ("128k"); memory does not depend on it


# --- settings -------------------------------------------------------------------------------------

def policy_traits(policy: str | None):
    """What a policy ("NAME" or "NAME:SETTINGS"; None: the default) is, from the library's rule book
    (locret.eviction.PolicyTraits): the planner knows no policy by name. PlanError with the library's reason for a
    spec that is not a policy."""
    from ..eviction import policy_traits as traits
    from ..heads import HeadsError

    try:
        return traits(None if policy is None else str(policy))
    except HeadsError as e:
        raise PlanError(str(e)) from None


def _default_policy() -> str:
    from ..eviction import DEFAULT_POLICY

    return DEFAULT_POLICY


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
    policy: str = "heads"        # eviction policy, NAME or NAME:SETTINGS; what it is: `traits` (e.g. SAGE-KV reads
                                 # each prompt whole before it evicts)
    schedule: str = "uniform"    # budget schedule: uniform, pyramid, or a file of per-layer budgets
    largest_budget: int = 0      # the largest layer budget of a schedule (0: uniform, the budget itself)
    slots: int = 1               # sequences served at once (llama-server -np): one stream of n_cells each
    n_cells: int = 0             # cells of one sequence's stream, as the library's rule book sizes it
    heads: str | None = None     # the heads file whose recommendations the rule book reads (None: the model's default)
    layer_budgets: tuple[int, ...] = ()  # the units each evicting layer keeps (a schedule's; the budget otherwise)

    @property
    def traits(self):
        """What the policy is (locret.eviction.PolicyTraits), from the library."""
        return policy_traits(self.policy)

    @property
    def n_ctx(self) -> int:
        """llama.cpp's -c: with several slots it is split between them (non-unified KV), so each gets `context`."""
        return self.context * self.slots

    def llama_args(self, heads: Path | None) -> list[str]:
        """The same settings as llama.cpp tool flags."""
        traits = self.traits
        args = [f"--locret-heads {heads}"] if heads is not None and traits.needs_heads else []
        args += [f"--locret-budget {self.budget}", f"-ub {self.ubatch}"]
        if self.policy != _default_policy():
            args.append(f"--locret-policy {self.policy}")
        if max(self.ubatch, self.slots) > 2048:
            # llama.cpp caps the ubatch at the batch (-b, 2048 by default in the tools) and asserts when the
            # context has more sequences than the batch has tokens
            args.append(f"-b {max(self.ubatch, self.slots)}")
        if not traits.sets_own_stabilizers:   # e.g. SAGE-KV's recent window is its own (b/4)
            args.append(f"--locret-stabilizers {self.stabilizers}")
        if self.schedule != "uniform":
            args.append(f"--locret-budget-schedule {self.schedule}")
        if self.slots > 1:
            args.append(f"-np {self.slots}")
        return args + [f"-ctk {self.kv_type}", f"-ctv {self.kv_type}",
                       f"-ngl {'all' if self.gpu_layers < 0 else self.gpu_layers}", f"-c {self.n_ctx}"]


def resolve_settings(device: Device, facts: ModelFacts, *, context=None, budget=None, ubatch=None,
                     stabilizers=None, kv_type=None, gpu_layers=None, policy=None, schedule=None,
                     slots: int = 1, budget_mib: float | None = None, heads: str | None = None) -> Settings:
    """The profile's defaults for the model's size class, with the given overrides; PlanError for
    settings that cannot work. budget_mib: the budget is the largest whose memory per slot fits it (the library's
    rule book, llama_locret_budget_for_mib), for the other settings as given or defaulted. heads: the heads file the
    context will load (its recommendations, e.g. a pyramid's room for a Locret-Q question, are the rule book's
    defaults); None: what the library finds for the model."""
    sc, covers = device.size_class_for(facts.n_params)
    if budget_mib is not None:
        if budget is not None:
            raise PlanError("give --budget (units) or --budget-mib (memory), not both")
        budget = _budget_for_mib(device, facts, float(budget_mib), heads=heads, context=context, ubatch=ubatch,
                                 stabilizers=stabilizers, kv_type=kv_type, policy=policy, schedule=schedule,
                                 slots=int(slots))
    given = dict(context=context, budget=budget, ubatch=ubatch, stabilizers=stabilizers, kv_type=kv_type,
                 gpu_layers=gpu_layers)
    overridden = tuple(k for k, v in given.items() if v is not None)
    policy = _default_policy() if policy is None else str(policy)
    traits = policy_traits(policy)
    ctx = parse_context(context) if context is not None else DEFAULT_CONTEXT
    b = sc.budget if budget is None else int(budget)
    ub = sc.ubatch if ubatch is None else int(ubatch)
    if b < 1:
        raise PlanError(f"the budget must be at least 1 retained unit (got {b})")
    if ub < 1:
        raise PlanError(f"the ubatch (chunk) must be at least 1 token (got {ub})")
    if b + ub > 0x7FFFFFFF:
        raise PlanError(f"the budget ({b}) plus the ubatch ({ub}) exceeds what llama.cpp can address (2^31 - 1 cells)")
    if ub > b and not traits.reads_prompt_whole:   # a policy that reads the prompt whole compresses no chunk
        raise PlanError(f"the ubatch ({ub}) is larger than the budget ({b}): each chunk is compressed into the "
                        "budget, so give a budget of at least one ubatch (or a smaller --ubatch)")
    if traits.sets_own_stabilizers:
        # the policy's own (e.g. SAGE-KV's recent window): `sized` takes the rule book's value; one given is passed on
        # for the rule book to refuse
        n_s = 0 if stabilizers is None else int(stabilizers)
    elif stabilizers is None:
        # the profile's value, fitted to the chunk and half the budget as llama.cpp fits its defaults
        n_s = min(sc.stabilizers, ub, b // 2)
    else:
        n_s = int(stabilizers)
    kv = (sc.kv_type if kv_type is None else str(kv_type)).lower()
    if kv not in devices.KV_TYPES:
        raise PlanError(f"unknown KV cache type '{kv}': one of {', '.join(devices.KV_TYPES)}")
    block = _type_sizes()[0][_type_sizes()[1][kv.upper()]][0]
    bad = [w for w in set(facts.n_embd_k_gqa + facts.n_embd_v_gqa) if w % block]
    if bad:
        raise PlanError(f"KV cache type {kv} stores rows in blocks of {block}, but this model's K/V rows are "
                        f"{sorted(bad)[0]} wide: use f16")
    ngl = sc.gpu_layers if gpu_layers is None else parse_gpu_layers(gpu_layers)
    if device.build.backend == "cpu" and ngl != 0:
        raise PlanError(f"{device.name} has no GPU: GPU layers must be 0")
    schedule = "uniform" if schedule is None else str(schedule)
    slots = int(slots)
    if not 1 <= slots <= MAX_SLOTS:
        raise PlanError(f"slots must be between 1 and {MAX_SLOTS} (llama.cpp's limit on sequences), got {slots}")
    if ctx * slots > 0xFFFFFFFF:
        raise PlanError(f"{slots} slots of {ctx} tokens exceed llama.cpp's context size (2^32 - 1 in all)")
    settings = Settings(size_class=sc.name, size_class_covers=covers, context=ctx, budget=b, ubatch=ub,
                        stabilizers=n_s, kv_type=kv, gpu_layers=ngl, overridden=overridden, policy=policy,
                        schedule=schedule, slots=slots, heads=None if heads is None else str(heads))
    return sized(facts, settings, own_stabilizers_given=traits.sets_own_stabilizers and stabilizers is not None)


def _budget_for_mib(device: Device, facts: ModelFacts, mib: float, *, heads, context, ubatch, stabilizers, kv_type, policy,
                    schedule, slots: int) -> int:
    from ..eviction import budget_for_mib
    from ..heads import HeadsError

    sc, _ = device.size_class_for(facts.n_params)
    ctx = parse_context(context) if context is not None else DEFAULT_CONTEXT
    ub = sc.ubatch if ubatch is None else int(ubatch)
    try:
        return budget_for_mib(facts.path, mib, heads=heads, n_ctx=ctx * slots, n_ubatch=ub, n_batch=max(ub, slots), n_seq=slots,
                              kv_type=(sc.kv_type if kv_type is None else str(kv_type)).lower(), swa_full=False,
                              policy=policy, stabilizers=stabilizers,
                              budget_schedule=None if schedule in (None, "uniform") else schedule)["budget"]
    except HeadsError as e:
        raise PlanError(str(e)) from None


def sized(facts: ModelFacts, settings: Settings, *, own_stabilizers_given: bool = False) -> Settings:
    """`settings` with the cells (and a schedule's largest layer budget) that the library's rule book gives them, and
    for a policy that sets its own stabilizers, the stabilizers it sets; PlanError with the rule book's message for
    settings a context would refuse (own_stabilizers_given: the caller gave stabilizers to such a policy, passed on
    for the rule book to refuse). Every refusal and size of an evicting context is written there once
    (llama_locret_resolve_file): the planner keeps no copy."""
    r = _resolved(facts, settings, own_stabilizers_given=own_stabilizers_given)
    s = settings
    if s.traits.sets_own_stabilizers:
        s = replace(s, stabilizers=r["stabilizers"])
    return replace(s, n_cells=r["n_cells"], largest_budget=0 if s.schedule == "uniform" else r["budget_max"],
                   layer_budgets=r["layer_budgets"])


def _resolved(facts: ModelFacts, s: Settings, *, own_stabilizers_given: bool = False) -> dict:
    from ..eviction import resolve_file
    from ..heads import HeadsError

    try:
        return resolve_file(facts.path, heads=s.heads, budget=s.budget, policy=s.policy, n_ctx=s.n_ctx, n_ubatch=s.ubatch,
                            n_batch=max(s.ubatch, s.slots), n_seq=s.slots, kv_type=s.kv_type, swa_full=False,
                            stabilizers=None if s.traits.sets_own_stabilizers and not own_stabilizers_given
                            else s.stabilizers,
                            budget_schedule=None if s.schedule == "uniform" else s.schedule)
    except HeadsError as e:
        raise PlanError(str(e)) from None


# --- memory ---------------------------------------------------------------------------------------

def kv_bytes_per_layer(facts: ModelFacts, settings: Settings) -> list[int]:
    """Per layer, the K and V bytes of every slot's stream as the library's rule book sizes them
    (llama_locret_resolve_file_layers): the evicting layers hold n_cells rows each, a sliding-window model's window
    layers their own window cache."""
    return [settings.slots * b for b in _resolved(facts, settings)["layer_kv_bytes"]]


def predict_kv_bytes(facts: ModelFacts, settings: Settings) -> int:
    return sum(kv_bytes_per_layer(facts, settings))


def cells_per_layer(facts: ModelFacts, s: Settings, kv_per_layer: list[int]) -> list[int]:
    """The cells each layer's cache holds per slot, from the rule book's bytes (0 for a layer without KV): n_cells, a
    window layer's own cache, or a budget schedule's cache of the layer's budget plus the ubatch."""
    return [b // (s.slots * (row_size(s.kv_type, k) + row_size(s.kv_type, v))) if b else 0
            for b, k, v in zip(kv_per_layer, facts.n_embd_k_gqa, facts.n_embd_v_gqa)]


def _kv_layers_text(facts: ModelFacts, s: Settings, kv_per_layer: list[int]) -> str:
    """'30 layers x (K 192 + V 192) x f16', with a sliding-window model's window layers and their own cells."""
    width = f"(K {facts.n_embd_k_gqa[0]} + V {facts.n_embd_v_gqa[0]}) x {s.kv_type}"
    rows = cells_per_layer(facts, s, kv_per_layer)
    n_window = sum(1 for r in rows if 0 < r != s.n_cells)
    if n_window == 0:
        return f"{facts.n_layer} layers x {width}"
    if len(s.layer_budgets) == facts.n_layer:
        # every layer evicts: a budget schedule's layers in a cache per budget, the largest budget's of n_cells
        n_full = sum(1 for r in rows if r == s.n_cells)
        return (f"{n_full} layers x {width}, + {n_window} layers in caches of their budget plus the ubatch "
                f"({min(r for r in rows if r)}-{max(r for r in rows if r != s.n_cells)} cells, "
                f"{len({r for r in rows if r})} caches in all)")
    window_cells = next(r for r in rows if 0 < r != s.n_cells)
    return (f"{len(rows) - n_window} evicting layers x {width}, + {n_window} window layers of {window_cells} "
            "cells each")


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
                  f"{settings.context if settings.traits.reads_prompt_whole else f'{max(settings.budget, settings.largest_budget)} + {settings.ubatch}'}, "
                  f"{KV_PAD}) x "
                  + (f"{settings.slots} slots x " if settings.slots > 1 else "")
                  + _kv_layers_text(facts, settings, kv_per_layer))]
    if device.memory.kind != "discrete":
        # one memory: what llama.cpp puts in CUDA buffers is the same RAM
        for p in parts:
            p.host_bytes, p.device_bytes = p.host_bytes + p.device_bytes, 0
    return parts


def _fmt(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.2f} MiB"
