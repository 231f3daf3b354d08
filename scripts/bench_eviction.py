#!/usr/bin/env python3
"""Benchmark Locret eviction against plain llama.cpp in one run (llama-bench, one process per figure).

    .venv/bin/python scripts/bench_eviction.py [--heads H.gguf] [--budget 2048] [--ubatch 512]
        [--lengths 2048,8192,32768,131072] [--decode-depth 131072]

Prints a markdown table (with the split of the eviction time that llama-bench reports: selection, compaction graphs,
score read-back) and the issue's targets as ratios measured in this run:
  - Locret prefill tok/s at the longest length >= 0.85 x at the shortest (flat with length);
  - selection + read-back + compaction <= 5 % of the prefill time at the longest length;
  - Locret prefill at 8K >= plain llama.cpp (full attention) at 8K;
  - peak RSS at the longest length <= 1.05 x at 8K;
  - Locret decode tok/s after a --decode-depth prompt >= 0.9 x plain decode after a 2.5K prompt.
Exits 1 when a target is missed. Without --heads it makes random heads (speed does not depend on
their values). Each figure is one llama-bench process, so its peak RSS is that process's own.

--device D (devices/, also `locret bench --device D`) takes the budget, chunk, KV type and GPU layers
from the profile for the model (each still overridable) and exits 3 when a measured peak RSS is over
the memory the profile gives the model (host and unified-memory devices; a discrete GPU's own memory
is not measured by llama-bench, which the report says).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "py"))


def bench(args: argparse.Namespace, *, locret: bool, prompt: int, gen: int, depth: int) -> dict:
    cmd = [str(REPO / "build" / "bin" / "llama-bench"), "-m", str(args.model), "-p", str(prompt), "-n", str(gen),
           "-d", str(depth), "-r", "1", "--no-warmup", "-t", str(args.threads), "-ub", str(args.ubatch),
           "-b", str(args.ubatch), "-o", "json"]
    if args.kv_type:
        cmd += ["-ctk", args.kv_type, "-ctv", args.kv_type]
    if args.gpu_layers:
        cmd += ["-ngl", str(99999 if args.gpu_layers < 0 else args.gpu_layers)]
    if locret:
        cmd += ["--locret-heads", str(args.heads), "--locret-budget", str(args.budget)]
        if args.stabilizers is not None:
            cmd += ["--locret-stabilizers", str(args.stabilizers)]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"llama-bench failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    rows = json.loads(proc.stdout)
    out = {"tps": rows[0]["avg_ts"], "seconds": time.time() - t0}
    # llama-bench's split of the eviction time inside the timed runs (ggml_ext: selection, compaction, read-back)
    split = re.search(r"locret: eviction time: select ([\d.]+) ms, compaction ([\d.]+) ms, score read-back ([\d.]+) ms: "
                      r"([\d.]+) ms of ([\d.]+) ms timed", proc.stderr)
    if split:
        out.update(zip(("select_ms", "compact_ms", "readback_ms", "eviction_ms", "timed_ms"),
                       (float(x) for x in split.groups())))
    return out


def measured(args: argparse.Namespace, **kw) -> dict:
    """Run one figure in a child Python process: RUSAGE_CHILDREN is a running maximum over all children,
    so a fresh process per figure isolates each llama-bench's peak RSS."""
    code = (
        "import json,resource,sys; sys.path.insert(0, {scripts!r}); import bench_eviction as b;"
        "ns = b.parse(sys.argv[1:]); r = b.bench(ns, **json.loads({kw!r}));"
        "r['peak_rss_mib'] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024; print(json.dumps(r))"
    ).format(scripts=str(REPO / "scripts"), kw=json.dumps(kw))
    proc = subprocess.run([sys.executable, "-c", code, *args.argv], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model GGUF (default: the default model)")
    ap.add_argument("--heads", default=None, help="heads GGUF (default: random heads made for the model)")
    ap.add_argument("--budget", type=int, help="Locret budget b (default 2048, or the --device profile's)")
    ap.add_argument("--ubatch", type=int, help="chunk B (default 512, or the --device profile's)")
    ap.add_argument("--stabilizers", type=int, help="stabilizers n_s (default: the heads', or the profile's)")
    ap.add_argument("--kv-type", help="KV cache type for both K and V (default f16, or the profile's)")
    ap.add_argument("--gpu-layers", type=int, help="layers on the GPU, -1 all (default 0, or the profile's)")
    ap.add_argument("--device", help="device profile (devices/): its settings, and its memory as a limit")
    ap.add_argument("--lengths", default="2048,8192,32768,131072")
    ap.add_argument("--decode-depth", type=int, default=131072)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--d-r", type=int, default=256,
                    help="hidden size of the random heads made without --heads (default 256: 5.5%% of SmolLM2's "
                         "per-token work, the paper's 2.5-8%% range; its d_R = 1024 is for 3.8B-8B models)")
    ns = ap.parse_args(argv)
    ns.argv = list(argv)
    return ns


def main() -> int:
    args = parse(sys.argv[1:])
    if args.model is None:
        from locret import models

        args.model = str(models.resolve(models.DEFAULT_MODEL))
        args.argv += ["--model", args.model]
    if args.heads is None:
        from locret import heads

        args.heads = heads.make_random(args.model, Path(tempfile.mkdtemp(prefix="locret-bench-")) / "heads.gguf",
                                       d_r=args.d_r, seed=0)
        args.argv += ["--heads", str(args.heads)]
    print(f"heads: {args.heads}", file=sys.stderr)
    device = apply_device(args)
    lengths = [int(x) for x in args.lengths.split(",")]

    rows = []
    def record(name, **kw):
        print(f"... {name}", file=sys.stderr, flush=True)
        r = measured(args, **kw)
        rows.append((name, r))
        print(f"    {r['tps']:.1f} tok/s, peak RSS {r['peak_rss_mib']:.0f} MiB, {r['seconds']:.0f} s", file=sys.stderr)
        return r

    plain_pp8k = record("plain llama.cpp prefill 8192", locret=False, prompt=8192, gen=0, depth=0)
    plain_tg = record("plain llama.cpp decode after 2560", locret=False, prompt=0, gen=64, depth=2560)
    lpp = {n: record(f"Locret b={args.budget} prefill {n}", locret=True, prompt=n, gen=0, depth=0) for n in lengths}
    ltg = record(f"Locret b={args.budget} decode after {args.decode_depth}", locret=True, prompt=0, gen=64,
                 depth=args.decode_depth)

    print(f"\n{Path(args.model).name}, b = {args.budget}, B = {args.ubatch}, {args.threads} threads, llama-bench -r 1\n")
    print("| run | tok/s | peak RSS (MiB) | selection / compaction / score read-back (ms) | eviction share |\n"
          "|---|---:|---:|---|---:|")
    for name, r in rows:
        split = (f"{r['select_ms']:.1f} / {r['compact_ms']:.1f} / {r['readback_ms']:.1f}"
                 if "select_ms" in r else "-")
        share = f"{100 * r['eviction_ms'] / r['timed_ms']:.2f} %" if r.get("timed_ms") else "-"
        print(f"| {name} | {r['tps']:.1f} | {r['peak_rss_mib']:.0f} | {split} | {share} |")

    lo, hi = min(lengths), max(lengths)
    share = lpp[hi]["eviction_ms"] / lpp[hi]["timed_ms"] if lpp[hi].get("timed_ms") else float("nan")
    checks = [
        (f"Locret prefill {hi} / {lo}", lpp[hi]["tps"] / lpp[lo]["tps"], 0.85),
        (f"selection + read-back + compaction / prefill time at {hi}", share, None),
        ("Locret prefill 8192 / plain prefill 8192", lpp[8192]["tps"] / plain_pp8k["tps"] if 8192 in lpp else float("nan"), 1.0),
        (f"peak RSS {hi} / 8192 (Locret)", lpp[hi]["peak_rss_mib"] / lpp[8192]["peak_rss_mib"] if 8192 in lpp else float("nan"), None),
        (f"Locret decode after {args.decode_depth} / plain decode after 2560", ltg["tps"] / plain_tg["tps"], 0.9),
    ]
    print("\n| target | ratio | needed | |\n|---|---:|---:|---|")
    ok = True
    for name, ratio, need in checks:
        if name.startswith("peak RSS"):
            passed = ratio <= 1.05
            need_s = "<= 1.05"
        elif name.startswith("selection"):
            passed = ratio <= 0.05
            need_s = "<= 0.05"
        else:
            passed = ratio >= need
            need_s = f">= {need}"
        ok &= passed
        print(f"| {name} | {ratio:.3f} | {need_s} | {'ok' if passed else 'MISSED'} |")
    if device is not None:
        over = device_check(device, rows)
        if over:
            return 3
    return 0 if ok else 1


def apply_device(args: argparse.Namespace):
    """Settings from the profile for unset options (the same resolution as `locret plan`); defaults
    without a device. The resolved values are passed on to the per-figure child processes."""
    device = None
    if args.device is not None:
        from locret import devices, planner

        try:
            device = devices.load(args.device)
            facts = planner.read_model(Path(args.model))
            s = planner.resolve_settings(device, facts, budget=args.budget, ubatch=args.ubatch,
                                         stabilizers=args.stabilizers, kv_type=args.kv_type,
                                         gpu_layers=args.gpu_layers)
        except (devices.DeviceError, planner.PlanError) as e:
            raise SystemExit(f"bench_eviction: error: {e}")
        args.budget, args.ubatch, args.stabilizers = s.budget, s.ubatch, s.stabilizers
        args.kv_type, args.gpu_layers = s.kv_type, s.gpu_layers
    args.budget = 2048 if args.budget is None else args.budget
    args.ubatch = 512 if args.ubatch is None else args.ubatch
    args.gpu_layers = 0 if args.gpu_layers is None else args.gpu_layers
    for name in ("budget", "ubatch", "stabilizers", "kv_type", "gpu_layers"):
        value = getattr(args, name)
        if value is not None:
            args.argv += [f"--{name.replace('_', '-')}", str(value)]
    return device


def device_check(device, rows: list) -> list[str]:
    """Figures whose measured peak RSS is over the profile's memory; printed, and the report says what
    was not checked."""
    limit = device.memory.available_bytes / (1 << 20)
    if device.memory.kind == "discrete":
        print(f"\n{device.name}: llama-bench reports no GPU memory; the {device.memory.available_gib} GiB limit "
              "applies to GPU memory and was not checked here (`locret plan` predicts it)")
        return []
    over = [f"{name}: peak RSS {r['peak_rss_mib']:.0f} MiB > {limit:.0f} MiB ({device.name} memory.available_gib)"
            for name, r in rows if r["peak_rss_mib"] > limit]
    for line in over:
        print(f"bench_eviction: error: {line}")
    if not over:
        print(f"\nevery figure within {device.name}'s {device.memory.available_gib} GiB")
    return over


if __name__ == "__main__":
    sys.exit(main())
