"""RULER's table over several `locret eval --suite ruler` folders: the same methods asked on more prompts (another
`--seed` a folder), pooled sample by sample, so a task's score is the mean over every prompt of every folder and n
counts them.

Pooling is refused where it would mix what a table must not: folders of another suite, model or RULER mode, a method
whose heads differ between folders (the heads' sha256 in config.json), and the same prompt twice (a (method, budget,
item) in two folders: the same --seed and length asked again).
"""
from __future__ import annotations

import json
from pathlib import Path

from ..evaluation import report
from . import TASKS
from . import report as ruler_report


class PoolError(ValueError):
    """A folder that cannot be pooled with the others; the message names it and why."""


def _read_folder(folder: Path) -> tuple[dict, list[dict], list[dict]]:
    config_path, samples_path = folder / "config.json", folder / "samples.jsonl"
    if not config_path.is_file() or not samples_path.is_file():
        raise PoolError(f"{folder}: not a `locret eval` folder (no config.json or samples.jsonl)")
    config = json.loads(config_path.read_text())
    if config.get("suite") != "ruler":
        raise PoolError(f"{folder}: not a RULER run (--suite ruler)")
    samples = [json.loads(line) for line in samples_path.read_text().splitlines() if line.strip()]
    runs_path = folder / "runs.jsonl"
    runs = [json.loads(line) for line in runs_path.read_text().splitlines() if line.strip()] \
        if runs_path.is_file() else []
    return config, samples, runs


def pool(folders: list[Path]) -> tuple[list[dict], list[str], int]:
    """The RULER entries (ruler.report.table's) of every folder's samples together, the tasks they cover (in RULER's
    order) and how many samples were read."""
    if not folders:
        raise PoolError("no folder given")
    first: dict | None = None
    heads: dict[str, tuple[str, Path]] = {}
    seen: dict[tuple, Path] = {}
    samples: list[dict] = []
    runs: list[dict] = []
    modes: dict[str, Path] = {}
    for folder in folders:
        config, folder_samples, folder_runs = _read_folder(folder)
        if first is None:
            first = config
        elif config.get("model") != first.get("model"):
            raise PoolError(f"{folder}: model {config.get('model')}, where {folders[0]} has {first.get('model')}")
        for method, used in (config.get("heads_used") or {}).items():
            if method in heads and heads[method][0] != used:
                raise PoolError(f"{folder}: {method} used other heads ({used}) than {heads[method][1]} "
                                f"({heads[method][0]})")
            heads.setdefault(method, (used, folder))
        for s in folder_samples:
            mode = (s.get("extra") or {}).get("mode")
            modes.setdefault(mode, folder)
            if len(modes) > 1:
                raise PoolError(f"{folder}: RULER modes {' and '.join(map(str, modes))} in the folders "
                                f"({', '.join(str(f) for f in modes.values())}): a table asks one way")
            seed = (s.get("extra") or {}).get("seed", config.get("seed"))
            key = (s["method"], s["budget"], s["item"], seed)
            if key in seen:
                raise PoolError(f"{folder}: {s['method']} on {s['item']} (seed {seed}) is already in {seen[key]}: "
                                "the same prompt would count twice")
            seen[key] = folder
            # runs are named per folder; keep them apart so each run's memory stays its own
            samples.append(dict(s, run=f"{folder}:{s['run']}"))
        runs += [dict(r, run=f"{folder}:{r['run']}") for r in folder_runs]
    rows = report.summarize(samples, runs, [])
    rows = _merge_runs(rows)
    asked = {s["source"].split("/", 1)[1] for s in samples if s["source"].startswith("ruler/")}
    tasks = [t for t in TASKS if t in asked]
    return ruler_report.table(rows, tasks), tasks, len(samples)


def _merge_runs(rows: list[dict]) -> list[dict]:
    """Rows of one (source, method, budget, length) from several folders as one: the accuracy and seconds weighted
    by samples, the largest KV bytes."""
    merged: dict[tuple, dict] = {}
    for r in rows:
        key = (r["source"], r["method"], r["budget"], r["length"])
        m = merged.get(key)
        if m is None:
            merged[key] = dict(r)
            continue
        n = m["samples"] + r["samples"]
        for field in ("accuracy", "seconds_per_sample"):
            if m.get(field) is not None and r.get(field) is not None:
                m[field] = (m[field] * m["samples"] + r[field] * r["samples"]) / n
        m["kv_bytes"] = max(m.get("kv_bytes") or 0, r.get("kv_bytes") or 0) or None
        m["samples"] = n
    return list(merged.values())


def markdown(folders: list[Path], *, plot: Path | None = None) -> str:
    """The pooled table as `locret eval` writes RULER's, the average against compression ratio where the folders hold
    several ratios (a ratio a folder: the kvpress grid run in parts), with the folders it read; `plot`: also draw the
    side by side, one PNG a length (`plot`'s name with `-LENGTH` added), and name them."""
    entries, tasks, n = pool(folders)
    text = ruler_report.tables(entries, tasks)
    if plot is not None:
        written = ruler_report.plot(entries, plot)
        text += "\n\nPlots: " + (", ".join(str(w) for w in written) if written else "none (no row has a ratio)")
    return text + f"\n\nPooled from {len(folders)} folders ({n} samples): " + ", ".join(str(f) for f in folders)
