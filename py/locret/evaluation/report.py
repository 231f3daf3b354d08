"""Summary of an evaluation: per (source, method, budget, length) the mean score, by depth, speed and
memory; the markdown table; and the device-memory check."""
from __future__ import annotations

from collections import defaultdict
from statistics import mean

from .items import RULER_PREFIX

MIB = 1 << 20


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return round(mean(values), 4) if values else None


def summarize(samples: list[dict], runs: list[dict], skipped: list[dict]) -> list[dict]:
    memory = {r["run"]: r for r in runs}
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for s in samples:
        # benchmark records ("benchmark/task") have lengths of their own: one group for all of them
        length = None if "/" in s["source"] and not s["source"].startswith(RULER_PREFIX) else s["length"]
        groups[(s["source"], s["method"], s["budget"], length, s["run"])].append(s)
    rows = []
    for (source, method, budget, length, run), group in sorted(groups.items(), key=lambda kv: (
            kv[0][0], kv[0][1], kv[0][2] or 0, kv[0][3] or 0)):
        by_depth = defaultdict(list)
        for s in group:
            if s.get("depth") is not None:
                by_depth[f"{s['depth']:.2f}"].append(s["score"])
        mem = memory.get(run, {})
        judged = [s for s in group if "outcome" in s]
        rows.append({
            "source": source, "method": method, "budget": budget, "length": length, "run": run,
            "samples": len(group), "accuracy": _mean(s["score"] for s in group),
            "accuracy_by_depth": {d: _mean(v) for d, v in sorted(by_depth.items())},
            # wrong answers that gave another needle's value or a number of the document (tasks that tell them from
            # misses: the real-text needle tasks); None for the other tasks
            "confusions": sum(s["outcome"] == "confusion" for s in judged) if judged else None,
            "prompt_tokens_mean": _mean(s["prompt_tokens"] for s in group),
            "compression_ratio": group[0].get("compression_ratio"),
            # through a server: the request's time from outside; in a worker: its prefill and decode
            "seconds_per_sample": _mean(s["wall_s"] if s.get("wall_s") is not None else
                                        (s.get("prefill_s") or 0) + (s.get("decode_s") or 0) for s in group),
            "prefill_tok_s": _mean(s["prefill_tok_s"] for s in group),
            "decode_tok_s": _mean(s["decode_tok_s"] for s in group),
            "cells_used_max": max((s["cells_used_max"] for s in group if s["cells_used_max"] is not None), default=None),
            "n_cells": group[0]["n_cells"],
            "kv_bytes": mem.get("kv_bytes"), "peak_rss_bytes": mem.get("peak_rss_bytes"), "gpu_bytes": mem.get("gpu_bytes"),
        })
    return rows


def _mib(n) -> str:
    return "-" if n is None else f"{n / MIB:.1f}"


def _num(x, fmt="{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def markdown(rows: list[dict], skipped: list[dict], memory_notes: list[str]) -> str:
    # the confusions column only where a row counts them, so that tables of the other tasks read as before
    confusions = any(r.get("confusions") is not None for r in rows)
    lines = ["| task | method | budget | length | n | score | " + ("confusions | " if confusions else "") +
             "by depth | prefill tok/s | decode tok/s | max cells | KV MiB | peak RSS MiB |",
             "|---|---|---:|---:|---:|---:|" + ("---:|" if confusions else "") + "---|---:|---:|---:|---:|---:|"]
    for r in rows:
        depth = " / ".join(f"{v:.2f}" for v in r["accuracy_by_depth"].values()) or "-"
        confused = f"{'-' if r.get('confusions') is None else r['confusions']} | " if confusions else ""
        lines.append(f"| {r['source']} | {r['method']} | {r['budget'] or '-'} | {r['length'] or 'all'} | {r['samples']} | "
                     f"{_num(r['accuracy'])} | {confused}{depth} | {_num(r['prefill_tok_s'], '{:.0f}')} | "
                     f"{_num(r['decode_tok_s'], '{:.1f}')} | {r['cells_used_max'] if r['cells_used_max'] is not None else '-'} | "
                     f"{_mib(r['kv_bytes'])} | {_mib(r['peak_rss_bytes'])} |")
    if rows and any(r["accuracy_by_depth"] for r in rows):
        depths = sorted({d for r in rows for d in r["accuracy_by_depth"]})
        lines.append(f"\nby depth: scores at depths {', '.join(depths)} in that order")
    if skipped:
        lines.append(f"\n{len(skipped)} full-attention samples skipped: {skipped[0]['reason']}")
    lines += [f"\n{note}" for note in memory_notes]
    return "\n".join(lines)


def memory_check(runs: list[dict], device) -> tuple[list[str], list[str]]:
    """Notes for the report, and the runs over the device profile's memory (empty without a device).
    Host-memory devices (CPU, Jetson's unified memory) are held to peak RSS; discrete GPUs to the GPU
    memory the process held, where it could be measured."""
    if device is None:
        return [], []
    limit = device.memory.available_bytes
    notes, over = [], []
    for r in runs:
        if device.memory.kind == "discrete":
            measured, what = r.get("gpu_bytes"), "GPU memory"
            if measured is None:
                notes.append(f"{r['run']}: GPU memory not measured (no NVIDIA GPU visible): {device.name}'s limit "
                             "was not checked")
                continue
        else:
            measured, what = r.get("peak_rss_bytes"), "peak RSS"
        if measured is not None and measured > limit:
            over.append(f"{r['run']}: measured {what} {_mib(measured)} MiB exceeds {device.name}'s "
                        f"{device.memory.available_gib} GiB available to the model (memory.available_gib): use a "
                        "smaller budget, ubatch or KV type, or a smaller model (`locret plan` shows the breakdown)")
    if not over and runs:
        notes.append(f"memory: every run within {device.name}'s {device.memory.available_gib} GiB")
    return notes, over
