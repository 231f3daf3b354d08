#!/usr/bin/env python3
"""Locret over llama.cpp's RPC backend: parity with the local CPU run, and what RPC costs.

    .venv/bin/python experiments/rpc_check.py [--tokens 1200] [--budget 256] [--ubatch 64] [--servers 2] [--json FILE]

Starts `--servers` local ggml-rpc-server processes (127.0.0.1, free ports, stopped at the end whatever happens) and
runs the default model with the shipped heads twice, first on the local CPU, then with every layer on the RPC servers
(n_gpu_layers 99: the layers and their KV caches are split across them, so eviction's graphs run behind RPC). The
prompt (the main job's document) is decoded in ubatch-sized calls past the budget, with several evictions; after every
call the kept set of every layer and KV head must be the same in both runs, and so must the greedy continuation. Then:
a Locret-Q run (a question pinned) compared the same way, and the RPC context's state saved and loaded into a fresh
local context, whose next logits must equal the RPC context's.

Prints one markdown table: prefill speed local and over RPC, evictions, host round trips per eviction (n_host_syncs:
over RPC each is a network round trip), eviction time per eviction. Exits 1 when a parity check fails.
The local run goes first: once RPC devices are registered, every later model load in this process sees them.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "py"))


def load_prompt(n_tokens: int, llm) -> list[int]:
    text = (REPO / "scripts" / "data" / "harbor-log.txt").read_text()
    tokens = llm.tokenize(text.encode(), add_bos=True)
    if len(tokens) < n_tokens:
        raise SystemExit(f"rpc_check: error: the document has {len(tokens)} tokens, fewer than --tokens {n_tokens}")
    return tokens[:n_tokens]


def kept_sets(llm) -> list:
    """The logical positions every (layer, KV head) holds, layer by layer."""
    import llama_cpp

    n_layer = llama_cpp.llama_model_n_layer(llm._model.model)
    n_head_kv = llama_cpp.llama_model_n_head_kv(llm._model.model)
    return [[llm.locret_retained(il, h).tolist() for h in range(n_head_kv)] for il in range(n_layer)]


def run(llm, tokens: list[int], ubatch: int, generate: int, pin: int = 0) -> dict:
    """Decode `tokens` in ubatch-sized calls (logits for the last), the kept sets after each call, the greedy
    continuation; with `pin`, the first `pin` positions are Locret-Q's pinned question."""
    import llama_cpp

    ctx = llm._ctx.ctx
    n_vocab = llm.n_vocab()
    if pin:
        llm.locret_pin_query(pin)
    kept, n_past = [], 0
    t0 = time.perf_counter()

    def decode(part: list[int], logits: bool) -> np.ndarray | None:
        nonlocal n_past
        llm._batch.set_batch(batch=part, n_past=n_past, logits_all=False)
        llm._batch.batch.logits[len(part) - 1] = logits
        if llama_cpp.llama_decode(ctx, llm._batch.batch) != 0:
            raise RuntimeError(f"llama_decode failed at position {n_past}")
        n_past += len(part)
        if not logits:
            return None
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).copy()

    logits = None
    for i in range(0, len(tokens), ubatch):
        last = i + ubatch >= len(tokens)
        logits = decode(tokens[i:i + ubatch], last)
        kept.append(kept_sets(llm))
    prefill_s = time.perf_counter() - t0
    stats = llm.locret_stats()
    made, first_logits = [], logits
    for _ in range(generate):
        made.append(int(np.argmax(logits)))
        logits = decode([made[-1]], True)
    return {"kept": kept, "tokens": made, "logits": first_logits, "prefill_s": prefill_s, "stats": stats,
            "n_past": n_past, "decode": decode}


def compare(name: str, local: dict, remote: dict, failures: list[str]) -> None:
    for call, (a, b) in enumerate(zip(local["kept"], remote["kept"])):
        if a != b:
            layer = next(il for il in range(len(a)) if a[il] != b[il])
            failures.append(f"{name}: kept sets differ after call {call} (layer {layer})")
            break
    if local["tokens"] != remote["tokens"]:
        failures.append(f"{name}: greedy tokens differ: local {local['tokens']} rpc {remote['tokens']}")
    if local["stats"]["n_evictions"] != remote["stats"]["n_evictions"]:
        failures.append(f"{name}: evictions differ: {local['stats']['n_evictions']} vs {remote['stats']['n_evictions']}")


def per_eviction_ms(stats: dict) -> float:
    spent = stats["t_select_us"] + stats["t_compact_us"] + stats["t_readback_us"]
    return spent / 1e3 / max(stats["n_evictions"], 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1200, help="prompt tokens (default 1200)")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--ubatch", type=int, default=64)
    ap.add_argument("--generate", type=int, default=16)
    ap.add_argument("--servers", type=int, default=2, help="rpc-server processes (default 2)")
    ap.add_argument("--threads", type=int, default=1, help="threads of each rpc-server and of the local run")
    ap.add_argument("--json", type=Path, help="write the figures and failures there too")
    args = ap.parse_args()
    if min(args.tokens, args.budget, args.ubatch, args.servers, args.threads) < 1 or args.generate < 0:
        print("rpc_check: error: --tokens, --budget, --ubatch, --servers and --threads must be positive", file=sys.stderr)
        return 2
    if args.tokens <= args.budget + args.ubatch:
        print("rpc_check: error: --tokens must pass the budget + ubatch, or nothing is evicted", file=sys.stderr)
        return 2

    import llama_cpp

    from locret import models, rpc
    from locret.llama import Llama

    model = str(models.resolve(models.DEFAULT_MODEL))
    heads = str(models.shipped_heads(models.DEFAULT_MODEL))

    def make(**kw) -> Llama:
        return Llama(model, n_ctx=args.tokens + args.generate + 64, n_batch=args.ubatch, n_ubatch=args.ubatch,
                     locret_budget=args.budget, locret_heads=heads, locret_query="", flash_attn=True,
                     n_threads=args.threads, n_threads_batch=args.threads, verbose=False, **kw)

    failures: list[str] = []
    local = make()
    tokens = load_prompt(args.tokens, local)
    question = local.tokenize(b"Which ship docked at the harbor last?", add_bos=True)
    pinned_tokens = question + tokens[1:]
    base = run(local, tokens, args.ubatch, args.generate)
    local.reset()
    local.close()
    local_q = make()
    base_q = run(local_q, pinned_tokens, args.ubatch, args.generate, pin=len(question))
    local_q.close()

    with tempfile.TemporaryDirectory() as tmp, rpc.RpcServers(args.servers, threads=args.threads,
                                                              log_dir=Path(tmp)) as servers:
        remote_llm = make(rpc_servers=servers.servers, n_gpu_layers=99)
        remote = run(remote_llm, tokens, args.ubatch, args.generate)
        compare("plain", base, remote, failures)
        # the RPC context's state, saved and loaded into a fresh context on the same servers: the same kept sets,
        # and the same logits for the next token
        state = Path(tmp) / "rpc.state"
        if not llama_cpp.llama_state_save_file(remote_llm._ctx.ctx, str(state).encode(), None, 0):
            failures.append("state: the RPC context could not be saved")
        saved_kept, saved_evictions = kept_sets(remote_llm), remote_llm.locret_stats()["n_evictions"]
        next_token = tokens[-1]
        want = remote["decode"]([next_token], True)
        remote_llm.close()
        loaded = make(rpc_servers=servers.servers, n_gpu_layers=99)
        n_loaded = ctypes.c_size_t(0)
        if not llama_cpp.llama_state_load_file(loaded._ctx.ctx, str(state).encode(), None, 0, ctypes.byref(n_loaded)):
            failures.append("state: the saved state could not be loaded into a fresh RPC context")
        else:
            if (kept_sets(loaded), loaded.locret_stats()["n_evictions"]) != (saved_kept, saved_evictions):
                failures.append("state: the loaded context's kept sets or eviction count differ")
            loaded._batch.set_batch(batch=[next_token], n_past=remote["n_past"], logits_all=False)
            loaded._batch.batch.logits[0] = True
            if llama_cpp.llama_decode(loaded._ctx.ctx, loaded._batch.batch) != 0:
                failures.append("state: the loaded context could not decode")
            else:
                got = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(loaded._ctx.ctx, -1),
                                            shape=(loaded.n_vocab(),))
                if not np.array_equal(got, want):
                    failures.append(f"state: next logits differ after the round trip (max |diff| "
                                    f"{float(np.max(np.abs(got - want))):.3g})")
        loaded.close()
        remote_q_llm = make(rpc_servers=servers.servers, n_gpu_layers=99)
        remote_q = run(remote_q_llm, pinned_tokens, args.ubatch, args.generate, pin=len(question))
        remote_q_llm.close()
        compare("locret-q", base_q, remote_q, failures)
        if not servers.alive():
            failures.append("an rpc-server exited during the run")

    rows = [("local CPU", base), ("RPC, {} servers".format(args.servers), remote)]
    print(f"\n{args.tokens} prompt tokens, b = {args.budget}, ub = {args.ubatch}, {args.threads} thread(s) each\n")
    print("| run | prefill tok/s | evictions | host syncs / eviction | eviction ms / eviction |\n|---|---:|---:|---:|---:|")
    figures = {}
    for name, r in rows:
        st = r["stats"]
        tps = args.tokens / r["prefill_s"]
        syncs = st["n_host_syncs"] / max(st["n_evictions"], 1)
        print(f"| {name} | {tps:.1f} | {st['n_evictions']} | {syncs:.1f} | {per_eviction_ms(st):.2f} |")
        figures[name] = {"prefill_tok_s": tps, "evictions": st["n_evictions"], "host_syncs_per_eviction": syncs,
                         "eviction_ms": per_eviction_ms(st)}
    print(f"\nRPC / local prefill speed: {figures[rows[1][0]]['prefill_tok_s'] / figures['local CPU']['prefill_tok_s']:.2f}")
    checked = len(base["kept"]) + len(base_q["kept"])
    print(f"parity: {checked} kept-set snapshots and {2 * args.generate} greedy tokens compared, state round trip: "
          + ("all equal" if not failures else "; ".join(failures)))
    if args.json:
        args.json.write_text(json.dumps({"figures": figures, "failures": failures, "snapshots": checked,
                                         "tokens_local": base["tokens"], "tokens_rpc": remote["tokens"],
                                         "evictions": remote["stats"]["n_evictions"]}, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
