#!/usr/bin/env python3
"""Soak: a chat that never ends, streamed through an evicting context, with its memory, speed and answers watched.

    .venv/bin/python scripts/soak.py [--tokens 10000000] [--budget 2048] [--ubatch 512] [--max-minutes 60]
        [--out results/soak] [--resume] [--standin]

User turns of generated text (a log of deliveries, each with a code, over a filler family from
locret.tasks.haystacks), in the model's chat template, go through `locret.Llama`'s context chunk by chunk
(llama_decode on the client's batch, so that no Python-side list grows with the input); after every turn the model
answers a few tokens (greedy), whose logits must be finite, and the turn is closed.
Every 100,000 tokens (--check-every) the process's resident and peak memory and the throughput of the last stretch are recorded in
OUT/soak.json. At the end, a question about the last turn's code must be answered right.

--max-minutes stops at the next turn after that time and saves the context (OUT/state-TURN.bin) and the progress;
--resume loads both and goes on, so a 10M-token soak can run in parts. Both are also saved at every checkpoint, so a
run that is killed (a machine restarted under it) resumes from its last checkpoint. The figures the targets read:
  - peak RSS at the end <= 1.05 x peak RSS at 100K tokens,
  - throughput of the last million >= 0.9 x the second million (when the run got that far),
  - no non-finite logits, the final answer right.
  - the engine's eviction count and cells used equal, at every checkpoint, what Algorithm 1's placement rule
    predicts for the same calls (a count-only model below, independent of the engine),
  - state checkpoints of the same cells used have the same size (a state does not grow with the stream).
Exits 1 when a target reached is missed, 0 otherwise (also when stopped by --max-minutes, with the figures so far).

--standin runs the engine checks on the small random-weight stand-in of the default model (locret.shapes'
smollm2-soak: its architecture, vocabulary and 8K window, 4 layers of width 192, random heads), so that 10M tokens
pass in about an hour on a 2-core CPU; its resident memory must then stay within 2 % of the first checkpoint's, and
the final answer (random weights) is recorded but not judged. The real model's soak keeps the answer check.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import random
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "py"))

# libllama is loaded before numpy: on the lent H200's Python image, a CUDA build's model load segfaulted whenever
# numpy had been imported first (any order with libllama first ran; see docs/experiments/results-history.md, "Soak with
# the real model")
import locret  # noqa: E402,F401  (points llama_cpp at our library)
import llama_cpp  # noqa: E402,F401
import numpy as np  # noqa: E402

CHECK_EVERY = 100_000
FAMILIES = ("prose", "code", "legal", "logs")
STANDIN_SHAPE, STANDIN_WEIGHTS, STANDIN_D_R = "smollm2-soak", "q4_1", 64


class EvictionCounts:
    """Algorithm 1's placement rule, counts only (which units are kept does not change how many are): the engine's
    ubatches of a decode call (a prompt end's local tail is its own ubatch), and before each ubatch an eviction to b
    units when the previous one gave no logits and more than b are held (chunked prefill), or to min(b, held) when the
    ubatch would not fit the b + B cells. Written from the paper's rule, not from the engine's code, so that the soak
    checks the engine against it."""

    def __init__(self, budget: int, ubatch: int, local: int, n_used: int = 0, prev_output: bool = True,
                 evictions: int = 0):
        self.budget, self.ubatch, self.local = budget, ubatch, local
        self.n_used, self.prev_output, self.evictions = n_used, prev_output, evictions

    def decode(self, n_tokens: int, output_last: bool) -> None:
        remaining = n_tokens
        while remaining:
            take = min(self.ubatch, remaining)
            if output_last and self.local and remaining > self.local:
                take = min(take, remaining - self.local)
            remaining -= take
            self.place(take, output_last and remaining == 0)

    def place(self, n: int, is_output: bool) -> None:
        if not self.prev_output and self.n_used > self.budget:
            keep = self.budget
        elif self.n_used + n > self.budget + self.ubatch:
            keep = min(self.budget, self.n_used)
        else:
            keep = self.n_used
        self.evictions += keep < self.n_used
        self.n_used = keep + n
        self.prev_output = is_output

    def state(self) -> dict:
        return {"n_used": self.n_used, "prev_output": self.prev_output, "evictions": self.evictions}


def memory_mib() -> tuple[float, float]:
    """(resident, peak resident) of this process, MiB"""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value
    rss = float(fields["VmRSS"].split()[0]) / 1024 if "VmRSS" in fields else float("nan")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return rss, peak


def turn_text(index: int) -> tuple[str, str]:
    """Turn `index` of the endless chat and the code it states: the same text for the same index on every run."""
    from locret.tasks import haystacks

    rng = random.Random(index)
    code = f"{rng.randrange(10)}-{rng.randrange(10)}-{rng.randrange(10)}-{rng.randrange(10)}"
    family = FAMILIES[index % len(FAMILIES)]
    parts, size = [], 0
    for unit in haystacks.units(family, rng):
        parts.append(unit)
        size += len(unit) + 1
        if size >= 1200:
            break
    filler = " ".join(parts)
    text = (f"\n\nTurn {index}. {filler}\nDelivery note for turn {index}: the delivery number for crate {index} is {code}. "
            f"Remember it.\n")
    return text, code


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model name or GGUF (default: the default model)")
    ap.add_argument("--tokens", type=int, default=10_000_000)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--policy", default="heads", help="eviction policy (default heads, the shipped heads)")
    ap.add_argument("--heads", default=None, help="heads GGUF (default: the shipped heads for the model)")
    ap.add_argument("--pool", type=int, default=15,
                    help="score pooling window (odd; 0: none, the paper's Locret), default 15 as in the main job: whole "
                         "spans such as a delivery number stay together (without it a 20K-token soak answered 9-3-3-8 "
                         "for 9-3-3-3)")
    ap.add_argument("--generate", type=int, default=8, help="tokens generated after every turn (default 8)")
    ap.add_argument("--positions", default=None,
                    help="--locret-positions: compact, inplace, keep or keep:N (default: the engine's, compact)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gpu-layers", type=int, default=0,
                    help="layers on the GPU (a CUDA build; -1: all): on a GPU the 10M tokens take minutes, not hours")
    ap.add_argument("--max-minutes", type=float, default=None)
    ap.add_argument("--out", default=str(REPO / "results" / "soak"))
    ap.add_argument("--resume", action="store_true", help="go on from OUT/soak.json and the state file it names")
    ap.add_argument("--check-every", type=int, default=CHECK_EVERY, help="tokens between checkpoints (default 100000)")
    ap.add_argument("--standin", action="store_true",
                    help=f"the engine checks on the small random-weight stand-in ({STANDIN_SHAPE}, random heads): "
                         "10M tokens in about an hour; the answer is not judged")
    args = ap.parse_args()
    if args.tokens < 1 or args.budget < 1 or args.ubatch < 1 or args.generate < 0 or args.check_every < 1:
        print("soak: error: --tokens, --budget and --ubatch must be positive, --generate at least 0", file=sys.stderr)
        return 2

    from tqdm import tqdm

    from locret import models
    from locret.heads import HeadsError
    from locret.llama import Llama

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    progress_path = out / "soak.json"
    heads = args.heads
    if args.standin:
        if args.model:
            print("soak: error: --standin is its own model: give --model or --standin, not both", file=sys.stderr)
            return 2
        from locret import shapes
        model_path, standin_heads = shapes.make_shape_models(STANDIN_SHAPE, weight_type=STANDIN_WEIGHTS,
                                                             d_r=STANDIN_D_R, progress=False)
        heads = heads or (str(standin_heads) if args.policy == "heads" else None)
    else:
        model_path = models.resolve(args.model or models.DEFAULT_MODEL)
    if heads is None and args.policy == "heads" and not args.standin:
        shipped = models.shipped_heads(args.model or models.DEFAULT_MODEL)
        heads = str(shipped) if shipped else None
    settings = dict(model=str(model_path), budget=args.budget, ubatch=args.ubatch, policy=args.policy, heads=heads,
                    generate=args.generate)
    if args.gpu_layers:
        settings["gpu_layers"] = args.gpu_layers
    if args.pool:
        settings["pool"] = args.pool
    if args.positions:
        settings["positions"] = args.positions
    if args.standin:
        settings["standin"] = STANDIN_SHAPE

    progress = {"settings": settings, "tokens": 0, "n_past": 0, "turn": 0, "checks": [], "non_finite": 0,
                "seconds": 0.0}
    if not args.resume and progress_path.is_file() and json.loads(progress_path.read_text()).get("state"):
        print(f"soak: error: {out} holds a stopped soak: go on with --resume, or choose another --out", file=sys.stderr)
        return 2
    if args.resume:
        progress = json.loads(progress_path.read_text()) if progress_path.is_file() else {}
        if not progress.get("state") or not (out / progress["state"]).is_file():
            print(f"soak: error: nothing to resume in {out} (no soak.json naming a saved state)", file=sys.stderr)
            return 2
        if progress["settings"] != settings:
            print(f"soak: error: {out} was run with other settings: {progress['settings']}", file=sys.stderr)
            return 2
    # each start or resume is a process of its own: its checkpoints' memory is compared with its own only
    progress["part"] = progress.get("part", 0) + 1

    try:
        llm = Llama(str(model_path), n_ctx=1 << 25, n_batch=args.ubatch, n_ubatch=args.ubatch,
                    locret_budget=args.budget, locret_policy=args.policy, locret_heads=heads,
                    locret_pool=args.pool or None, locret_positions=args.positions, n_threads=args.threads,
                    n_threads_batch=args.threads, n_gpu_layers=args.gpu_layers, verbose=False)
    except (HeadsError, ValueError) as e:
        print(f"soak: error: {e}", file=sys.stderr)
        return 2
    ctx = llm._ctx.ctx
    n_vocab = llm.n_vocab()
    resolved = llm.locret_stats()
    counts = EvictionCounts(resolved["budget"], resolved["n_ubatch"], resolved["local"], **progress.get("counts", {}))
    if args.resume:
        n_loaded = ctypes.c_size_t(0)
        state_path = out / progress["state"]
        for orphan in out.glob("state-*.bin"):  # written by a run killed before its soak.json named it
            if orphan.name != state_path.name:
                orphan.unlink()
        if not llama_cpp.llama_state_load_file(ctx, str(state_path).encode(), None, 0, ctypes.byref(n_loaded)):
            print(f"soak: error: {state_path} could not be loaded", file=sys.stderr)
            return 2

    def decode(tokens: list[int], output_last: bool) -> np.ndarray | None:
        for i in range(0, len(tokens), args.ubatch):
            part = tokens[i:i + args.ubatch]
            last = output_last and i + args.ubatch >= len(tokens)
            llm._batch.set_batch(batch=part, n_past=progress["n_past"], logits_all=False)
            llm._batch.batch.logits[len(part) - 1] = last
            rc = llama_cpp.llama_decode(ctx, llm._batch.batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc} at position {progress['n_past']}")
            progress["n_past"] += len(part)
            counts.decode(len(part), last)
        if not output_last:
            return None
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).copy()

    template = llama_cpp.llama_model_chat_template(llm._model.model, None)

    def user_turn(text: str) -> str:
        """a user message and the assistant's opening, in the model's chat template (plain text without one)"""
        if not template:
            return f"\n\nUser: {text}\nAssistant:"
        msg = (llama_cpp.llama_chat_message * 1)(llama_cpp.llama_chat_message(role=b"user", content=text.encode()))
        buf = ctypes.create_string_buffer(len(text) * 2 + 1024)
        n = llama_cpp.llama_chat_apply_template(template, msg, 1, True, buf, len(buf))
        if n < 0 or n > len(buf):
            raise RuntimeError("the model's chat template could not be applied")
        return buf.raw[:n].decode(errors="replace")

    end_of_turn = llm.token_eos()

    def greedy(logits: np.ndarray, n: int) -> list[int]:
        made = []
        for _ in range(n):
            if not np.isfinite(logits).all():
                progress["non_finite"] += 1
            token = int(np.argmax(logits))
            made.append(token)
            logits = decode([token], True)
            if token == end_of_turn:
                break
        return made

    t_start = time.time()
    seconds_before = progress["seconds"]

    def save() -> bool:
        """the context, then the progress that names it: soak.json is replaced in one rename, so a kill at any moment
        leaves a soak.json whose state file is complete (the previous one is removed only after)"""
        progress["seconds"] = seconds_before + time.time() - t_start
        previous = progress.get("state")
        name = f"state-{progress['turn']:09d}.bin"
        if not llama_cpp.llama_state_save_file(ctx, str(out / name).encode(), None, 0):
            print("soak: error: the context could not be saved", file=sys.stderr)
            return False
        progress["state"] = name
        progress["counts"] = counts.state()
        if progress["checks"] and progress["checks"][-1]["tokens"] == progress["tokens"]:
            progress["checks"][-1]["state_bytes"] = (out / name).stat().st_size
        part = progress_path.with_suffix(".part")
        part.write_text(json.dumps(progress, indent=1))
        part.replace(progress_path)
        if previous and previous != name:
            (out / previous).unlink(missing_ok=True)
        return True

    stretch_t, stretch_tokens = time.time(), 0
    every = args.check_every
    next_check = (progress["tokens"] // every + 1) * every
    bar = tqdm(total=args.tokens, initial=progress["tokens"], unit="tok", unit_scale=True, desc="soak", mininterval=5)
    last_code = None
    stopped = False
    while progress["tokens"] < args.tokens:
        text, last_code = turn_text(progress["turn"])
        tokens = llm.tokenize(user_turn(text).encode(), add_bos=progress["n_past"] == 0, special=True)
        logits = decode(tokens, True)
        made = greedy(logits, args.generate)
        if not made or made[-1] != end_of_turn:
            close = llm.tokenize(b"<|im_end|>\n" if template and b"<|im_end|>" in template else b"\n",
                                 add_bos=False, special=True)
            decode(close, False)
            made += close
        n = len(tokens) + len(made)
        progress["tokens"] += n
        progress["turn"] += 1
        stretch_tokens += n
        bar.update(n)
        if progress["tokens"] >= next_check:
            rss, peak = memory_mib()
            now = time.time()
            stats = llm.locret_stats()
            progress["checks"].append({"part": progress["part"],
                                       "tokens": progress["tokens"], "rss_mib": round(rss, 1), "peak_mib": round(peak, 1),
                                       "tok_per_s": round(stretch_tokens / max(now - stretch_t, 1e-9), 1),
                                       "cells_used": stats["n_cells_used"], "evictions": stats["n_evictions"],
                                       "predicted_cells": counts.n_used, "predicted_evictions": counts.evictions})
            next_check = (progress["tokens"] // every + 1) * every
            bar.set_postfix(rss=f"{rss:.0f}MiB", tps=progress["checks"][-1]["tok_per_s"])
            if not save():
                return 2
            stretch_t, stretch_tokens = time.time(), 0  # the save's time is not the stream's
        if args.max_minutes is not None and time.time() - t_start > 60 * args.max_minutes:
            stopped = True
            break
    bar.close()

    if stopped:
        if not save():
            return 2
        print(f"stopped after {progress['tokens']:,} tokens ({progress['seconds'] / 3600:.2f} h so far); "
              f"resume with --resume --out {out}")
        return report(progress, final=False, first_at=every, standin=args.standin)

    # the question about the last turn
    _, last_code = turn_text(progress["turn"] - 1)
    crate = progress["turn"] - 1
    question = user_turn(f"What is the delivery number for crate {crate}?") + f"The delivery number for crate {crate} is"
    logits = decode(llm.tokenize(question.encode(), add_bos=False, special=True), True)
    answer = llm.detokenize(greedy(logits, 12)).decode(errors="replace")
    progress["answer"], progress["answer_right"] = answer, last_code in answer
    progress["counts"] = counts.state()
    progress["seconds"] = seconds_before + time.time() - t_start
    saved_state = progress.pop("state", None)
    progress_path.write_text(json.dumps(progress, indent=1))
    if saved_state:
        (out / saved_state).unlink(missing_ok=True)
    verdict = ("not judged (random weights)" if args.standin else "right" if progress["answer_right"] else "WRONG")
    print(f"answer: {answer!r} (code {last_code}): {verdict}")
    eviction_costs(llm.locret_stats(), time.time() - t_start)
    return report(progress, final=True, first_at=every, standin=args.standin)


def eviction_costs(stats: dict, seconds: float) -> None:
    """What this part's evictions cost (the stats count from the context's creation: a resumed soak's last part)."""
    spent = (stats["t_select_us"] + stats["t_compact_us"] + stats["t_readback_us"]) / 1e6
    moved = stats["n_rows_moved"] / stats["n_rows_kept"] if stats["n_rows_kept"] else float("nan")
    per = stats["n_host_syncs"] / stats["n_evictions"] if stats["n_evictions"] else float("nan")
    print(f"evictions: {stats['n_evictions']}, {spent:.2f} s of {seconds:.0f} s ({100 * spent / seconds:.1f} %; "
          f"selection {stats['t_select_us'] / 1e6:.2f} s, compaction {stats['t_compact_us'] / 1e6:.2f} s, read-back "
          f"{stats['t_readback_us'] / 1e6:.2f} s); rows moved / kept {moved:.3f}, rows re-rotated "
          f"{stats['n_rows_rotated']}; host syncs per eviction {per:.1f}; positions {stats['positions']}")


def report(progress: dict, final: bool, first_at: int = CHECK_EVERY, standin: bool = False) -> int:
    checks = progress["checks"]
    print(f"\n{progress['tokens']:,} tokens in {progress['seconds'] / 3600:.2f} h, {len(checks)} checkpoints\n")
    print("| tokens | RSS (MiB) | peak RSS (MiB) | tok/s (last stretch) | cells used | evictions | state (bytes) |\n"
          "|---:|---:|---:|---:|---:|---:|---:|")
    for c in checks:
        print(f"| {c['tokens']:,} | {c['rss_mib']} | {c['peak_mib']} | {c['tok_per_s']} | {c['cells_used']} | "
              f"{c['evictions']} | {c.get('state_bytes', '')} |")
    ok = progress["non_finite"] == 0
    print(f"\nnon-finite logits: {progress['non_finite']}")
    # Algorithm 1's counts (checkpoints written before the counts were recorded carry none)
    predicted = [c for c in checks if "predicted_evictions" in c]
    wrong = [c for c in predicted if (c["evictions"], c["cells_used"]) != (c["predicted_evictions"], c["predicted_cells"])]
    ok &= not wrong
    print(f"evictions and cells used as Algorithm 1 predicts: {len(predicted) - len(wrong)} of {len(predicted)} "
          f"checkpoints" + (f" (first difference at {wrong[0]['tokens']:,}: engine {wrong[0]['evictions']} evictions, "
                            f"{wrong[0]['cells_used']} cells; predicted {wrong[0]['predicted_evictions']}, "
                            f"{wrong[0]['predicted_cells']})" if wrong else ""))
    sizes: dict[int, set] = {}
    for c in checks:
        if "state_bytes" in c:
            sizes.setdefault(c["cells_used"], set()).add(c["state_bytes"])
    if sizes:
        differing = {cells: sorted(b) for cells, b in sizes.items() if len(b) > 1}
        ok &= not differing
        every = sorted(b for bs in sizes.values() for b in bs)
        print(f"state checkpoints: {every[0]:,}-{every[-1]:,} bytes over {len(sizes)} cell counts; the same cells used "
              f"give the same size: {'yes' if not differing else f'NO {differing}'}")
    # memory is a process's: a resumed part (another process, which may not have built the stand-in or loaded what
    # the first did) is compared with its own first checkpoint; each part's report checked its own when it stopped
    own = [c for c in checks if c.get("part", 0) == checks[-1].get("part", 0)] if checks else []
    first = next((c for c in own if c["tokens"] >= first_at), None)
    if first is not None and len(own) > 1:
        ratio = own[-1]["peak_mib"] / first["peak_mib"]
        ok &= ratio <= 1.05
        print(f"peak RSS at {own[-1]['tokens']:,} / at {first['tokens']:,}: {ratio:.3f} (needed <= 1.05)")
        if standin:  # the stand-in's memory is the engine's alone: it must not move
            worst = max(own[own.index(first):], key=lambda c: abs(c["rss_mib"] / first["rss_mib"] - 1))
            ratio = worst["rss_mib"] / first["rss_mib"]
            ok &= abs(ratio - 1) <= 0.02
            print(f"RSS farthest from the first checkpoint's: {ratio:.4f} at {worst['tokens']:,} (needed within 2 %)")
    millions = {}
    for c in checks:  # mean throughput per million, over the stretches ending in it
        millions.setdefault((c["tokens"] - 1) // 1_000_000, []).append(c["tok_per_s"])
    if 1 in millions and len(millions) > 2:
        # the last million the run filled (a run that stops just past a million's start has a stretch or two there)
        last = max(k for k in millions if len(millions[k]) * 2 >= len(millions[1]))
        ratio = np.mean(millions[last]) / np.mean(millions[1])
        ok &= ratio >= 0.9
        print(f"throughput of million {last + 1} / million 2: {ratio:.3f} (needed >= 0.9)")
    if final and not standin:
        ok &= bool(progress.get("answer_right"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
