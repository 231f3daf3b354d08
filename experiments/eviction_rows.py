#!/usr/bin/env python3
"""What evictions cost in rows and host round trips, over one prefill (issue 44's counts).

    .venv/bin/python experiments/eviction_rows.py [--model M.gguf] [--heads H.gguf] [--budget 1024] [--ubatch 512]
        [--chars 20000] [--text FILE] [--policy heads] [--positions compact|inplace|keep|keep:N] [--kv-type f16|q8_0]
        [--threads 1]

Reads the first --chars characters of --text (default: the bundled harbour log) in one locret.Llama prefill and
prints one markdown row: evictions, rows kept / moved / re-rotated (a row is one layer, KV head and unit),
moved / kept, host syncs per eviction, the compaction's time per compaction, and the eviction's share of the prefill
time (selection + read-back + compaction, from locret_stats). LOCRET_DEBUG_CONVERT_ROWS=1 in the environment moves
every row through F32 (the path before rows were copied as they are), for a comparison.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "py"))


def main(argv: list[str]) -> int:
    from locret import devices, models  # first: it points llama_cpp at the patched library
    from locret.llama import Llama
    import llama_cpp

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF model (default: the embedded default model)")
    ap.add_argument("--heads", help="heads file (default: the model's shipped plain heads)")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--chars", type=int, default=20000)
    ap.add_argument("--text", type=Path, default=REPO / "scripts" / "data" / "harbor-log.txt")
    ap.add_argument("--policy", default="heads")
    ap.add_argument("--positions", default="compact", help="where kept units sit: compact (default), inplace, keep, keep:N")
    ap.add_argument("--kv-type", choices=devices.KV_TYPES, default="f16",
                    help="K and V cache type (other than f16 turns flash attention on, as a quantized V requires)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    kv_type = getattr(llama_cpp, f"GGML_TYPE_{args.kv_type.upper()}")  # as locret eval names them

    model = args.model or str(models.resolve("smollm2-135m"))
    heads = args.heads or (str(models.shipped_heads("smollm2-135m")) if args.policy == "heads" else None)
    if not args.text.is_file():
        ap.error(f"--text {args.text}: no such file")
    text = args.text.read_text(errors="replace")[:args.chars]
    llm = Llama(model, n_ctx=1 << 20, n_batch=args.ubatch, n_ubatch=args.ubatch, locret_heads=heads,
                locret_budget=args.budget, locret_policy=args.policy, locret_query="off", n_threads=args.threads,
                locret_positions=args.positions, type_k=kv_type, type_v=kv_type,
                flash_attn=args.kv_type != "f16",
                n_threads_batch=args.threads, verbose=False)
    tokens = llm.tokenize(text.encode(), add_bos=True)
    t0 = time.perf_counter()
    llm.eval(tokens)
    seconds = time.perf_counter() - t0
    st = llm.locret_stats()
    n_ev = max(1, st["n_evictions"])
    eviction_s = (st["t_select_us"] + st["t_readback_us"] + st["t_compact_us"]) / 1e6
    print("| tokens | b | B | policy | positions | evictions | rows kept | rows moved | rows re-rotated | moved / kept | "
          "host syncs per eviction | compaction (ms each) | eviction share of prefill |")
    print("|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    positions = args.positions if st["n_repositions"] == 0 else f"{args.positions} ({st['n_repositions']} compacted)"
    if args.kv_type != "f16":
        positions += f", {args.kv_type} cache"
    compact_ms = st["t_compact_us"] / 1e3 / max(1, st["n_compactions"])
    print(f"| {len(tokens)} | {args.budget} | {args.ubatch} | {args.policy} | {positions} | {st['n_evictions']} | "
          f"{st['n_rows_kept']} | {st['n_rows_moved']} | {st['n_rows_rotated']} | "
          f"{st['n_rows_moved'] / max(1, st['n_rows_kept']):.3f} | {st['n_host_syncs'] / n_ev:.1f} | {compact_ms:.1f} | "
          f"{100 * eviction_s / seconds:.1f} % ({eviction_s:.2f} s of {seconds:.2f} s) |")
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
