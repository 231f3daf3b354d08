#!/usr/bin/env python3
"""What llama-server allocates with a budget schedule and several slots: for each schedule and slot count, the KV
cache llama.cpp reports when the context is made (its `llama_kv_cache: size = ...` line), the bytes `locret plan`
predicts for the same settings, and the server's resident memory once it serves (VmRSS, after /health answers).
The ratios against one slot are printed beside them, so that `-np N` can be checked against N x one slot's cache in
one run. Prints a markdown table.

    .venv/bin/python experiments/slots_memory.py [--budget 1088] [--schedules uniform,pyramid] [--slots 1,4]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "py"))
sys.path.insert(0, str(REPO / "scripts"))  # server_faults.rss_mib

MIB = 1 << 20
KV_LINE = re.compile(r"llama_kv_cache: size = +([0-9.]+) MiB \( *(\d+) cells, +(\d+) layers, +(\d+)/(\d+) seqs\)")


def serve_once(cmd: list[str], port: int, log_path: Path, timeout_s: float) -> tuple[float, int, float, float]:
    """(KV MiB llama.cpp reports, its cells, VmRSS MiB, VmHWM MiB) of a server started with cmd, then stopped"""
    from locret.serve import stop, wait_healthy
    from server_faults import rss_mib

    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            wait_healthy(f"http://127.0.0.1:{port}", server, log_path, timeout_s)
            rss, hwm = rss_mib(server.pid, "VmRSS"), rss_mib(server.pid, "VmHWM")
        finally:
            stop(server)
    found = KV_LINE.findall(log_path.read_text(errors="replace"))
    if not found:
        raise RuntimeError(f"no 'llama_kv_cache: size' line in {log_path}")
    # an iSWA model reports two caches, a budget schedule a cache per budget: their sum is the KV memory
    return sum(float(f[0]) for f in found), sum(int(f[1]) for f in found), rss, hwm


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--budget", type=int, default=1088, help="the mean budget per layer (default 1088)")
    ap.add_argument("--schedules", default="uniform,pyramid",
                    help="uniform, pyramid or schedule files, comma-separated")
    ap.add_argument("--slots", default="1,4", help="slot counts (-np), comma-separated; the first is the reference")
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--n-ctx", type=int, default=32768, help="logical context per slot")
    ap.add_argument("--timeout", type=float, default=300, help="seconds a server may take to start")
    args = ap.parse_args()
    try:
        slot_counts = [int(s) for s in args.slots.split(",")]
    except ValueError:
        ap.error("--slots must be whole numbers separated by commas")
    if not slot_counts or min(slot_counts) < 1:
        ap.error("--slots must be at least 1")
    schedules = [s for s in args.schedules.split(",") if s]
    if not schedules:
        ap.error("--schedules is empty")

    import locret  # noqa: F401  (points llama_cpp at our library: first)
    from locret import models, planner, tool_path
    from locret.serve import free_port

    model = str(models.resolve(args.model))
    heads = str(models.shipped_heads(args.model))
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    print("| schedule | slots | KV reported (MiB) | cells per slot (all caches) | KV planned (MiB) | x one slot's KV | "
          "RSS serving (MiB) | "
          "RSS more than one slot (MiB) | of which KV |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for schedule in schedules:
        ref_kv = ref_rss = None
        for slots in slot_counts:
            try:
                plan = planner.plan("cpu-2core", args.model, heads=heads, context=args.n_ctx, budget=args.budget,
                                    ubatch=args.ubatch, schedule=schedule, slots=slots, measure_buffers=False)
            except (ValueError, RuntimeError) as e:
                print(f"slots_memory: error: {e}", file=sys.stderr)
                return 1
            planned = planner.predict_kv_bytes(plan.model, plan.settings) / MIB
            port = free_port()
            cmd = [str(tool_path("llama-server")), "-m", model, "--locret-heads", heads,
                   "--locret-budget", str(args.budget), "-np", str(slots), "-c", str(args.n_ctx * slots),
                   "-b", str(max(args.ubatch, slots)), "-ub", str(args.ubatch), "-t", "1", "--cache-ram", "0",
                   "-lv", "4",   # the context's creation log (llama_kv_cache's size line) is at info level
                   "--host", "127.0.0.1", "--port", str(port)]
            if schedule != "uniform":
                cmd += ["--locret-budget-schedule", schedule]
            try:
                kv, cells, rss, _ = serve_once(cmd, port, tmp / f"slots-memory-{port}.log", args.timeout)
            except RuntimeError as e:
                print(f"slots_memory: error: {e}", file=sys.stderr)
                return 1
            if ref_kv is None:
                ref_kv, ref_rss = kv, rss
            print(f"| {schedule} | {slots} | {kv:.2f} | {cells} | {planned:.2f} | {kv / ref_kv:.2f} | {rss:.1f} | "
                  f"{rss - ref_rss:.1f} | {kv - ref_kv:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
