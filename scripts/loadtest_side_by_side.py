#!/usr/bin/env python3
"""Users served in the same KV memory: llama-server with Locret against plain llama-server, one user script.

For each KV memory M (given as the cells of plain llama-server's slots, a whole number of them: 16384 = two 8K
slots; in bytes, what plain llama-server allocates for those slots, llama.cpp's own size, in which a sliding-window
model's window layers hold only their window and a ubatch), three servers play the same script (locret loadtest's users, one seed) one after the other, each alone on the machine:

- plain@M: plain llama-server (no Locret flag) whose slots x context fill M: --plain-slot-ctx tokens a slot, so
  M / that many slots; a prompt longer than its slot is refused, as plain llama.cpp does;
- locret@M: `locret serve` (the patched llama-server) with its default heads (the plain shipped heads, which keep
  llama-server's prefix cache across a conversation's turns; --heads for others), as many slots
  as fit M with a budget of at least --min-budget (by default the budget `locret plan --doc-tokens` gives the longest
  conversation at --accuracy: one rule, planner/accuracy.py): each slot gets M / slots of memory, and its budget is
  the largest whose KV cache and scores fit that share (the library's --locret-budget-mib rule); the run checks the
  server's KV gauge against M and records the most slots busy at once, what the run sustained;
- plain-unbounded: plain llama-server with one full slot per user (--plain-slot-ctx each), the accuracy reference
  (run once, not per M).

    .venv/bin/python scripts/loadtest_side_by_side.py --users 16 --lengths 4096:7168 --memory-cells 16384 \
        -o results/loadtest-smollm2

Writes <output>/<server>.json (settings, figures, every request), <output>/summary.json and a markdown table
(<output>/table.md, also printed). Exit 1 on bad input, 2 when a server does not start.
"""
from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "py"))

from locret import eviction, models, planner, serve  # noqa: E402
from locret._library import tool_path  # noqa: E402
from locret.loadtest import cli as loadtest  # noqa: E402
from locret.planner.accuracy import budget_for, parse_accuracy, points_for  # noqa: E402
from locret.planner.advice import DEFAULT_ACCURACY  # noqa: E402

STARTUP_S = 300


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    loadtest.add_script_arguments(p)
    p.add_argument("--memory-cells", default="16384",
                   help="KV memory M as the cells of plain llama-server's slots (a multiple of --plain-slot-ctx), "
                        "comma-separated for a sweep (default 16384: two 8K slots); in MiB, what plain llama-server "
                        "allocates for them")
    p.add_argument("--plain-slot-ctx", type=int, default=8192, help="a plain slot's context in tokens (default 8192)")
    p.add_argument("--min-budget", type=int,
                   help="the least budget a Locret slot may have: the slot count is the most that keep it (default: "
                        "locret plan's budget for the longest conversation at --accuracy)")
    p.add_argument("--accuracy", default=DEFAULT_ACCURACY,
                   help=f"without --min-budget: the share of full attention's right answers the plan's budget keeps "
                        f"by what was measured (default {DEFAULT_ACCURACY})")
    p.add_argument("--ubatch", type=int, default=serve.DEFAULT_UBATCH, help="chunk, every server (default 512)")
    p.add_argument("--heads", help="retaining heads (default: locret serve's, the model's shipped plain heads; a "
                   "Locret-Q heads file moves each request's closing question to its start, so a follow-up re-reads "
                   "the whole conversation)")
    p.add_argument("--servers", default="plain,locret,unbounded",
                   help="which to run: plain, locret, unbounded (default all three)")
    p.add_argument("--cache-ram", type=int,
                   help="every server's --cache-ram (MiB of host memory for llama-server's prompt cache, which keeps "
                        "each finished prompt's state: its RSS grows by one slot state a request up to this limit; "
                        "0: off). Default: llama-server's own (8192)")
    p.add_argument("--requery", choices=("on", "off"),
                   help="the Locret server's --locret-requery (with Locret-Q heads: on, a follow-up's question is "
                        "pinned and the conversation read again; off, the first question stays pinned and a follow-up "
                        "reads only its new tokens). Default: llama-server's own (on)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("-o", "--output", required=True, help="folder for the results")
    return p.parse_args(argv)


def plain_command(model: Path, cells: int, slots: int, args, port: int) -> list[str]:
    return [str(tool_path("llama-server")), "-m", str(model), "-c", str(cells), "-np", str(slots),
            "-ub", str(args.ubatch), "-b", str(max(args.ubatch, 2048)), "-t", str(args.threads),
            "-tb", str(args.threads), "--metrics", "--no-webui", "--host", "127.0.0.1", "--port", str(port)] + \
        cache_ram(args)


def plain_kv_mib(model: Path, slots: int, args) -> float:
    """MiB of K and V that plain llama-server allocates for `slots` slots of --plain-slot-ctx: llama.cpp's own size
    (a sliding-window model's window layers hold their window, so M is not a full cache of every layer)."""
    return planner.plain_kv_bytes(model, args.plain_slot_ctx, slots, args.ubatch, "f16") / 2**20


def cache_ram(args) -> list[str]:
    return [] if args.cache_ram is None else ["--cache-ram", str(args.cache_ram)]


def longest_conversation(args) -> int:
    """Tokens of the longest conversation: the longest document, and each turn's question, template and answer."""
    hi = loadtest.users_module.parse_lengths(args.lengths)[1]
    return hi + args.turns * (args.max_tokens + 64)


def min_budget(args) -> int:
    """--min-budget, or the plan's budget for the longest conversation at --accuracy."""
    if args.min_budget is not None:
        return args.min_budget
    return budget_for(longest_conversation(args), parse_accuracy(args.accuracy), args.ubatch,
                      points_for(args.model)).budget


def locret_slots(model: Path, heads: Path | None, memory_mib: float, args) -> tuple[int, int]:
    """The most slots whose share of `memory_mib` still holds a budget of at least --min-budget, and that budget
    (the library's rule for --locret-budget-mib, per slot with that many slots)."""
    least = min_budget(args)
    best = None
    for slots in range(1, args.users + 1):
        try:
            # swa_full False: llama-server's window cache (a window and a ubatch), as the server will make it
            b = eviction.budget_for_mib(model, memory_mib / slots, heads=heads, n_ubatch=args.ubatch,
                                        n_seq=slots, swa_full=False)["budget"]
        except eviction.HeadsError:
            break
        if b < least:
            break
        best = (slots, b)
    if best is None:
        raise ValueError(f"{memory_mib:.1f} MiB holds no Locret slot with a budget of {least}: lower "
                         "--min-budget or raise --memory-cells")
    return best


def locret_command(model: Path, heads: Path | None, slots: int, budget: int, args, port: int) -> list[str]:
    context = 1 << max(longest_conversation(args) + 256, 4096).bit_length()  # logical: free
    cmd = [sys.executable, "-m", "locret", "serve", "--model", str(model), "--slots", str(slots),
           "--budget", str(budget), "--ubatch", str(args.ubatch), "--context", str(context),
           "--threads", str(args.threads), "--port", str(port)]
    cmd += ["--heads", str(heads)] if heads is not None else []
    requery = [] if args.requery is None else ["--locret-requery", args.requery]
    return cmd + ["--", "--metrics", "--no-webui", "-tb", str(args.threads)] + cache_ram(args) + requery


def serve_and_play(name: str, cmd: list[str], users, args, out: Path) -> dict:
    port = int(cmd[cmd.index("--port") + 1])
    url = f"http://127.0.0.1:{port}"
    log = out / f"{name}.server.log"
    with open(log, "w") as log_file:
        server = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO)
        try:
            serve.wait_healthy(url, server, log, STARTUP_S)
            result = loadtest.play(url, server.pid, users, args, journal=out / f"{name}.requests.jsonl")
        finally:
            serve.stop(server)
    result = {"server": name, "command": cmd, **result}
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    # stopped (SIGTERM), the script unwinds so that the server it started is stopped too (serve_and_play's finally)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    out = Path(args.output)
    try:
        model = models.resolve(args.model)
        facts = planner.read_model(model)
        heads = planner.resolve_heads(args.model, model, facts, args.heads)[0]
        sweep = [int(x) for x in args.memory_cells.split(",")]
        wanted = args.servers.split(",")
        if bad := [w for w in wanted if w not in ("plain", "locret", "unbounded")]:
            raise ValueError(f"unknown server {', '.join(bad)}; valid: plain, locret, unbounded")
        plans = []   # (M in cells, M in MiB, Locret slots, their budget)
        for cells in sweep:
            if cells < args.plain_slot_ctx and "plain" in wanted:
                raise ValueError(f"--memory-cells {cells} holds no plain slot of {args.plain_slot_ctx} tokens")
            if cells % args.plain_slot_ctx:
                raise ValueError(f"--memory-cells {cells} is not a whole number of plain slots of "
                                 f"{args.plain_slot_ctx} tokens (--plain-slot-ctx)")
            mib = plain_kv_mib(model, cells // args.plain_slot_ctx, args)
            slots, budget = locret_slots(model, heads, mib, args)
            plans.append((cells, mib, slots, budget))
        users = loadtest.build_users(args)
    except (ValueError, models.ModelError, planner.PlanError, eviction.HeadsError) as e:
        print(f"loadtest_side_by_side: {e}", file=sys.stderr)
        return 1
    out.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        for cells, mib, slots, budget in plans:
            if "plain" in wanted:
                n = cells // args.plain_slot_ctx
                r = serve_and_play(f"plain@{cells}", plain_command(model, n * args.plain_slot_ctx, n, args,
                                                                   serve.free_port()), users, args, out)
                r.update(memory_cells=cells, memory_mib=round(mib, 1), slots=n, kv_mib=round(mib, 1))
                results.append(r)
            if "locret" in wanted:
                r = serve_and_play(f"locret@{cells}", locret_command(model, heads, slots, budget, args,
                                                                     serve.free_port()), users, args, out)
                r.update(memory_cells=cells, memory_mib=round(mib, 1), slots=slots, budget=budget,
                         kv_mib=r["memory"]["locret_kv_mib_peak"])
                if r["kv_mib"] is not None and r["kv_mib"] > mib:
                    print(f"loadtest_side_by_side: locret@{cells} held {r['kv_mib']} MiB of KV, over M = {mib:.1f}",
                          file=sys.stderr)
                    r["over_memory"] = True
                results.append(r)
        if "unbounded" in wanted:
            n = args.users
            r = serve_and_play("plain-unbounded", plain_command(model, n * args.plain_slot_ctx, n, args,
                                                                serve.free_port()), users, args, out)
            r.update(slots=n, kv_mib=round(plain_kv_mib(model, n, args), 1))
            results.append(r)
    except RuntimeError as e:
        print(f"loadtest_side_by_side: {e}", file=sys.stderr)
        return 2
    # slots: the server's (for Locret, the plan's); busy: the most busy at once, sampled every 2 s (what it sustained);
    # RSS: the peak, and in brackets its last ten minutes' peak over its first ten's (runs of 20 minutes or more)
    lines = [loadtest.table_header().replace("| server |", "| server | slots | busy | KV MiB | RSS MiB (10 min) |", 1)
             .replace("|---|", "|---|---:|---:|---:|---:|", 1)]
    for r in results:
        row = loadtest.one_line(r["server"], r["figures"])
        m = r["memory"]
        dash = lambda x: "-" if x is None else x  # noqa: E731
        cells = (f"{r['slots']} | {dash(m.get('busy_slots_peak'))} | {r['kv_mib']} | "
                 f"{dash(m.get('rss_mib_peak'))} ({dash(m.get('rss_window_ratio'))})")
        lines.append(row.replace(f"| {r['server']} |", f"| {r['server']} | {cells} |", 1))
    table = "\n".join(lines)
    (out / "table.md").write_text(table + "\n")
    summary = {"settings": {k: v for k, v in vars(args).items()}, "heads": str(heads),
               "servers": [{**{k: v for k, v in r.items() if k != "requests"},   # the RSS timeline: <server>.json
                            "memory": {k: v for k, v in r["memory"].items() if k != "rss_mib_timeline"}}
                           for r in results]}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
