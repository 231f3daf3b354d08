"""Which text families a heads file was trained on, so that an evaluation can claim held-out families only.

A training run writes train-log.json in its run folder (`locret train --run-dir`; the shipped heads keep theirs in
heads/<name>.run/ beside heads/<name>.gguf). Its config names the built-in generator's text kinds (`contexts`, the
haystack families plus `pydoc`; "pydoc" alone when the key is absent, the trainer's default), the data files it read
(`data`) and the heads it started from (`init_heads`), whose families count too. A family is held out from a heads
file when none of that names it. When the log cannot tell (no log, data files of unknown text) nothing is held out.

The real-text families (info, man, pysource: tasks/realtext) are no context of the trainer (it refuses them:
holdout.HELD_OUT_FAMILIES), so no log names them and they are held out from every heads file; a log that named one
would refuse it like any other family. The trainer's own real text (pypackages) is a family of its own, and the
real-text tasks' tuning family (settings are tried on it before the held-out three): a figure on it is never reported
as held out, whatever the heads' logs say.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..train.synthetic import DEFAULT_CONTEXTS


@dataclass(frozen=True)
class Training:
    families: frozenset[str] | None  # None: the log cannot tell (then no family counts as held out)
    why: str                         # the log(s) read, or why none could be


def run_log(heads_file: str | Path) -> Path:
    """Where a heads file's training log is: <folder>/<stem>.run/train-log.json."""
    p = Path(heads_file)
    return p.with_name(p.stem + ".run") / "train-log.json"


def training(heads_file: str | Path | None, *, _seen: frozenset[str] = frozenset()) -> Training:
    """The text families `heads_file` was trained on (with its init_heads'), from the training logs."""
    if heads_file is None:
        return Training(None, "heads embedded in the model: no training log to read")
    log = run_log(heads_file)
    if not log.is_file():
        return Training(None, f"no training log at {log}")
    try:
        config = json.loads(log.read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return Training(None, f"{log} is not a training log ({e})")
    if config.get("data"):
        return Training(None, f"{log}: trained on data files ({', '.join(map(str, config['data']))}) whose text "
                              "families are unknown")
    families = set(config.get("contexts") or DEFAULT_CONTEXTS)
    why = [str(log)]
    init = config.get("init_heads")
    if init:
        # a relative path is the repository's (as the trainer was run from it); else beside the heads file. A heads
        # file its fine-tuned successor replaced keeps only its training log (<stem>.run/), which is what counts.
        candidates = [Path(init), Path(heads_file).parent / Path(init).name]
        found = next((c for c in candidates if c.is_file() or run_log(c).is_file()), None)
        if found is None or str(found.resolve()) in _seen:
            return Training(None, f"{log}: started from {init}, whose training cannot be read")
        parent = training(found, _seen=_seen | {str(Path(heads_file).resolve())})
        if parent.families is None:
            return Training(None, f"{log}: started from {init}: {parent.why}")
        families |= parent.families
        why.append(parent.why)
    return Training(frozenset(families), " and ".join(why))


def check_held_out(families: list[str], heads_by_method: dict[str, str | None]) -> dict[str, list[str]]:
    """For an evaluation that reports `families` as held out: every heads method's training families (sorted), or
    ValueError naming the first family a method's heads were trained on, or that cannot be told."""
    from ..tasks import realtext

    tuning = [f for f in families if f in realtext.TRAINING_FAMILIES]
    if tuning:
        raise ValueError(f"{', '.join(tuning)} is the tuning family of the real-text tasks (settings are tried on it), "
                         f"never held out: the held-out real text is {', '.join(realtext.FAMILIES)}")
    out = {}
    for method, heads_file in sorted(heads_by_method.items()):
        t = training(heads_file)
        if t.families is None:
            raise ValueError(f"cannot report held-out families for {method}: {t.why}")
        named = [f for f in families if f in t.families]
        if named:
            raise ValueError(f"{', '.join(named)} {'is' if len(named) == 1 else 'are'} not held out for {method}: "
                             f"its heads were trained on {', '.join(sorted(t.families))} ({t.why})")
        out[method] = sorted(t.families)
    return out


def held_out_data_problem(heads_file: str | Path | None, *, _seen: frozenset[str] = frozenset()) -> str | None:
    """Why results of `heads_file` cannot be reported on a benchmark whose data is held out (RULER): its training log,
    or the log of the heads it started from, names a data file that the rule book holds out (holdout.py: by path, or
    by the sha256 the log recorded); None when no log names one (or there is no log to read)."""
    from .. import holdout

    if heads_file is None:
        return None
    log = run_log(heads_file)
    try:
        data = json.loads(log.read_text())
    except (OSError, ValueError):
        return None
    config = data.get("config") or {}
    digests = {s.get("path"): s.get("sha256") for s in data.get("sources") or [] if isinstance(s, dict)}
    for path in config.get("data") or []:
        problem = holdout.why_not_training_data(path, digests.get(path))
        if problem:
            return f"{heads_file} was trained on {problem} (its log: {log})"
    init = config.get("init_heads")
    if init:
        for candidate in (Path(init), Path(heads_file).parent / Path(init).name):
            if candidate.is_file() and str(candidate.resolve()) not in _seen:
                return held_out_data_problem(candidate, _seen=_seen | {str(Path(heads_file).resolve())})
    return None
