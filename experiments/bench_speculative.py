#!/usr/bin/env python3
"""Speculative decoding with a Locret budget in llama-server: generation speed and draft acceptance with and without
n-gram or draft-model speculation, on an extraction task whose answer quotes a long document.

    .venv/bin/python experiments/bench_speculative.py [--tokens 16000] [--budget 2048] [--ubatch 256] [--n-predict 256]
        [--spec-type ngram-simple|draft-simple] [--spec-args "ARGS"] [--extra "ARGS"] [--show]

Starts the patched llama-server (build/bin) twice on a loopback port, with the default model and its shipped heads,
the same budget and settings, once plain and once with `--spec-type`; sends each the same greedy request (about
--tokens tokens of the bundled harbour log, then a request to copy some of its entries word for word); prints a
markdown table: prompt tokens, generation tokens/s, drafts made and accepted, evictions of the slot, and how many
leading characters the two answers share (they may part at a near-tie: the CPU backend's logits for a batch differ
slightly from one token's, with or without a budget).
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "py"))


def get(url: str):
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.load(r)


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        return json.load(r)


def serve_one(cmd: list[str], body: dict, log: Path) -> tuple[dict, dict]:
    """Starts the server, sends `body`, returns the answer and the slot's Locret state; stops the server."""
    from locret.serve import free_port

    port = free_port()
    with open(log, "w") as out:
        server = subprocess.Popen(cmd + ["--port", str(port)], stdout=out, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 300
            while True:
                try:
                    get(url + "/health")
                    break
                except OSError:
                    if server.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit(f"bench_speculative: the server did not start; see {log}")
                    time.sleep(0.5)
            answer = post(url + "/completion", body)
            return answer, get(url + "/slots")[0].get("locret", {})
        finally:
            server.terminate()
            server.wait(timeout=60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16000, help="approximate document length in tokens")
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--ubatch", type=int, default=256)
    ap.add_argument("--n-predict", type=int, default=256)
    ap.add_argument("--spec-type", default="ngram-simple",
                    help="llama-server's --spec-type: an n-gram kind, or draft-simple (a draft model: the default "
                    "model drafting for itself unless --spec-args gives -md; its context evicts in its own cache)")
    ap.add_argument("--spec-args", default="--spec-ngram-simple-size-n 4 --spec-ngram-simple-size-m 16",
                    help="more llama-server arguments for the speculative run (default: ngram-simple's look-up of 4 "
                    "tokens drafting up to 16)")
    ap.add_argument("--extra", default="", help="more llama-server arguments for both runs")
    ap.add_argument("--show", action="store_true", help="print both answers")
    ap.add_argument("--log-dir", type=Path, default=Path("."), help="where the two server logs go")
    args = ap.parse_args()
    if args.tokens < 500 or args.budget < 1 or args.n_predict < 1:
        ap.error("--tokens must be at least 500, --budget and --n-predict at least 1")

    from locret import models

    model = str(models.resolve(models.DEFAULT_MODEL, fetch=False))
    heads = REPO / "heads" / "smollm2-135m-instruct.gguf"
    text = (REPO / "scripts" / "data" / "harbor-log.txt").read_text()
    # about 3.9 characters per token for this log with SmolLM2's tokenizer; whole lines only
    doc = text[: int(args.tokens * 3.9)]
    doc = doc[: doc.rfind("\n") + 1]
    lines = [ln for ln in doc.splitlines() if ln.startswith("Day ")]
    pick = lines[len(lines) // 3]
    first = pick.split(".")[0]
    prompt = (doc + f"\nCopy the log entry for {first} and the entries after it word for word.\n\n" + pick[:40])
    body = {"prompt": prompt, "n_predict": args.n_predict, "temperature": 0, "cache_prompt": False}
    base = [str(REPO / "build" / "bin" / "llama-server"), "-m", model, "--locret-heads", str(heads),
            "--locret-budget", str(args.budget), "-ub", str(args.ubatch), "-b", str(max(args.ubatch, 2048)),
            "-c", str(args.tokens * 2 + args.n_predict), "-np", "1"] + shlex.split(args.extra)

    rows = []
    answers = {}
    spec_args = shlex.split(args.spec_args)
    if args.spec_type == "draft-simple" and "-md" not in spec_args:
        # ngram-simple's default look-up options mean nothing to a draft model
        spec_args = ["-md", model, "--spec-draft-n-max", "8"] + [a for a in spec_args if a.startswith("--locret-draft")]
    for name, extra in (("plain", []), (args.spec_type, ["--spec-type", args.spec_type] + spec_args)):
        t0 = time.monotonic()
        answer, slot = serve_one(base + extra, body, args.log_dir / f"bench_speculative-{name}.log")
        answers[name] = answer["content"]
        t = answer["timings"]
        drafted, accepted = t.get("draft_n", 0), t.get("draft_n_accepted", 0)
        rows.append((name, answer["tokens_evaluated"], t["predicted_per_second"], answer["tokens_predicted"],
                     drafted, accepted, slot.get("n_evictions", 0), time.monotonic() - t0))
        print(f"{name}: {answer['tokens_predicted']} tokens at {t['predicted_per_second']:.1f} tok/s", flush=True)

    plain, spec = answers["plain"], answers[args.spec_type]
    if args.show:
        print(f"\n--- plain:\n{plain}\n--- {args.spec_type}:\n{spec}")
    same = next((i for i, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
    print(f"\nbudget {args.budget}, ubatch {args.ubatch}, greedy, {args.n_predict} tokens asked\n")
    print("| run | prompt tokens | generated | tok/s | drafted | accepted | acceptance | evictions | wall s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, n_prompt, tps, n_gen, drafted, accepted, ev, wall in rows:
        acc = f"{accepted / drafted:.2f}" if drafted else "-"
        print(f"| {name} | {n_prompt} | {n_gen} | {tps:.1f} | {drafted} | {accepted} | {acc} | {ev} | {wall:.0f} |")
    print(f"\nspeed-up {rows[1][2] / rows[0][2]:.2f}x; the answers share their first {same} of "
          f"{max(len(plain), len(spec))} characters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
