"""The evaluation plan and its execution: methods x budgets x length groups, each one worker process;
every finished sample is appended to samples.jsonl at once, so the same command resumes a stopped run.

Output directory (-o):
    config.json     the settings and the heads each method used (a resumed run must have the same ones)
    samples.jsonl   one record per (run, item): answer, score, timings, cells, KV bytes
    runs.jsonl      one record per finished run: peak RSS (and GPU memory), KV bytes
    summary.json, summary.md, plots/*.png, heatmaps/*.npz
"""
from __future__ import annotations

import json
import multiprocessing
import queue as queue_module
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from tqdm import tqdm

from .. import devices, models, planner
from ..files import sha256_file
from ..threads import threads_or_default
from . import (HEADS_METHODS, METHODS, QUERY_METHODS, SCHEDULABLE_METHODS, TRAINED_HEADS_METHODS, items as items_module,
               report, split_method, uses_schedule_file)
from .items import Item, ItemError
from .worker import RunSpec, policy_of

EXIT_OVER_MEMORY = 3   # as `locret plan`: the settings ran, but the device's memory was exceeded
N_CTX_PAD = 256
RULER_MIN_LENGTH = 4096


class EvalError(ValueError):
    """Settings that cannot run; the message says what to change."""


@dataclass
class EvalConfig:
    model: str
    output: Path
    heads: str | None = None
    random_heads: str | None = None
    tasks: list[str] = field(default_factory=list)
    haystacks: list[str] = field(default_factory=lambda: ["prose"])  # the tasks' filler families
    lengths: list[int] = field(default_factory=list)
    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    samples: int | None = 1        # None: RULER's default (10 a task, 100 with layers on a GPU), else 1
    seed: int = 0
    benchmark: str | None = None
    datasets: list[str] = field(default_factory=list)
    benchmark_task: str | None = None
    limit: int | None = None
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    budgets: list[int] = field(default_factory=list)
    stabilizers: int | None = None
    local: int | None = None
    pool: int | None = None        # score pooling window of the heads methods (None: none)
    # each method's policy settings (--policy-settings METHOD:SETTINGS): the base method's name -> "key=value,..."
    # as the method's policy takes them after its name; the library parses and checks them ({}: every default)
    policy_settings: dict[str, str] = field(default_factory=dict)
    positions: str | None = None   # where kept units sit ("inplace", "compact", "keep", "keep:N"; None: the default)
    schedule: str | None = None    # the budget schedule file of locret-schedule and METHOD@schedule
    ubatch: int | None = None      # None: the device profile's, else 512
    threads: int = 2
    kv_type: str | None = None
    gpu_layers: int | None = None  # None: the device profile's, else 0
    max_new_tokens: int | None = None
    device: str | None = None
    heatmaps: int = 1
    max_minutes: float | None = None
    plots: bool = True
    held_out: bool = False         # refuse families the evaluated heads were trained on (heldout.py)
    suite: str | None = None       # "ruler": RULER's tasks from its own package, through llama-server (ruler/)
    ruler_mode: str = "chat"       # how RULER's samples are sent: "chat" (NVIDIA's launcher) or "completion"
    ruler_random_start: bool = True  # each essay haystack read from a random word (the package: always the first)
    ratios: list[float] = field(default_factory=list)  # compression ratios: budgets round((1 - r) x length) per length
    presses: list[str] = field(default_factory=list)   # kvpress's presses beside ours (kvpress_backend)
    press_settings: list[str] = field(default_factory=lambda: ["outside"])  # the question outside / compressed too
    press_heads: str | None = None  # the heads file of kvpress's LocretPress (default: the model's shipped heads)

    def fingerprint(self) -> dict:
        """What decides the samples' results (not where they go, nor the time limit or plotting)."""
        d = asdict(self)
        for k in ("output", "max_minutes", "plots", "heatmaps", "threads", "held_out"):
            d.pop(k)
        if d["haystacks"] == ["prose"]:
            d.pop("haystacks")  # what every run before the families was: such runs resume
        if not d["policy_settings"]:
            d.pop("policy_settings")  # likewise for runs from before policy settings (upgrade_record reads theirs)
        if d["positions"] is None:
            d.pop("positions")  # and from before kept positions
        for key, default in (("suite", None), ("ratios", []), ("presses", []), ("press_settings", ["outside"]),
                             ("press_heads", None),
                             ("ruler_mode", "chat"), ("ruler_random_start", True)):
            if d[key] == default:
                d.pop(key)      # and from before RULER and the kvpress side by side
        if d["schedule"] is None:
            d.pop("schedule")   # and from before schedule files
        else:
            d["schedule"] = {"file": d["schedule"], "sha256": sha256_file(d["schedule"])}  # its budgets decide
        if d.get("suite"):
            # RULER's samples of a (task, length, seed) are a prefix of a longer run's: more samples extend a run
            d.pop("samples")
        return d


def _pad(n: int) -> int:
    return -(-n // N_CTX_PAD) * N_CTX_PAD


def apply_device(cfg: EvalConfig, facts: planner.ModelFacts) -> devices.Device | None:
    """Fill unset settings from the device profile's size class (as `locret plan` does) and check every
    budget against the profile (PlanError saying what cannot work). Without a device: ubatch 512, CPU. Then the
    samples a cell, if not given."""
    dev = None
    if cfg.device is None:
        cfg.ubatch = 512 if cfg.ubatch is None else cfg.ubatch
        cfg.gpu_layers = 0 if cfg.gpu_layers is None else cfg.gpu_layers
    else:
        dev = devices.load(cfg.device)
        for b in sorted(cfg.budgets, reverse=True) or [None]:  # the smallest last: its stabilizers fit all
            s = planner.resolve_settings(dev, facts, budget=b, ubatch=cfg.ubatch, stabilizers=cfg.stabilizers,
                                         kv_type=cfg.kv_type, gpu_layers=cfg.gpu_layers)
        cfg.budgets = cfg.budgets or [s.budget]
        cfg.ubatch, cfg.stabilizers, cfg.kv_type, cfg.gpu_layers = s.ubatch, s.stabilizers, s.kv_type, s.gpu_layers
    if cfg.samples is None:  # decided once the layers' place is known (a profile may put them on its GPU)
        from ..ruler import default_samples

        cfg.samples = default_samples(cfg.gpu_layers) if cfg.suite else 1
    return dev


def validate(cfg: EvalConfig) -> None:
    try:
        bases = [split_method(m)[0] for m in cfg.methods]
    except ValueError as e:
        raise EvalError(str(e)) from None
    unknown = [m for m, base in zip(cfg.methods, bases) if base not in METHODS]
    if unknown or not cfg.methods:
        raise EvalError(f"unknown method(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(METHODS)}, and "
                        f"{'|'.join(SCHEDULABLE_METHODS)} with @pyramid or @schedule (per-layer budgets)")
    if len(set(cfg.methods)) != len(cfg.methods):
        raise EvalError(f"a method is given twice in --methods {','.join(cfg.methods)}")
    if bool(cfg.tasks) == bool(cfg.benchmark):
        raise EvalError("give either --tasks (generated tasks) or --benchmark with --dataset files, not both")
    validate_suite(cfg)
    if cfg.benchmark and not cfg.datasets:
        raise EvalError(f"--benchmark {cfg.benchmark} needs --dataset FILE.jsonl (the benchmark's own files, local)")
    if cfg.tasks and not cfg.lengths:
        raise EvalError("--tasks needs --lengths (prompt lengths in tokens, e.g. 4k,16k)")
    evicting = [m for m in cfg.methods if m != "full"]
    if evicting and not cfg.budgets and not cfg.ratios:
        raise EvalError(f"{', '.join(evicting)} need --budgets (retained units per layer and KV head) or --ratios")
    if any(x <= 0 for x in cfg.lengths + cfg.budgets) or cfg.samples <= 0 or cfg.ubatch <= 0 or cfg.threads <= 0:
        raise EvalError("lengths, budgets, samples, ubatch and threads must be positive")
    if cfg.heatmaps < 0 or (cfg.limit is not None and cfg.limit <= 0):
        raise EvalError("--heatmaps must be at least 0 and --limit positive")
    # the values themselves (stabilizers, pooling window, policy settings, local tail) are checked by the library's
    # rule book when the runs are planned (check_runs); these are the runner's own rules about which options go together
    if (problem := policy_settings_problem(cfg.policy_settings, bases)) is not None:
        raise EvalError(problem)
    if (problem := pool_problem(cfg.pool, bases)) is not None:
        raise EvalError(problem)
    for method in QUERY_METHODS:
        if method in bases and not cfg.tasks:
            raise EvalError(f"{method} places each generated task's question at the start of its prompt (the task's "
                            "own, or the one the auto rule finds); benchmark records have none here")
    if uses_schedule_file(cfg.methods) != (cfg.schedule is not None):
        raise EvalError("the method locret-schedule (and METHOD@schedule) runs the per-layer budgets of --schedule FILE "
                        "(e.g. from locret calibrate): give both or neither")
    if cfg.schedule is not None and not Path(cfg.schedule).is_file():
        raise EvalError(f"schedule file {cfg.schedule} does not exist")
    for d in cfg.datasets:
        if not Path(d).is_file():
            raise EvalError(f"dataset file {d} does not exist")


def validate_suite(cfg: EvalConfig) -> None:
    """The rules of RULER (--suite) and of the kvpress side by side (--presses, --ratios)."""
    from ..peers.kvpress_side import PRESSES, SETTINGS
    from ..ruler import SUITES
    from ..ruler.prompts import MODES

    if cfg.suite is not None and cfg.suite not in SUITES:
        raise EvalError(f"unknown suite {cfg.suite!r}; known: {', '.join(SUITES)}")
    if cfg.suite and any(n < RULER_MIN_LENGTH for n in cfg.lengths):
        # RULER's smallest length; below it the package's qa generator loops forever (no document count fits)
        raise EvalError(f"RULER's lengths start at {RULER_MIN_LENGTH} tokens (its 4K); got {','.join(map(str, cfg.lengths))}")
    from ..ruler import TASKS as RULER_TASKS

    unknown_tasks = [t for t in cfg.tasks if t not in RULER_TASKS] if cfg.suite else []
    if unknown_tasks:
        raise EvalError(f"unknown RULER task {', '.join(unknown_tasks)}; the package's tasks: {', '.join(RULER_TASKS)}")
    if cfg.suite and cfg.benchmark:
        raise EvalError("--suite ruler generates its own prompts: drop --benchmark")
    if cfg.ruler_mode not in MODES:
        raise EvalError(f"unknown --ruler-mode {cfg.ruler_mode!r}; valid: {', '.join(MODES)}")
    if cfg.suite and "locret-q" in cfg.methods:
        raise EvalError("locret-q gives the server the task's question in a field of its own, which RULER's client does "
                        "not send: use locret-q-auto (the question the server finds at the end of the request)")
    if cfg.budgets and cfg.ratios:
        raise EvalError("give --budgets or --ratios (budgets of round((1 - ratio) x length) per length), not both")
    if any(not 0 < r < 1 for r in cfg.ratios):
        raise EvalError(f"compression ratios are in (0, 1), got {','.join(map(str, cfg.ratios))}")
    unknown = [p for p in cfg.presses if p not in PRESSES]
    if unknown:
        raise EvalError(f"unknown kvpress press {', '.join(unknown)}; known: {', '.join(PRESSES)}")
    if cfg.presses and not cfg.suite:
        raise EvalError("--presses runs kvpress on RULER's samples: give --suite ruler")
    if cfg.presses and not cfg.ratios:
        raise EvalError("kvpress's presses compress by a ratio: give --ratios (ours then gets the same KV memory)")
    bad = [x for x in cfg.press_settings if x not in SETTINGS]
    if bad or not cfg.press_settings:
        raise EvalError(f"unknown --press-question {','.join(bad) or '(none)'}; valid: {', '.join(SETTINGS)}")


def budgets_for(cfg: EvalConfig, length: int) -> list[tuple[int, float | None]]:
    """(budget, compression ratio or None) of the evicting runs of a length group: --budgets as given, or the budget
    at each --ratios value for that length (kvpress_backend.budget_at: the units a press keeps of such a context)."""
    from .kvpress_backend import budget_at

    if cfg.ratios:
        return [(budget_at(r, length), r) for r in cfg.ratios]
    return [(b, None) for b in cfg.budgets]


def policy_settings_problem(settings: dict[str, str], methods) -> str | None:
    """Why --policy-settings cannot go with these (base) methods, or None: each names an evicting method of the run
    (its policy's own keys and values are the library's to check)."""
    for method, text in settings.items():
        given = f"--policy-settings {method}:{text}"
        if method == "full":
            return f"{given}: full attention evicts nothing and has no policy to set"
        if method not in methods:
            return (f"{given}: the method {method} is not in this run's --methods ({', '.join(dict.fromkeys(methods))}); "
                    "policy settings apply to a method of the run")
        if not text:
            return f"{given}: give the settings after the method, METHOD:key=value[,key=value...]"
    return None


def parse_policy_settings(entries: list[str] | None) -> dict[str, str]:
    """--policy-settings METHOD:SETTINGS (repeatable, one per method) as {method: settings}; EvalError for an entry
    without a method, without settings or for a method given twice."""
    out: dict[str, str] = {}
    for entry in entries or []:
        method, colon, text = entry.partition(":")
        method, text = method.strip(), text.strip()
        if not colon or not method or not text:
            raise EvalError(f"--policy-settings takes METHOD:key=value[,key=value...], a method of --methods and its "
                            f"policy's settings (got {entry!r})")
        if method in out:
            raise EvalError(f"--policy-settings gives the settings of {method} twice ({method}:{out[method]} and "
                            f"{entry}): give them once, comma-separated")
        out[method] = text
    return out


def upgrade_record(old: dict) -> dict:
    """A run's settings (config.json) as written by an older locret, in today's form, so that it resumes when it
    asks for the same: before policy settings, LagKV's partition had a key of its own ("lag", absent or None for the
    default), now the settings of the method lagkv. The one place an old record is translated."""
    old = dict(old)
    if "lag" in old:
        lag = old.pop("lag")
        if lag is not None:
            old["policy_settings"] = dict(old.get("policy_settings") or {}, lagkv=f"lag={lag}")
    return old


def pool_problem(pool: int | None, methods) -> str | None:
    """Why --pool cannot go with these (base) methods, or None: only the retaining heads' scores are pooled."""
    if pool and not any(m in HEADS_METHODS for m in methods):
        return f"--pool smooths the retaining heads' scores: give one of {', '.join(HEADS_METHODS)}"
    return None


def _heads_for(cfg: EvalConfig, model_path: Path, facts: planner.ModelFacts) -> tuple[dict, str | None]:
    """The trained heads of each heads method ('locret-q': the shipped Locret-Q heads where the model has them;
    None: embedded in the model) and the random heads of 'random-heads'."""
    heads, random_heads = {}, None
    for method in dict.fromkeys(split_method(m)[0] for m in cfg.methods):
        if method not in TRAINED_HEADS_METHODS:
            continue
        try:
            found, _ = planner.resolve_heads(cfg.model, model_path, facts, cfg.heads, query=method in QUERY_METHODS)
        except planner.PlanError as e:
            raise EvalError(str(e)) from None
        heads[method] = str(found) if found is not None else None
    if any(split_method(m)[0] == "random-heads" for m in cfg.methods):
        from ..heads import cached_random_heads
        random_heads = cfg.random_heads or cached_random_heads(model_path)
    return heads, random_heads


def _held_out(cfg: EvalConfig, heads: dict) -> dict:
    """--held-out: the families every trained-heads method's training log names ({} without --held-out); a family
    the heads were trained on, or heads whose training cannot be read, refuse the run."""
    if not cfg.held_out:
        return {}
    if not cfg.tasks:
        raise EvalError("--held-out is about the generated tasks' haystack families (--tasks, --haystacks)")
    from .heldout import check_held_out

    try:
        return check_held_out(cfg.haystacks, heads)
    except ValueError as e:
        raise EvalError(f"--held-out: {e}") from None


def _refuse_trained_on_suite_data(cfg: EvalConfig, heads: dict) -> None:
    """RULER results are refused for heads whose training log names the package's data (heldout.held_out_data_problem)."""
    if not cfg.suite:
        return
    from .heldout import held_out_data_problem

    files = dict(heads)
    if "locret" in cfg.presses:
        files["kvpress:locret"] = cfg.press_heads
    for method, heads_file in sorted(files.items()):
        problem = held_out_data_problem(heads_file)
        if problem:
            raise EvalError(f"{method}: no {cfg.suite} result for these heads: {problem}")


def _heads_used(heads: dict, random_heads: str | None) -> dict:
    """The heads each method ran with, by file name and content (sha256): `--heads` as given is in the settings,
    but what a method resolves to without it (the shipped heads, re-trained in place or a Locret-Q file added
    beside them) is what decides its results. None: embedded in the model."""
    files = dict(heads)
    if random_heads is not None:
        files["random-heads"] = random_heads
    return {m: None if f is None else f"{Path(f).name} sha256:{sha256_file(f)}" for m, f in sorted(files.items())}


def _resolution_unchanged(cfg: EvalConfig) -> bool:
    """Whether a run from before `heads_used` was recorded resolved its heads as today: only locret-q without
    --heads changed (it took the plain heads before the Locret-Q heads were shipped)."""
    return cfg.heads is not None or not any(split_method(m)[0] in QUERY_METHODS for m in cfg.methods)


def plan_runs(cfg: EvalConfig, items: list[Item], model_path: Path, facts: planner.ModelFacts,
              heads: dict, random_heads: str | None, out_dir: Path) -> tuple[list[tuple[RunSpec, list[Item]]], list[dict]]:
    """The runs, each with its items, and what was skipped (full attention over the model's window)."""
    groups: dict[int, list[Item]] = {}
    for it in items:
        groups.setdefault(it.length if cfg.tasks else 0, []).append(it)
    runs, skipped = [], []
    heat_ids_per_group = {g: tuple(it.id for it in its[:cfg.heatmaps]) for g, its in groups.items()}
    for entry in cfg.methods:
        method, variant = split_method(entry)
        own_stabilizers = _sets_own_stabilizers(method)
        for group, its in sorted(groups.items()):
            for budget, ratio in ([(None, None)] if method == "full" else budgets_for(cfg, group)):
                chosen = its
                if method == "full":
                    window = facts.n_ctx_train or 1 << 62
                    chosen = [it for it in its if len(it.tokens) + it.max_new_tokens <= window]
                    skipped += [{"method": "full", "item": it.id, "length": it.length,
                                 "reason": f"{len(it.tokens)} prompt tokens + {it.max_new_tokens} new exceed the "
                                           f"model's window ({window})"} for it in its if it not in chosen]
                if not chosen:
                    continue
                longest = max(len(it.tokens) + it.max_new_tokens for it in chosen)
                spec = RunSpec(model_path=str(model_path), method=method, budget=budget,
                               heads=heads.get(method) if method in TRAINED_HEADS_METHODS else
                               random_heads if method == "random-heads" else None,
                               pool=cfg.pool if method in HEADS_METHODS else None,
                               policy_settings=cfg.policy_settings.get(method, ""),
                               positions=cfg.positions,
                               schedule=_schedule_of(method, variant, cfg.schedule),
                               variant=variant,
                               # a policy that sets its stabilizers and local tail itself (e.g. SAGE-KV: b/4
                               # sinks, b/4 recent) refuses them; the context holds the longest prompt whole
                               stabilizers=None if own_stabilizers else cfg.stabilizers,
                               local=None if own_stabilizers else cfg.local, n_ctx=_pad(longest + 16),
                               ubatch=cfg.ubatch, threads=cfg.threads, kv_type=cfg.kv_type, gpu_layers=cfg.gpu_layers,
                               heatmap_ids=heat_ids_per_group[group] if method != "full" and not cfg.suite else (),
                               heatmap_dir=str(out_dir / "heatmaps"))
                run_name = f"{spec.name}/{group}" if cfg.tasks else spec.name
                labels = {"method": entry, "budget": budget, "run": run_name}
                if ratio is not None:
                    labels["compression_ratio"] = ratio
                runs.append((replace(spec, labels=labels), chosen))
    if cfg.presses:
        # kvpress: one run per length group, every press, ratio and question setting on each item (kvpress_backend)
        for group, its in sorted(groups.items()):
            spec = RunSpec(model_path=str(model_path), method="kvpress", budget=None, heads=None, stabilizers=None,
                           local=None, n_ctx=0, ubatch=0, threads=cfg.threads)
            runs.append((replace(spec, labels={"method": "kvpress", "budget": None, "run": f"kvpress/{group}"}), its))
    return runs, skipped


def _sets_own_stabilizers(method: str) -> bool:
    """Whether an evicting method's policy sets its stabilizers and local tail itself and refuses them (its trait in
    the library's rule book, llama_locret_policy_get_traits); False for full attention, which has no policy."""
    if method == "full":
        return False
    from ..eviction import policy_traits

    return policy_traits(policy_of(method)).sets_own_stabilizers


def _schedule_of(method: str, variant: str, schedule_file: str | None) -> str | None:
    """A run's budget schedule: "pyramid", the --schedule file, or None (uniform). locret-pyramid and locret-schedule
    are locret@pyramid and locret@schedule under their first names."""
    kind = variant or {"locret-pyramid": "pyramid", "locret-schedule": "schedule"}.get(method, "")
    return "pyramid" if kind == "pyramid" else str(schedule_file) if kind == "schedule" else None


def check_runs(runs: list[tuple[RunSpec, list[Item]]]) -> None:
    """Every evicting run's settings, checked by the library's rule book (the function context creation uses), so
    that a run that would be refused stops the evaluation before any worker starts, with the same message."""
    from ..eviction import resolve_file
    from ..heads import HeadsError
    from .worker import locret_settings

    for spec, _ in runs:
        if spec.method in ("full", "kvpress"):
            continue
        settings = {k.removeprefix("locret_"): v for k, v in locret_settings(spec).items()}
        try:
            resolve_file(spec.model_path, n_ctx=spec.n_ctx, n_ubatch=spec.ubatch, kv_type=spec.kv_type or "f16",
                         **settings)
        except HeadsError as e:
            raise EvalError(f"{spec.labels['run']}: {e}") from None


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _append(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def recorder(spec: RunSpec, todo: list[Item], records: dict, samples_path: Path, bar):
    """What a run does with the record(s) of each answered item: score them by the item's own rule, append them to
    the journal together (a resumed run finds an item whole or not at all), advance the progress bar."""
    by_id = {it.id: it for it in todo}

    def on_sample(records_of_item: dict | list[dict]) -> None:
        batch = records_of_item if isinstance(records_of_item, list) else [records_of_item]
        for r in batch:
            r["score"] = items_module.score(by_id[r["item"]], r["answer"], records)
        with open(samples_path, "a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in batch))
        bar.update(1)
        bar.set_postfix(run=spec.labels["run"], score=f"{sum(r['score'] for r in batch) / len(batch):.2f}")

    return on_sample


def execute(spec: RunSpec, todo: list[Item], records: dict, samples_path: Path, bar, deadline: float | None) -> dict | None:
    """Run one worker process over `todo`; append each scored sample; return its end record (None when the
    deadline stopped it). EvalError if the worker fails."""
    from . import worker

    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: its peak RSS is this run's alone
    q = ctx.Queue()
    proc = ctx.Process(target=worker.main, args=(spec, todo, q), daemon=True)
    proc.start()
    on_sample, seen = recorder(spec, todo, records, samples_path, bar), 0
    try:
        while True:
            try:
                kind, payload = q.get(timeout=5)
            except queue_module.Empty:
                if not proc.is_alive():
                    raise EvalError(f"{spec.labels['run']}: the worker process ended with exit code {proc.exitcode} "
                                    "(a crash in llama.cpp?) before finishing") from None
                if deadline is not None and time.monotonic() > deadline:
                    return None
                continue
            if kind == "error":
                raise EvalError(payload)
            if kind == "sample":
                on_sample(payload)
                seen += 1
                if deadline is not None and time.monotonic() > deadline and seen < len(todo):
                    return None
            elif kind == "done":
                return payload
    finally:
        if proc.is_alive():
            proc.terminate()
        proc.join(timeout=30)


def dispatch(cfg: EvalConfig, spec: RunSpec, todo: list[Item], records: dict, samples_path: Path, bar,
             deadline: float | None) -> dict | None:
    """One run by its backend: RULER through llama-server, kvpress in its own environment, else a worker process."""
    if not cfg.suite:
        return execute(spec, todo, records, samples_path, bar, deadline)
    on_sample = recorder(spec, todo, records, samples_path, bar)
    try:
        if spec.method == "kvpress":
            from . import kvpress_backend

            return kvpress_backend.execute(spec, todo, on_sample, deadline, cfg.output / "logs", presses=cfg.presses,
                                           ratios=cfg.ratios, settings=cfg.press_settings, heads=cfg.press_heads)
        from . import server_backend

        return server_backend.execute(spec, todo, on_sample, deadline, cfg.output / "logs")
    except RuntimeError as e:
        raise EvalError(str(e)) from None


def run(cfg: EvalConfig) -> int:
    model_path = models.resolve(cfg.model)
    facts = planner.read_model(model_path)
    dev = apply_device(cfg, facts)
    validate(cfg)
    heads, random_heads = _heads_for(cfg, model_path, facts)
    trained_on = _held_out(cfg, heads)
    if "locret" in cfg.presses and cfg.press_heads is None:  # LocretPress reads the model's shipped (plain) heads
        found, _ = planner.resolve_heads(cfg.model, model_path, facts, None, query=False)
        cfg.press_heads = str(found) if found is not None else None
    _refuse_trained_on_suite_data(cfg, heads)
    out = cfg.output
    config_path, fingerprint = out / "config.json", cfg.fingerprint()
    fingerprint["heads_used"] = _heads_used(heads, random_heads)
    if config_path.exists():
        old = upgrade_record(json.loads(config_path.read_text()))
        if "heads_used" not in old and not _resolution_unchanged(cfg):
            raise EvalError(f"{out} holds a run that did not record which heads it used, and locret-q without --heads "
                            "now takes the Locret-Q heads: give another -o or delete it")
        old.setdefault("heads_used", fingerprint["heads_used"])  # runs from before the record, resolved as today
        changed = sorted(k for k in set(old) | set(fingerprint) if old.get(k) != fingerprint.get(k))
        if changed:
            raise EvalError(f"{out} holds a run with other settings ({', '.join(changed)} differ): give another -o "
                            "or delete it")

    vocab = items_module.vocab_model(str(model_path))
    records: dict = {}
    try:
        if cfg.suite:
            with tqdm(total=len(cfg.tasks) * len(cfg.lengths), desc="RULER samples", unit="task") as bar:
                items = items_module.ruler_items(vocab, cfg.tasks, cfg.lengths, cfg.samples, cfg.seed,
                                                 mode=cfg.ruler_mode, random_start=cfg.ruler_random_start,
                                                 cache=out / "ruler-samples", progress=bar)
        elif cfg.tasks:
            n = len(cfg.tasks) * len(cfg.haystacks) * len(cfg.lengths) * len(cfg.depths) * cfg.samples
            with tqdm(total=n, desc="building prompts", unit="prompt") as bar:
                items = items_module.task_items(vocab, cfg.tasks, cfg.lengths, cfg.depths, cfg.samples, cfg.seed,
                                                cfg.max_new_tokens, bar, haystacks=cfg.haystacks)
        else:
            items, records = items_module.benchmark_items(vocab, cfg.benchmark, cfg.datasets, cfg.benchmark_task,
                                                          cfg.limit, cfg.max_new_tokens)
    finally:
        vocab.close()

    runs, skipped = plan_runs(cfg, items, model_path, facts, heads, random_heads, out)
    check_runs(runs)
    # the run's record is written once every refusal has had its say: a refused command leaves no settings behind
    # that would refuse its corrected form in the same folder (RULER's drawn samples, cached above, are keyed by
    # their own settings)
    (out / "heatmaps").mkdir(parents=True, exist_ok=True)
    config_path.write_text(json.dumps(fingerprint, indent=1, default=str))
    samples_path, runs_path = out / "samples.jsonl", out / "runs.jsonl"
    done_samples = {(r["run"], r["item"]) for r in _read_jsonl(samples_path)}
    done_runs = {r["run"] for r in _read_jsonl(runs_path)}
    if done_samples:
        print(f"{len(done_samples)} samples already in {samples_path}: skipped")
    deadline = time.monotonic() + cfg.max_minutes * 60 if cfg.max_minutes else None
    total = sum(len(its) for _, its in runs)
    stopped = False
    with tqdm(total=total, initial=sum(1 for s, its in runs for it in its if (s.labels["run"], it.id) in done_samples),
              desc="samples", unit="sample") as bar:
        for spec, its in runs:
            run_name = spec.labels["run"]
            todo = [it for it in its if (run_name, it.id) not in done_samples]
            if not todo and run_name in done_runs:
                continue
            if deadline is not None and time.monotonic() > deadline:
                stopped = True
                break
            if not todo:
                todo = its[:1]  # samples done but no memory record: measure it again on one item
                _drop_samples(samples_path, run_name, todo[0].id)
            end = dispatch(cfg, spec, todo, records, samples_path, bar, deadline)
            if end is None:
                stopped = True
                break
            if spec.method == "full":
                end["kv_bytes"] = planner.plain_kv_bytes(model_path, spec.n_ctx, 1, spec.ubatch, cfg.kv_type or "f16")
                end["kv_bytes_source"] = "llama.cpp's own size of a plain context (planner.plain_kv_bytes)"
            _append(runs_path, dict(end, run=run_name, method=spec.labels["method"], budget=spec.budget, n_ctx=spec.n_ctx))

    samples = _read_jsonl(samples_path)
    run_records = _read_jsonl(runs_path)
    summary = report.summarize(samples, run_records, skipped)
    memory_notes, over = report.memory_check(run_records, dev)
    heads_files = {m: Path(h).name if h else None for m, h in heads.items()}  # None: embedded in the model
    settings = dict(fingerprint, model_path=model_path.name, heads_files=heads_files,
                    incomplete=stopped)
    if cfg.held_out:
        # every family reported was checked against the heads' training logs: {method: families trained on}
        settings["held_out"] = {"families": cfg.haystacks, "heads_trained_on": trained_on}
    (out / "summary.json").write_text(json.dumps({"settings": settings, "summary": summary, "skipped": skipped,
                                                  "memory": memory_notes}, indent=1, default=str))
    table = report.markdown(summary, skipped, memory_notes)
    if cfg.suite:
        table = _ruler_report(cfg, summary, out, samples) + "\n\n" + table
    (out / "summary.md").write_text(table + "\n")
    print(table)
    if cfg.plots:
        from . import plots
        written = plots.write_all(out, summary, samples)
        print(f"plots: {', '.join(str(p.relative_to(out)) for p in written) or 'none (nothing to plot)'}")
    print(f"wrote {out / 'summary.json'}, {out / 'summary.md'} and {samples_path}")
    if stopped:
        print(f"stopped by --max-minutes {cfg.max_minutes}: run the same command again to go on")
    if over:
        for line in over:
            print(f"locret eval: error: {line}")
        return EXIT_OVER_MEMORY
    return 0


def _ruler_report(cfg: EvalConfig, summary: list[dict], out: Path, samples: list[dict]) -> str:
    """RULER's table (per task, the average), the side by side against compression ratio and its plot; ruler.json."""
    from ..ruler import report as ruler_report

    entries = ruler_report.table(summary, cfg.tasks)
    mismatched = sum(1 for s in samples if s.get("tokens_match") is False)
    text = ruler_report.tables(entries, cfg.tasks)
    text += (f"\n\ntoken ids: the server read {'the same ids as kvpress is fed for every' if not mismatched else f'other ids than kvpress is fed for {mismatched} of the'} "
             f"{sum(1 for s in samples if 'tokens_match' in s)} server requests")
    (out / "ruler.json").write_text(json.dumps({"tasks": cfg.tasks, "entries": entries,
                                                "tokens_mismatched": mismatched}, indent=1))
    if cfg.plots:
        ruler_report.plot(entries, out / "plots" / "ruler.png")
    return text


def _drop_samples(path: Path, run_name: str, item_id: str) -> None:
    keep = [r for r in _read_jsonl(path) if not (r["run"] == run_name and r["item"] == item_id)]
    path.write_text("".join(json.dumps(r) + "\n" for r in keep))


def run_cli(args) -> int:
    cfg = EvalConfig(model=args.model, output=Path(args.output), heads=args.heads, random_heads=args.random_heads,
                     tasks=_split(args.tasks), haystacks=_split(args.haystacks) or ["prose"], lengths=[planner.parse_context(x) for x in _split(args.lengths)],
                     depths=[float(x) for x in _split(args.depths)], samples=args.samples, seed=args.seed,
                     benchmark=args.benchmark, datasets=args.dataset or [], benchmark_task=args.benchmark_task,
                     limit=args.limit, methods=_split(args.methods), budgets=[int(x) for x in _split(args.budgets)],
                     stabilizers=args.stabilizers, local=args.local, pool=_pool(args.pool),
                     policy_settings=parse_policy_settings(args.policy_settings),
                     positions=args.positions, schedule=args.schedule, ubatch=args.ubatch,
                     threads=threads_or_default(args.threads, 2),
                     kv_type=args.kv_type, gpu_layers=planner.parse_gpu_layers(args.gpu_layers),
                     max_new_tokens=args.max_new_tokens, device=args.device, heatmaps=args.heatmaps,
                     max_minutes=args.max_minutes, plots=not args.no_plots, held_out=args.held_out,
                     suite=args.suite, ruler_mode=args.ruler_mode, ruler_random_start=not args.ruler_first_words,
                     ratios=[float(x) for x in _split(args.ratios)], presses=_split(args.presses),
                     press_settings=_split(args.press_question) or ["outside"], press_heads=args.press_heads)
    if cfg.suite and not cfg.tasks:
        from ..ruler import TASKS as RULER_TASKS

        cfg.tasks = list(RULER_TASKS)  # all 13, as RULER's average is over
    return run(cfg)


def _pool(text: str | None) -> int | None:
    """--pool: a window, or "auto" (each heads file's recommended window, as the tools use it)."""
    from .worker import POOL_RECOMMENDED

    if text is None:
        return None
    if text == "auto":
        return POOL_RECOMMENDED
    try:
        return int(text)
    except ValueError:
        raise EvalError(f"--pool takes an odd window or auto, got {text!r}") from None


def _split(text: str | None) -> list[str]:
    return [x.strip() for x in (text or "").split(",") if x.strip()]


__all__ = ["EvalConfig", "EvalError", "ItemError", "run", "run_cli"]
