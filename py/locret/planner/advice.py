"""`locret plan`'s plan: the parts of the predicted peak memory against the device's limit, the most slots that fit,
and what to change when a plan does not fit."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .. import devices
from ..devices import Device
from .accuracy import Choice, budget_for, parse_accuracy, points_for
from .inputs import ModelFacts, PlanError, parse_slots, read_heads, read_model, resolve_heads, row_size
from .measure import (COMPACT_MAX_SEQ, LOCRET_PART, LOCRET_SCORES_PART, SAMPLING_PART, Measured, _add_buffers,
                      _add_locret_buffers, measure, plain_kv_bytes)
from .memory import (KV_PAD, MAX_SLOTS, Part, Settings, _fmt, cells_per_layer, kv_bytes_per_layer,
                     place, policy_traits, resolve_settings, sized)

DEFAULT_ACCURACY = 0.9   # --accuracy: answers right at least this often, relative to full attention's


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


def plan(device: str, model: str, *, heads: str | None = None, context=None, budget=None, ubatch=None,
         stabilizers=None, kv_type=None, gpu_layers=None, measure_buffers: bool = True, policy=None,
         schedule=None, slots: int | str = 1, budget_mib: float | None = None, doc_tokens: int | None = None,
         accuracy: float | None = None) -> Plan:
    """Resolve settings and predict the peak memory of a model on a device; see the module doc. slots='max'
    plans the most slots (sequences served at once) whose memory fits the device, up to llama.cpp's 256.
    budget_mib: the budget as memory per slot (the largest whose KV cache and scores fit it; the library's rule,
    llama_locret_budget_for_mib), instead of `budget`. doc_tokens: the length of the documents served (prompt and
    answer); the budget is then the one that keeps `accuracy` (default 0.9) of full attention's right answers by the
    measured points of planner/accuracy.py, instead of `budget`, and a note sets the slot's KV beside plain
    llama.cpp's full cache of such a document."""
    choice = None
    if doc_tokens is not None:
        if budget is not None or budget_mib is not None:
            raise PlanError("--doc-tokens picks the budget for its documents: give it or --budget / --budget-mib, "
                            "not both")
        target = DEFAULT_ACCURACY if accuracy is None else parse_accuracy(accuracy)
        choice = _budget_for_documents(device, model, int(doc_tokens), target, ubatch)
        budget = choice.budget
    elif accuracy is not None:
        raise PlanError("--accuracy needs --doc-tokens: the budget it asks for depends on the documents' length")
    p = _plan_slots(device, model, slots, heads=heads, context=context, budget=budget, ubatch=ubatch,
                    stabilizers=stabilizers, kv_type=kv_type, gpu_layers=gpu_layers, measure_buffers=measure_buffers,
                    policy=policy, schedule=schedule, budget_mib=budget_mib)
    if choice is not None:
        p.notes.append(choice.describe(int(doc_tokens), target))
        p.notes.append(_beside_plain(p, int(doc_tokens)))
    return p


def _budget_for_documents(device: str, model: str, doc_tokens: int, target: float, ubatch) -> Choice:
    from .. import models

    dev = devices.load(device)
    facts = read_model(models.resolve(model, fetch=False))
    sc, _ = dev.size_class_for(facts.n_params)
    return budget_for(doc_tokens, target, sc.ubatch if ubatch is None else int(ubatch), points_for(model))


def _beside_plain(p: Plan, doc_tokens: int) -> str:
    """A slot's KV cache (the rule book's bytes) against what plain llama.cpp allocates for one slot of such a
    document (llama.cpp's own size, cells padded as it pads them; a sliding-window model's window layers hold only
    their window in both)."""
    s = p.settings
    plain_cells = -(-doc_tokens // KV_PAD) * KV_PAD
    ours = sum(kv_bytes_per_layer(p.model, s)) // s.slots
    plain = plain_kv_bytes(p.model.path, plain_cells, 1, s.ubatch, s.kv_type)
    return (f"KV a slot: {_fmt(ours)} in {s.n_cells} cells, where plain llama-server keeps {_fmt(plain)} for a whole "
            f"{doc_tokens}-token document ({plain_cells} cells): {plain / ours:.2f}x the slots in the same KV memory")


def _plan_slots(device: str, model: str, slots, **kw) -> Plan:
    """One slot count, or the most that fit ('max')."""
    measure_buffers = kw["measure_buffers"]
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
          measure_buffers, policy, schedule, slots: int, budget_mib: float | None) -> Plan:
    from .. import models

    dev = devices.load(device)
    model_path = models.resolve(model, fetch=False)
    facts = read_model(model_path)
    # the heads first: their recommendations are the rule book's defaults (e.g. a pyramid's room for a pinned question)
    scores_with_heads = policy_traits(policy).needs_heads
    heads_path, heads_origin = resolve_heads(model, model_path, facts, heads) if scores_with_heads else (None, "")
    settings = resolve_settings(dev, facts, context=context, budget=budget, ubatch=ubatch,
                                stabilizers=stabilizers, kv_type=kv_type, gpu_layers=gpu_layers, policy=policy,
                                schedule=schedule, slots=slots, budget_mib=budget_mib, heads=heads_path)
    traits = settings.traits
    if traits.needs_heads:
        head_tensors = read_heads(heads_path) if heads_path is not None else facts.head_tensors
    else:
        heads_path, heads_origin, head_tensors = None, f"none (policy {settings.policy} needs no heads)", ()
    kv_layers = kv_bytes_per_layer(facts, settings)
    parts = place(facts, head_tensors, settings, dev, kv_layers)
    out = Plan(device=dev, model=facts, heads_path=heads_path, head_tensors=head_tensors,
               settings=settings, parts=parts, measured=None)
    out.notes.append(f"retaining heads: {heads_origin}")
    if budget_mib is not None:
        out.notes.append(f"budget {settings.budget}: the largest whose KV cache and scores fit {budget_mib:g} MiB per slot "
                         f"(the tools' --locret-budget-mib {budget_mib:g} resolves to it)")
    if traits.reads_prompt_whole:
        out.notes.append(f"policy {settings.policy} reads each prompt whole before it evicts: the KV cache holds the "
                         f"context ({settings.n_cells} cells), not the budget; the budget bounds what generation keeps "
                         "after the prompt (lower --context to use less memory)")
    if settings.schedule != "uniform":
        lb = settings.layer_budgets
        # the rule book's bytes say which form the context takes: a cache per budget (every layer evicts, and their
        # cells differ), or one cache of n_cells for every layer (an iSWA model's)
        cells = [c for c in cells_per_layer(facts, settings, kv_bytes_per_layer(facts, settings)) if c]
        head = (f"budget schedule {settings.schedule}: the layers keep {settings.budget} units on average, the "
                f"largest {settings.largest_budget}; ")
        if len(lb) == len(cells) and len(set(cells)) > 1:
            out.notes.append(head + f"the layers of each budget share a KV cache of that budget plus the ubatch (the "
                             f"largest's {settings.n_cells} cells): {sum(cells) / (len(cells) * settings.n_cells):.0%} "
                             "of the cells one cache sized for the largest budget would hold")
            out.notes.append("layer cells (evicting layers in order): " + " ".join(map(str, cells)))
        else:
            out.notes.append(head + f"the KV cache is sized for the largest in every layer ({settings.n_cells} cells), "
                             f"the cells a smaller layer does not keep are masked out: the layers attend to "
                             f"{sum(lb) / (len(lb) * settings.n_cells):.0%} of the cells allocated")
        out.notes.append("layer budgets (evicting layers in order): " + " ".join(map(str, lb)))
    if not settings.size_class_covers:
        out.notes.append(f"{facts.n_params / 1e9:.1f}B parameters is above every size class of {dev.name}: "
                         f"using the largest class's settings ({settings.size_class})")
    if settings.n_cells > facts.n_ctx_train > 0:
        out.notes.append(f"the cache holds positions up to {settings.n_cells - 1}, beyond the model's training "
                         f"window ({facts.n_ctx_train}): a smaller "
                         f"{'context' if traits.reads_prompt_whole else 'budget'} keeps RoPE within it")
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


# --- what to change when it does not fit ----------------------------------------------------------

def _variant_total(p: Plan, **changes) -> int:
    """The checked pool's total with other settings, keeping the measured buffers (they shrink with the
    cache, so this is on the safe side)."""
    s = replace(p.settings, **changes)
    if {"budget", "context", "ubatch", "stabilizers", "policy", "schedule"} & changes.keys():
        s = sized(p.model, s)   # the cells per sequence change: the rule book sizes them again
    parts = place(p.model, p.head_tensors, s, p.device, kv_bytes_per_layer(p.model, s))
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
        if not s.traits.reads_prompt_whole and b >= s.ubatch and b > s.stabilizers and \
                _variant_total(p, budget=b) <= p.limit:
            tips.append(f"a smaller budget (--budget {b})")
    if s.traits.reads_prompt_whole:
        tips.append(f"a shorter context (--context): policy {s.policy} caches all of it before it evicts")
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
