#!/usr/bin/env python3
"""Benchmark Locret eviction against plain llama.cpp in one run (llama-bench, one process per figure).

    .venv/bin/python scripts/bench_eviction.py [--model M.gguf | --shape NAME] [--heads H.gguf] [--budget 2048]
        [--ubatch 512] [--lengths 2048,8192,32768,131072] [--plain-lengths 2048,8192,32768] [--decode-depth 131072]
        [--decode-tokens N]
        [--gpu-layers -1] [--policies heads,lagkv,streaming] [--policy-settings NAME:K=V,...]
        [--positions inplace,compact,keep]
        [--profile-compaction] [--decode-split]

Prints a markdown table of every figure (tok/s; peak host RSS; on a GPU the device memory in use with the context
alive, which llama-bench reads from the device; and for Locret runs the time split per ubatch: model compute,
selection, read-back, compaction) and the issue's targets as ratios measured in this run:
  - Locret prefill / plain prefill at every length both were run at (8192: >= 0.85 on a GPU, >= 1.0 on a CPU;
    32768: >= 1.0);
  - with --plain-reference N (the paper's setting: Llama-3.1-8B, b = 16384, plain 16K): Locret prefill at the longest
    length >= 0.9 x plain prefill at N;
  - selection + read-back + compaction <= 5 % of the prefill time at the longest length;
  - peak RSS at the longest length <= 1.05 x at 8K;
  - Locret decode tok/s after a --decode-depth prompt >= 0.9 x plain decode after a 2.5K prompt (and, reported,
    against plain decode at b + B, the depth a Locret token attends to, when that is not 2.5K), both over
    --decode-tokens generated tokens (default: the ubatch B, one eviction cycle: a generated token evicts once per
    B tokens, so a shorter run holds an eviction or not by the phase the prompt left, and kept positions also
    re-position at their limit; 64 tokens made one layout's figure hold an eviction and the other's none);
  - Locret prefill at the longest length against plain llama.cpp's prefill of one ubatch at the attention depth
    Locret works at (llama-bench -p B -d b+B: the per-ubatch cost the comparison really is; >= 0.9 on a GPU).
Exits 1 when a target is missed (the targets are the first policy's, with the first --positions). --policies runs
the same figures for each eviction policy (and --positions compact,keep: each way of placing the kept units), side by
side (--policy-settings NAME:K=V,... gives a policy its own settings, passed as --locret-policy NAME:K=V,...; sage,
random and streaming need no heads; sage caches each whole prompt, so its lengths must reach the budget plus the
ubatch); every policy's prefill and decode are also reported against plain llama.cpp.
Without --heads it makes random heads (speed does not depend on their values). --profile-compaction adds a table of
the compaction graph (its nodes, and the host's time to build, allocate and launch it per compaction), from two
more prefills per run with LOCRET_PROFILE=1, the graph stacked over the layers (the default) and built layer by layer
(LOCRET_DEBUG_COMPACT_PER_LAYER=1), with the ratio of their prefill speeds: on a GPU, where each node is a launch,
what one node per layer costs.
--decode-split adds one decode figure with the heads' graph but no eviction (after 2560 tokens, in a cache large
enough to never evict) and splits a generated token's time into plain llama.cpp's, the heads' graph's and the
eviction's (selection, compaction, the cache's bookkeeping), each in ms per token: where a decode gap comes from;
and one more figure with the heads' graph built layer by layer (LOCRET_DEBUG_HEADS=layer): what scoring a generated
token over the stacked heads saves.
--shape NAME benchmarks a random-weight model with the exact shapes of a model the paper ran (py/locret/shapes.py:
llama3.1-8b, phi3-mini-128k, and scaled-down variants for a CPU), with its d_R = 1024 random heads.

--device D (devices/, also `locret bench --device D`) takes the budget, chunk, KV type and GPU layers
from the profile for the model (each still overridable) and exits 3 when a measured peak RSS is over
the memory the profile gives the model (host and unified-memory devices).
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


PROFILE_LINE = re.compile(r"locret-profile: compaction build ([\d.]+) alloc ([\d.]+) inputs ([\d.]+) compute ([\d.]+) ms "
                          r"\(nodes (\d+)")


SELECT_LINE = re.compile(r"locret-profile: select build ([\d.]+) alloc ([\d.]+) compute and read-back ([\d.]+) ms")

# the host's work between an eviction's one wait and its compaction graph, which a GPU idles through
CHOSEN_LINE = re.compile(r"locret-profile: selected by \w+, [\d.]+ ms since the start \(policy [\d.]+, choice [\d.]+, "
                         r"keep lists and moves ([\d.]+) ms\)")


def compaction_profile(stderr: str) -> dict:
    """The compaction graphs of a LOCRET_PROFILE=1 run: how many ran, their largest node count, and the host's mean
    milliseconds per compaction to build, allocate, fill the inputs of and compute the graph (on a GPU the compute
    is queued, so that figure is the launches of its nodes): what one node per layer and job costs. With a selection
    on the device, also its mean allocation and its compute-and-wait per eviction: an allocation that takes as long as
    a ubatch is ggml's scheduler waiting for the backend before it re-reserves (docs/memory.md). And the host's mean
    milliseconds per eviction to turn the choice into keep lists and move tables (the device waits through them)."""
    found = [tuple(float(x) for x in m.groups()) for m in PROFILE_LINE.finditer(stderr)]
    if not found:
        return {}
    n = len(found)
    mean = [sum(f[i] for f in found) / n for i in range(4)]
    out = {"profiled_compactions": n, "compaction_nodes": int(max(f[4] for f in found)),
           "build_ms": mean[0], "alloc_ms": mean[1], "inputs_ms": mean[2], "launch_ms": mean[3]}
    chosen = [float(m.group(1)) for m in CHOSEN_LINE.finditer(stderr)]
    if chosen:
        out.update({"profiled_choices": len(chosen), "keep_lists_ms": sum(chosen) / len(chosen)})
    sel = [tuple(float(x) for x in m.groups()) for m in SELECT_LINE.finditer(stderr)]
    if sel:
        out.update({"profiled_selections": len(sel), "select_alloc_ms": sum(f[1] for f in sel) / len(sel),
                    "select_wait_ms": sum(f[2] for f in sel) / len(sel)})
    return out


def bench(args: argparse.Namespace, *, locret: bool, prompt: int, gen: int, depth: int, policy: str = "heads",
          positions: str | None = None, profile: bool = False, per_layer: bool = False,
          budget: int | None = None, heads_by_layer: bool = False) -> dict:
    """One llama-bench run; `profile`: with LOCRET_PROFILE=1, and the compaction graphs' figures
    (compaction_profile) in the result; `per_layer`: the compaction built layer by layer
    (LOCRET_DEBUG_COMPACT_PER_LAYER=1), not over the stacked layers; `budget`: instead of --budget;
    `heads_by_layer`: every ubatch scored layer by layer (LOCRET_DEBUG_HEADS=layer), generated tokens too."""
    from locret import tool_path

    cmd = [str(tool_path("llama-bench")), "-m", str(args.model), "-p", str(prompt), "-n", str(gen),
           "-d", str(depth), "-r", "1", "--no-warmup", "-t", str(args.threads), "-ub", str(args.ubatch),
           "-b", str(args.ubatch), "-o", "json"]
    if args.kv_type:
        cmd += ["-ctk", args.kv_type, "-ctv", args.kv_type]
    if args.gpu_layers:
        cmd += ["-ngl", str(99999 if args.gpu_layers < 0 else args.gpu_layers)]
    if locret:
        policy, _, schedule = policy.partition(":")
        settings = args.policy_settings.get(policy)
        cmd += ["--locret-budget", str(args.budget if budget is None else budget)]
        if policy == "heads":
            cmd += ["--locret-heads", str(args.heads)]
        if policy != "heads" or settings:
            # the policy's own settings go through as they are, after its name: the library checks them
            cmd += ["--locret-policy", f"{policy}:{settings}" if settings else policy]
        if schedule:
            cmd += ["--locret-budget-schedule", schedule]
        if args.stabilizers is not None and policy != "sage":   # SAGE-KV's recent window is its own
            cmd += ["--locret-stabilizers", str(args.stabilizers)]
        if positions:
            cmd += ["--locret-positions", positions]
    t0 = time.time()
    extra = {}
    if profile:
        extra["LOCRET_PROFILE"] = "1"
    if per_layer:
        extra["LOCRET_DEBUG_COMPACT_PER_LAYER"] = "1"
    if heads_by_layer:
        extra["LOCRET_DEBUG_HEADS"] = "layer"
    env = dict(os.environ, **extra) if extra else None
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"llama-bench failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    if args.save_stderr:
        # every run's own log (LOCRET_PROFILE lines included), so that a GPU session's figures can be re-read later
        # without another run: one file per run, named by what it measured
        name = "-".join(str(x) for x in ("locret" if locret else "plain", policy if locret else None, positions,
                                         f"p{prompt}", f"n{gen}", f"d{depth}", "profile" if profile else None,
                                         "per-layer" if per_layer else None)
                        if x is not None).replace("/", "_").replace(":", "_")
        Path(args.save_stderr).mkdir(parents=True, exist_ok=True)
        (Path(args.save_stderr) / f"{name}.stderr").write_text(proc.stderr)
    rows = json.loads(proc.stdout)
    out = {"tps": rows[0]["avg_ts"], "seconds": time.time() - t0}
    # llama-bench's split of the eviction time inside the timed runs (ggml_ext: selection, compaction, read-back)
    split = re.search(r"locret: eviction time: select ([\d.]+) ms, compaction ([\d.]+) ms, read-back ([\d.]+) ms: "
                      r"([\d.]+) ms of ([\d.]+) ms timed", proc.stderr)
    if split:
        out.update(zip(("select_ms", "compact_ms", "readback_ms", "eviction_ms", "timed_ms"),
                       (float(x) for x in split.groups())))
        out["n_ubatches"] = max(1, -(-(prompt + depth) // args.ubatch)) if prompt else max(1, gen)
    moved = re.search(r"locret: eviction rows: moved (\d+), rotated (\d+), kept (\d+) .*host syncs (\d+) in (\d+) "
                      r"compactions", proc.stderr)
    if moved:
        out.update(zip(("rows_moved", "rows_rotated", "rows_kept", "host_syncs", "compactions"),
                       (int(x) for x in moved.groups())))
    device = re.findall(r"locret: device memory: (\S+) ([\d.]+) MiB in use", proc.stderr)
    if device:
        out["device_mib"] = sum(float(mib) for _, mib in device)
    if profile:
        out.update(compaction_profile(proc.stderr))
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
    ap.add_argument("--shape", help="a random-weight model with the shapes of a paper model (py/locret/shapes.py)")
    ap.add_argument("--plain-lengths", default=None,
                    help="plain llama.cpp prefill lengths (default: the --lengths up to 32768)")
    ap.add_argument("--plain-reference", type=int, default=None,
                    help="plain prefill length that the longest Locret prefill is held to (>= 0.9x; the paper's "
                         "8B setting: 16384)")
    ap.add_argument("--heads", default=None, help="heads GGUF (default: random heads made for the model)")
    ap.add_argument("--budget", type=int, help="Locret budget b (default 2048, or the --device profile's)")
    ap.add_argument("--ubatch", type=int, help="chunk B (default 512, or the --device profile's)")
    ap.add_argument("--stabilizers", type=int, help="stabilizers n_s (default: the heads', or the profile's)")
    ap.add_argument("--kv-type", help="KV cache type for both K and V (default f16, or the profile's)")
    ap.add_argument("--gpu-layers", type=int, help="layers on the GPU, -1 all (default 0, or the profile's)")
    ap.add_argument("--device", help="device profile (devices/): its settings, and its memory as a limit")
    ap.add_argument("--lengths", default="2048,8192,32768,131072")
    ap.add_argument("--decode-depth", type=int, default=131072)
    ap.add_argument("--decode-tokens", type=int, default=None,
                    help="generated tokens per decode figure (default: the ubatch, one eviction cycle)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--policies", default="heads",
                    help="eviction policies to measure, comma-separated (heads, lagkv, sage, streaming, random; default "
                         "heads); POLICY:SCHEDULE adds a budget schedule (heads:pyramid, streaming:FILE)")
    ap.add_argument("--policy-settings", action="append", default=[], metavar="NAME:K=V,...",
                    help="a policy's own settings, key=value pairs separated by commas after its name (repeatable, once "
                         "per policy of --policies), passed as --locret-policy NAME:K=V,...; each policy's keys: "
                         "docs/policies.md (default: the policy's own)")
    ap.add_argument("--positions", default=None,
                    help="--locret-positions values to measure, comma-separated (inplace, compact, keep, keep:N; default: the "
                         "engine's default only); every policy runs with each")
    ap.add_argument("--profile-compaction", action="store_true",
                    help="two more prefills (the longest length up to 32768) with LOCRET_PROFILE=1 per --positions "
                         "value, the compaction graph stacked over the layers (the default) and built layer by layer: "
                         "its node count, the host's time per compaction to build, allocate and launch it, and the "
                         "prefill speed of each (its timings are not mixed into the table's)")
    ap.add_argument("--decode-split", action="store_true",
                    help="one more decode figure, the heads' graph without eviction (a budget above the depth), and "
                         "a generated token's time split into plain llama.cpp's, the heads' graph's and the eviction's")
    ap.add_argument("--save-stderr", metavar="DIR",
                    help="write each llama-bench run's stderr (its Locret report, LOCRET_PROFILE lines) to DIR")
    ap.add_argument("--d-r", type=int, default=256,
                    help="hidden size of the random heads made without --heads (default 256: 5.5%% of SmolLM2's "
                         "per-token work, the paper's 2.5-8%% range; its d_R = 1024 is for 3.8B-8B models)")
    ns = ap.parse_args(argv)
    ns.argv = list(argv)
    ns.policy_settings = policy_settings(ns.policy_settings)
    return ns


def policy_settings(entries: list[str]) -> dict[str, str]:
    """--policy-settings NAME:K=V,... (repeatable) as {policy: "K=V,..."}; SystemExit for an entry without a name or
    settings, or a policy given twice."""
    out: dict[str, str] = {}
    for entry in entries:
        name, colon, settings = entry.partition(":")
        if not colon or not name or not settings:
            raise SystemExit(f"bench_eviction: error: --policy-settings takes NAME:key=value[,key=value...] "
                             f"(got {entry!r})")
        if name in out:
            raise SystemExit(f"bench_eviction: error: --policy-settings gives the settings of {name} twice: give them "
                             "once, comma-separated")
        out[name] = settings
    return out


def main() -> int:
    args = parse(sys.argv[1:])
    if args.shape is not None:
        from locret import shapes

        args.model, shape_heads = (str(p) for p in shapes.make_shape_models(args.shape))
        args.argv += ["--model", args.model]
        if args.heads is None:
            args.heads = shape_heads
            args.argv += ["--heads", args.heads]
    if args.model is None:
        from locret import models

        args.model = str(models.resolve(models.DEFAULT_MODEL))
        args.argv += ["--model", args.model]
    from locret.eviction import POLICIES

    policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies if p.partition(":")[0] not in POLICIES]
    if unknown or not policies:
        raise SystemExit(f"bench_eviction: error: unknown policy {','.join(unknown) or '(none)'}; "
                         f"valid: {', '.join(POLICIES)}")
    measured_policies = {p.partition(":")[0] for p in policies}
    unused = [name for name in args.policy_settings if name not in measured_policies]
    if unused:
        raise SystemExit(f"bench_eviction: error: --policy-settings for {', '.join(unused)}, which --policies does not "
                         f"measure ({args.policies})")
    from locret.eviction import parse_policy
    from locret.heads import HeadsError

    for name, settings in args.policy_settings.items():
        try:
            parse_policy(f"{name}:{settings}")   # the library's check, before any figure runs
        except HeadsError as e:
            raise SystemExit(f"bench_eviction: error: --policy-settings {name}:{settings}: {e}")
    if args.heads is None and any(p.partition(":")[0] == "heads" for p in policies):
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

    plain_lengths = ([int(x) for x in args.plain_lengths.split(",")] if args.plain_lengths
                     else [n for n in lengths if n <= 32768])
    if args.plain_reference and args.plain_reference not in plain_lengths:
        plain_lengths.append(args.plain_reference)
    ppp = {n: record(f"plain llama.cpp prefill {n}", locret=False, prompt=n, gen=0, depth=0) for n in plain_lengths}
    plain_tg = record("plain llama.cpp decode after 2560", locret=False, prompt=0,
                      gen=args.decode_tokens, depth=2560)
    # Locret attends to about b + B cells, a prefill ubatch and a generated token alike: plain llama.cpp at that
    # depth is the comparison of the same attention work (the issue's 2.5K is b + B for SmolLM2's b = 2048, B = 512,
    # not for the 8B shape's b = 16384)
    same_depth = args.budget + args.ubatch
    plain_tg_depth = plain_tg if same_depth == 2560 else record(
        f"plain llama.cpp decode after {same_depth}", locret=False, prompt=0, gen=args.decode_tokens, depth=same_depth)
    at_depth = record(f"plain llama.cpp prefill {args.ubatch} at depth {same_depth}", locret=False,
                      prompt=args.ubatch, gen=0, depth=same_depth)
    positions = [p for p in (args.positions or "").split(",") if p] or [None]
    def label(run):
        policy, pos = run
        name, _, schedule = policy.partition(":")
        name = "Locret" if name == "heads" else name
        name = f"{name} ({Path(schedule).name} schedule)" if schedule else name
        return f"{name}, positions {pos}" if pos else name

    runs = [(policy, pos) for policy in policies for pos in positions]
    per_policy = {}
    for run in runs:
        policy, pos = run
        pp = {n: record(f"{label(run)} b={args.budget} prefill {n}", locret=True, prompt=n, gen=0, depth=0,
                        policy=policy, positions=pos) for n in lengths}
        tg = record(f"{label(run)} b={args.budget} decode after {args.decode_depth}", locret=True, prompt=0,
                    gen=args.decode_tokens, depth=args.decode_depth, policy=policy, positions=pos)
        per_policy[run] = (pp, tg)
    lpp, ltg = per_policy[runs[0]]
    no_evict = None
    if args.decode_split:
        # the same 2560 tokens of depth as plain's decode figure, in a cache that holds them and every generated token
        # (b above depth + generated, so no eviction ever runs): what the heads' graph alone adds to a token
        policy, pos = runs[0]
        no_evict = record(f"{label(runs[0])} decode after 2560, no eviction (b = {no_evict_budget(args)})",
                          locret=True, prompt=0, gen=args.decode_tokens, depth=2560, policy=policy, positions=pos,
                          budget=no_evict_budget(args))
        # and with the heads' graph built layer by layer (a generated token is scored over the stacked heads by
        # default): what the stacking saves a token
        no_evict_by_layer = record(f"{label(runs[0])} decode after 2560, no eviction, heads' graph layer by layer",
                                   locret=True, prompt=0, gen=args.decode_tokens, depth=2560, policy=policy,
                                   positions=pos, budget=no_evict_budget(args), heads_by_layer=True)

    on_gpu = args.gpu_layers != 0
    print(f"\n{Path(args.model).name}, b = {args.budget}, B = {args.ubatch}, {args.threads} threads, "
          f"{'GPU layers ' + str(args.gpu_layers) if on_gpu else 'CPU'}, llama-bench -r 1, decode figures over "
          f"{args.decode_tokens} generated tokens\n")
    print("| run | tok/s | peak RSS (MiB) | device memory (MiB) | per ubatch: compute / selection / read-back / "
          "compaction (ms) | eviction share | rows moved / kept | host syncs per compaction |"
          "\n|---|---:|---:|---:|---|---:|---:|---:|")
    for name, r in rows:
        split = "-"
        if "select_ms" in r:
            n = r["n_ubatches"]
            compute = (r["timed_ms"] - r["eviction_ms"]) / n
            split = (f"{compute:.2f} / {r['select_ms'] / n:.2f} / {r['readback_ms'] / n:.2f} / "
                     f"{r['compact_ms'] / n:.2f}")
        share = f"{100 * r['eviction_ms'] / r['timed_ms']:.2f} %" if r.get("timed_ms") else "-"
        device_mib = f"{r['device_mib']:.0f}" if "device_mib" in r else "-"
        moved = f"{r['rows_moved'] / r['rows_kept']:.3f}" if r.get("rows_kept") else "-"
        syncs = f"{r['host_syncs'] / r['compactions']:.1f}" if r.get("compactions") else "-"
        print(f"| {name} | {r['tps']:.1f} | {r['peak_rss_mib']:.0f} | {device_mib} | {split} | {share} | {moved} | "
              f"{syncs} |")

    hi = max(lengths)
    share = lpp[hi]["eviction_ms"] / lpp[hi]["timed_ms"] if lpp[hi].get("timed_ms") else float("nan")
    checks = []  # (name, ratio, needed, at least?)
    for n in sorted(set(lengths) & set(plain_lengths)):
        need = {8192: 0.85 if on_gpu else 1.0, 32768: 1.0}.get(n)
        checks.append((f"Locret prefill {n} / plain prefill {n}", lpp[n]["tps"] / ppp[n]["tps"], need, True))
    if args.plain_reference:
        checks.append((f"Locret prefill {hi} / plain prefill {args.plain_reference}",
                       lpp[hi]["tps"] / ppp[args.plain_reference]["tps"], 0.9, True))
    checks.append((f"{label(runs[0])} selection + read-back + compaction / prefill time at {hi}", share, 0.05, False))
    if 8192 in lpp and hi != 8192:
        checks.append((f"peak RSS {hi} / 8192 (Locret)", lpp[hi]["peak_rss_mib"] / lpp[8192]["peak_rss_mib"], 1.05, False))
    checks.append((f"Locret decode after {args.decode_depth} / plain decode after 2560", ltg["tps"] / plain_tg["tps"],
                   0.9, True))
    if plain_tg_depth is not plain_tg:
        checks.append((f"Locret decode after {args.decode_depth} / plain decode after {same_depth} (the same "
                       f"attention depth)", ltg["tps"] / plain_tg_depth["tps"], None, True))
    depth_name = f"plain prefill {args.ubatch} at depth {same_depth}"
    checks.append((f"{label(runs[0])} prefill {hi} / {depth_name}", lpp[hi]["tps"] / at_depth["tps"],
                   0.9 if on_gpu else None, True))
    for run in runs[1:]:
        pp, tg = per_policy[run]
        for n in sorted(set(lengths) & set(plain_lengths)):
            checks.append((f"{label(run)} prefill {n} / plain prefill {n}", pp[n]["tps"] / ppp[n]["tps"], None, True))
        checks.append((f"{label(run)} prefill {hi} / {depth_name}", pp[hi]["tps"] / at_depth["tps"], None, True))
        share_run = pp[hi]["eviction_ms"] / pp[hi]["timed_ms"] if pp[hi].get("timed_ms") else float("nan")
        checks.append((f"{label(run)} eviction / prefill time at {hi}", share_run, None, False))
        checks.append((f"{label(run)} decode after {args.decode_depth} / plain decode after 2560",
                       tg["tps"] / plain_tg["tps"], None, True))
    if no_evict is not None:
        if no_evict.get("compactions", -1) != 0:
            raise SystemExit(f"bench_eviction: the no-eviction decode figure evicted or its count was not read "
                             f"({no_evict.get('compactions', 'no count')} compactions): its split would be wrong")
        ms = {name: 1000.0 / r["tps"] for name, r in (("plain", plain_tg), ("graph", no_evict), ("locret", ltg))}
        print(f"\nA generated token's time ({label(runs[0])}, {args.decode_tokens} tokens each): plain llama.cpp after "
              f"2560 {ms['plain']:.3f} ms; the heads' graph adds {ms['graph'] - ms['plain']:.3f} ms (the same depth, "
              f"no eviction); eviction after {args.decode_depth}, and attending to {same_depth} cells "
              f"instead of 2560, add {ms['locret'] - ms['graph']:.3f} ms; Locret {ms['locret']:.3f} ms")
        by_layer_ms = 1000.0 / no_evict_by_layer["tps"]
        print(f"The heads' graph built layer by layer instead of over the stacked heads adds "
              f"{by_layer_ms - ms['plain']:.3f} ms a token (stacked: {ms['graph'] - ms['plain']:.3f} ms)")
        checks.append((f"{label(runs[0])} decode after 2560 without eviction / plain decode after 2560",
                       no_evict["tps"] / plain_tg["tps"], None, True))
        checks.append((f"{label(runs[0])} decode after 2560 without eviction, heads stacked / layer by layer",
                       no_evict["tps"] / no_evict_by_layer["tps"], None, True))
    if args.profile_compaction:
        n_prof = max([n for n in lengths if n <= 32768] or [min(lengths)])
        print(f"\nCompaction graphs of a prefill of {n_prof} (LOCRET_PROFILE=1, a run apart; per compaction, the "
              f"host's time; on a GPU the compute is queued: its figure is the launches)\n")
        print("| run | compaction graph | prefill tok/s | compactions | nodes | build (ms) | allocation (ms) | inputs "
              "(ms) | compute / launch (ms) | device selection: allocation / compute and wait (ms) | keep lists and "
              "moves (ms) |\n"
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|")
        for run in runs:
            # the default graph (the layers stacked where the cache allows) and the one built layer by layer, side by
            # side: what the stacking saves on this backend
            forms = {}
            for form, per_layer in (("default", False), ("per layer", True)):
                r = bench(args, locret=True, prompt=n_prof, gen=0, depth=0, policy=run[0], positions=run[1],
                          profile=True, per_layer=per_layer)
                forms[form] = r
                if not r.get("profiled_compactions"):
                    print(f"| {label(run)} | {form} | {r['tps']:.1f} | 0 | - | - | - | - | - | - | - |")
                    continue
                sel = (f"{r['select_alloc_ms']:.2f} / {r['select_wait_ms']:.2f}" if r.get("profiled_selections")
                       else "- (host selection)")
                print(f"| {label(run)} | {form} | {r['tps']:.1f} | {r['profiled_compactions']} | "
                      f"{r['compaction_nodes']} | {r['build_ms']:.2f} | {r['alloc_ms']:.2f} | {r['inputs_ms']:.2f} | "
                      f"{r['launch_ms']:.2f} | {sel} | {r.get('keep_lists_ms', float('nan')):.2f} |")
            checks.append((f"{label(run)} prefill {n_prof}, default compaction graph / per-layer graph (profiled)",
                           forms["default"]["tps"] / forms["per layer"]["tps"], None, True))
    print("\n| target | ratio | needed | |\n|---|---:|---:|---|")
    ok = True
    for name, ratio, need, at_least in checks:
        if need is None:
            print(f"| {name} | {ratio:.3f} | - | (reported) |")
            continue
        passed = ratio >= need if at_least else ratio <= need
        ok &= passed
        print(f"| {name} | {ratio:.3f} | {'>=' if at_least else '<='} {need} | {'ok' if passed else 'MISSED'} |")
    if device is not None:
        over = device_check(device, rows)
        if over:
            return 3
    return 0 if ok else 1


def no_evict_budget(args: argparse.Namespace) -> int:
    """A budget whose cache holds 2560 tokens of depth and every generated token without an eviction: the cache has
    b + B cells and evicts when a ubatch would not fit."""
    return 2560 + args.decode_tokens + args.ubatch


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
    if getattr(args, "decode_tokens", None) is None:
        args.decode_tokens = args.ubatch   # one eviction cycle of generation, whatever phase the prompt left
    elif args.decode_tokens < 1:
        raise SystemExit(f"bench_eviction: error: --decode-tokens must be at least 1 (got {args.decode_tokens})")
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
