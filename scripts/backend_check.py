#!/usr/bin/env python3
"""Eviction on another backend against the CPU: the same kept units and the same logits, configuration by configuration.

    python3 scripts/backend_check.py --model M.gguf --heads H.gguf [--gpu-layers 99] [--tokens 6000] [--budget 1024]

Feeds one random token sequence (seed 0, several evictions; its last ubatch + 8 tokens one at a time, as generation
runs, so that the heads' graph over the stacked layers and a generation-time eviction are compared too) through
locret.Llama in one child process per configuration, then reads the last token's logits and every (layer, KV head)'s kept positions (locret.eviction
.retained) and compares:
  - selection on the device against selection on the host (LOCRET_DEBUG_SELECT), both with --gpu-layers: the kept
    sets must be identical and the logits equal within 1e-3 (the same scores, one selection rule); also with the
    pyramid budget schedule (each layer its own count, around its masked cells);
  - for V caches F16, q8_0 and F32, with and without flash attention (a quantized V needs it: llama.cpp refuses the
    other), with --gpu-layers against the CPU (no layers offloaded) with the same settings: logits with a cosine
    similarity of at least 0.999, and kept sets agreeing on at least --min-kept-share of the units (default 0.98 for a
    real model: the scores are computed by two backends, near-ties may fall either way; 0 for a random-weight
    stand-in, whose nearly flat scores make most units near-ties: the share is then reported only);
  each with --locret-positions keep and compact where it changes the compaction (F16 rows);
  - the compaction stacked over the layers (the default) against the one built layer by layer
    (LOCRET_DEBUG_COMPACT_PER_LAYER), both with --gpu-layers: kept sets identical and logits equal within 1e-3 (the
    same rows moved by other ops), with positions keep and compact and a q8_0 cache.
Prints a markdown table and exits 1 when a check fails. With --gpu-layers 0 (a CPU build) both sides run on the CPU:
a dry run of the script. Needs the patched build (LOCRET_BUILD_DIR) and llama-cpp-python's Python package.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "py"))
if "--child" in sys.argv:
    # the patched libllama (and its CUDA and OpenMP libraries) loads before numpy's: in the other order the model load
    # crashed on an H200 machine
    import locret  # noqa: F401
    import llama_cpp  # noqa: F401

import numpy as np


def child(cfg: dict, out: Path) -> None:
    """One configuration: run the sequence, save logits and kept sets."""
    if cfg.get("select"):
        os.environ["LOCRET_DEBUG_SELECT"] = cfg["select"]
    if cfg.get("per_layer"):
        os.environ["LOCRET_DEBUG_COMPACT_PER_LAYER"] = "1"
    import locret
    import llama_cpp
    from locret import eviction

    llm = locret.Llama(cfg["model"], locret_heads=cfg["heads"], locret_budget=cfg["budget"],
                       locret_positions=cfg["positions"], locret_budget_schedule=cfg.get("schedule"), n_ctx=cfg["tokens"] + 64, n_batch=cfg["ubatch"],
                       n_ubatch=cfg["ubatch"], n_gpu_layers=cfg["ngl"], type_v=getattr(llama_cpp, f"GGML_TYPE_{cfg['v'].upper()}"),
                       flash_attn=cfg["fa"], verbose=bool(os.environ.get("LOCRET_BACKEND_CHECK_VERBOSE")))
    n_vocab = llm.n_vocab()
    tokens = np.random.default_rng(0).integers(3, n_vocab, cfg["tokens"]).tolist()
    # the end one token at a time, as generation runs: those ubatches are scored over the stacked heads, and at least
    # one of them evicts (one eviction per ubatch of generated tokens)
    n_single = min(cfg["ubatch"] + 8, len(tokens) // 2)
    llm.eval(tokens[:-n_single])
    for t in tokens[-n_single:]:
        llm.eval([t])
    ctx = llm._ctx.ctx
    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).copy()
    n_layer = llama_cpp.llama_model_n_layer(llm._model.model)
    n_head_kv = llama_cpp.llama_model_n_head_kv(llm._model.model)
    kept = [[eviction.retained(ctx, il, h) for h in range(n_head_kv)] for il in range(n_layer)]
    np.savez(out, logits=logits, **{f"kept_{il}_{h}": kept[il][h] for il in range(n_layer) for h in range(n_head_kv)})


def run(cfg: dict, folder: Path) -> dict | str:
    out = folder / f"{cfg['name']}.npz"
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(cfg), "--out", str(out)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return f"failed: {(proc.stderr.strip().splitlines() or ['(no output)'])[-1][:160]}"
    data = np.load(out)
    return {k: data[k] for k in data.files}


def compare(a: dict, b: dict) -> tuple[float, float, float]:
    """(share of kept units in both, cosine of the logits, max abs difference of the logits)."""
    both = total = 0
    for k in a:
        if k.startswith("kept_"):
            x, y = set(a[k].tolist()), set(b[k].tolist())
            both += len(x & y)
            total += max(len(x), len(y))
    la, lb = a["logits"].astype(np.float64), b["logits"].astype(np.float64)
    cos = float(la @ lb / (np.linalg.norm(la) * np.linalg.norm(lb)))
    return both / max(total, 1), cos, float(np.abs(la - lb).max())


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=False)
    ap.add_argument("--heads")
    ap.add_argument("--gpu-layers", type=int, default=99)
    ap.add_argument("--tokens", type=int, default=6000)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--checks", default="selection,cache,compaction",
                    help="which comparisons: selection (device against host), cache (V types and flash attention, "
                         "GPU against CPU), compaction (stacked against per layer, on the GPU); default all")
    ap.add_argument("--min-kept-share", type=float, default=0.98,
                    help="GPU against CPU: the least share of kept units both hold (default 0.98; 0 for a stand-in)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(json.loads(args.child), args.out)
        return 0
    if not args.model or not args.heads:
        ap.error("--model and --heads are required")
    base = dict(model=args.model, heads=args.heads, budget=args.budget, ubatch=args.ubatch, tokens=args.tokens)
    folder = Path(tempfile.mkdtemp(prefix="backend-check-"))
    rows, ok = [], True

    def cfg(name, **kw):
        return {**base, "name": name, "positions": "compact", "v": "f16", "fa": True, "ngl": args.gpu_layers,
                "select": None, "per_layer": False, **kw}

    wanted = set(args.checks.split(","))
    if not wanted or wanted - {"selection", "cache", "compaction"}:
        ap.error(f"--checks takes selection, cache and compaction, comma-separated; got {args.checks!r}")
    checks = []  # (label, config a, config b, kind)
    for pos in (("keep", "compact", "inplace") if "selection" in wanted else ()):
        checks.append((f"device selection = host selection, positions {pos}",
                       cfg(f"dev-{pos}", positions=pos, select="graph"), cfg(f"host-{pos}", positions=pos,
                                                                              select="host"), "same"))
    if "selection" in wanted:
        checks.append(("device selection = host selection, pyramid schedule, positions compact",
                       cfg("dev-pyramid", schedule="pyramid", select="graph"),
                       cfg("host-pyramid", schedule="pyramid", select="host"), "same"))
    for v in (("f16", "q8_0", "f32") if "cache" in wanted else ()):
        for fa in (True, False):
            if v == "q8_0" and not fa:
                rows.append(f"| V {v}, flash attention off | - | - | - | "
                            "refused by llama.cpp (a quantized V needs it) |")
                continue
            for pos in (("keep", "compact", "inplace") if v == "f16" else ("keep",)):
                name = f"{v}-fa{int(fa)}-{pos}"
                checks.append((f"V {v}, flash attention {'on' if fa else 'off'}, positions {pos}: GPU against CPU",
                               cfg(f"gpu-{name}", v=v, fa=fa, positions=pos),
                               cfg(f"cpu-{name}", v=v, fa=fa, positions=pos, ngl=0), "close"))
    for pos, kv in ((("keep", "f16"), ("compact", "f16"), ("keep", "q8_0"), ("inplace", "f16"), ("inplace", "q8_0"))
                    if "compaction" in wanted else ()):
        checks.append((f"compaction stacked = per layer, V {kv}, positions {pos}",
                       cfg(f"stacked-{pos}-{kv}", positions=pos, v=kv),
                       cfg(f"per-layer-{pos}-{kv}", positions=pos, v=kv, per_layer=True), "same"))
    try:
        from tqdm import tqdm
    except ImportError:
        def tqdm(x, **kw):
            return x
    for label, a_cfg, b_cfg, kind in tqdm(checks, desc="backend check", file=sys.stderr):
        a, b = run(a_cfg, folder), run(b_cfg, folder)
        if isinstance(a, str) or isinstance(b, str):
            rows.append(f"| {label} | - | - | - | FAILED: {a if isinstance(a, str) else b} |")
            ok = False
            continue
        share, cos, diff = compare(a, b)
        passed = (share == 1.0 and diff <= 1e-3) if kind == "same" else (share >= args.min_kept_share and cos >= 0.999)
        ok &= passed
        rows.append(f"| {label} | {share:.4f} | {cos:.6f} | {diff:.2e} | {'ok' if passed else 'FAILED'} |")
    print(f"{Path(args.model).name}, heads {Path(args.heads).name}, b {args.budget}, ub {args.ubatch}, "
          f"{args.tokens} random tokens, --gpu-layers {args.gpu_layers} against 0\n")
    print("| check | kept units in both | logits cosine | logits max abs diff | |\n|---|---:|---:|---:|---|")
    print("\n".join(rows))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
