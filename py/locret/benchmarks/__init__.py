"""Loaders for public long-context benchmarks whose JSONL files a user has locally, scored with each
benchmark's own metrics. One module per benchmark: longbench, infinitebench, leval.

    from locret import benchmarks
    records = benchmarks.load("longbench", "data/hotpotqa.jsonl")    # list[Record]
    r = records[0]
    r.context, r.question, r.answers, r.metric                        # what to ask, what is right, how to score
    benchmarks.score(r, prediction)                                   # in [0, 1], the benchmark's rule
    benchmarks.summarize(records, predictions)                        # {task: the benchmark's own figure, %}

Nothing is downloaded: the files come from the user. A file that does not fit the benchmark's record
layout is refused with a DatasetError naming file:line (records.py). How context and question are put
into a prompt (and truncated to a model's window, if at all) is the runner's choice, not the loader's.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Sequence

from .records import DatasetError, Record

BENCHMARKS = ("longbench", "infinitebench", "leval")


def get(name: str) -> ModuleType:
    """The module of benchmark `name` (load, score, summarize)."""
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; valid benchmarks: {', '.join(BENCHMARKS)}")
    return importlib.import_module(f"{__name__}.{name}")


def load(benchmark: str, path: str | Path, task: str | None = None) -> list[Record]:
    """Records of one JSONL file of `benchmark`; `task` when the file name does not say it."""
    return get(benchmark).load(path, task=task)


def score(record: Record, prediction: str) -> float:
    return get(record.benchmark).score(record, prediction)


def summarize(records: Sequence[Record], predictions: Sequence[str]) -> dict[str, float]:
    """The benchmark's per-task figures (records of one benchmark)."""
    names = {r.benchmark for r in records}
    if len(names) != 1:
        raise ValueError(f"summarize takes records of one benchmark, got {sorted(names) or 'none'}")
    return get(names.pop()).summarize(records, predictions)


__all__ = ["BENCHMARKS", "DatasetError", "Record", "get", "load", "score", "summarize"]
