#!/usr/bin/env python3
"""llama-server with a Locret budget under concurrent load and client faults; exits 0 when it kept serving.

    .venv/bin/python scripts/server_faults.py [--device cpu-2core] [--slots N|max] [--rounds 3] [--budget 1024]
        [--tokens 1500]

Plans the server with `locret plan` for the device profile (--slots max: the most slots whose memory fits the
device, up to llama.cpp's 256 sequences), starts the patched llama-server (build/bin) with that many slots on a
loopback port with the default model and its shipped heads, then per round sends, all at once: one passkey request
per slot (each prompt hides its own key at mid-depth), a client that disconnects during prefill, a streaming client
that disconnects after its first chunk, and bad requests (invalid JSON, a prompt of out-of-vocabulary token ids, a
negative n_probs, an empty prompt, a prompt longer than a slot's context, absurd n_predict / n_probs / slot ids).
Checks, printed as a report:
- the server answers /health and a plain request after every round (it never died);
- no answer holds another request's key (a slot never serves another request's cache), and most answers hold
  their own key (the model reads its own cache: at least --min-correct of them);
- bad requests get an HTTP error status (or, where llama-server defines a meaning: a clamped n_probs, an empty
  answer, any free slot, a bounded answer), never a dropped connection;
- the server's peak RSS (VmHWM) stays within the plan's predicted peak plus --rss-slack (the server's own heap,
  HTTP threads and tokenizer, which the plan does not count), and its RSS at the end within --rss-growth (10 %) of
  its RSS after the first round (with llama-server's host prompt cache off, --cache-ram 0: with it on, every new
  prompt adds a saved slot state).
Bounded in requests and time (--max-minutes); the server runs on 127.0.0.1 only.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "py"))


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    """a process's resident memory (VmRSS) or its peak (VmHWM), MiB; an error when it cannot be read (the server is
    gone: a failure of the run, never a zero)"""
    from locret.serve import process_memory

    value = process_memory(pid, field)
    if value is None:
        raise RuntimeError(f"cannot read {field} of process {pid}: it is gone")
    return value / 2**20


def request(port: int, path: str, body: bytes | dict | None, timeout: float) -> tuple[int, dict | str]:
    """(HTTP status, parsed JSON or text); status 0 when the connection failed or was dropped"""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        conn.request("GET" if body is None else "POST", path, body=data, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        text = r.read().decode(errors="replace")
        try:
            return r.status, json.loads(text)
        except json.JSONDecodeError:
            return r.status, text
    except (OSError, http.client.HTTPException) as e:
        return 0, str(e)
    finally:
        conn.close()


def answer_text(reply: dict) -> str:
    try:
        return reply["choices"][0]["message"]["content"] or ""
    except (KeyError, IndexError, TypeError):
        return ""


def disconnect_after(port: int, body: dict, seconds: float, stream_first_chunk: bool = False) -> None:
    """send a request and close the connection: after `seconds`, or after the first streamed bytes"""
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    data = json.dumps(body).encode()
    s.sendall(b"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    try:
        if stream_first_chunk:
            s.recv(64)
        else:
            time.sleep(seconds)
    except TimeoutError:
        pass    # no first bytes within a minute (the request waits for a free slot): it disconnects while queued
    finally:
        s.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu-2core", help="device profile the server is planned for (devices/ or a .toml)")
    ap.add_argument("--slots", default="2", help="slots (-np): a number, or 'max' for the most the device's memory allows")
    ap.add_argument("--context", type=int, default=32768, help="logical context of each slot, tokens")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--ubatch", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=1500, help="passkey prompt length in tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min-correct", type=float, default=0.6, help="share of answers that must hold their own key")
    ap.add_argument("--rss-growth", type=float, default=0.10)
    ap.add_argument("--rss-slack", type=float, default=96.0,
                    help="MiB the server's peak RSS may exceed the plan's predicted peak by (default 96)")
    ap.add_argument("--max-minutes", type=float, default=20)
    ap.add_argument("--cache-ram", type=int, default=0,
                    help="llama-server's host prompt cache in MiB (its default, 8192, keeps every finished slot's "
                         "state: RSS then grows by one state per new prompt up to that cap)")
    ap.add_argument("--log", type=Path, default=None, help="server log (default: a temporary file)")
    args = ap.parse_args()

    import locret  # noqa: F401  (points llama_cpp at our library: first)
    import llama_cpp
    from locret import models, planner, tasks, tool_path
    from locret.serve import free_port, stop
    from locret.evaluation import decoding
    from locret.tasks import passkey

    model = str(models.resolve("smollm2-135m"))
    heads = str(models.shipped_heads("smollm2-135m"))
    try:
        plan = planner.plan(args.device, "smollm2-135m", heads=heads, context=args.context, budget=args.budget,
                            ubatch=args.ubatch, slots=args.slots)
    except (ValueError, RuntimeError) as e:   # PlanError, DeviceError, a model file error
        print(f"server_faults: error: {e}", file=sys.stderr)
        return 1
    if not plan.fits:
        print(f"server_faults: error: {planner.refusal(plan)}", file=sys.stderr)
        return 1
    slots, planned_mib = plan.settings.slots, plan.total("host") / 2 ** 20
    print(f"plan on {plan.device.name}: {slots} slots x {plan.settings.n_cells} cells, predicted peak "
          f"{planned_mib:.0f} MiB" + "".join(f"; {n}" for n in plan.notes if n.startswith("slots")), flush=True)
    vocab = llama_cpp.Llama(model_path=model, vocab_only=True, verbose=False)
    task = tasks.get("passkey")
    deadline = time.monotonic() + 60 * args.max_minutes
    wait = 60 * args.max_minutes   # one request may take a whole round: every slot's prompt shares the CPU

    port = free_port()
    log_path = args.log or Path(os.environ.get("TMPDIR", "/tmp")) / f"server-faults-{port}.log"
    cmd = [str(tool_path("llama-server")), "-m", model, "--locret-heads", heads, "--locret-budget",
           str(args.budget), "-np", str(slots), "-c", str(plan.settings.n_ctx),
           # llama.cpp asserts when a context has more sequences than the batch (-b) has tokens
           "-b", str(max(args.ubatch, slots)), "-ub", str(args.ubatch),
           "-t", str(args.threads), "--cache-ram", str(args.cache_ram), "--host", "127.0.0.1", "--port", str(port)]
    failures: list[str] = []
    counts = {"requests": 0, "answered": 0, "own_key": 0, "other_key": 0, "bad_refused": 0, "bad_served": 0,
              "disconnects": 0}
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            while True:
                status, _ = request(port, "/health", None, timeout=2)
                if status == 200:
                    break
                if server.poll() is not None or time.monotonic() > deadline:
                    print(f"server_faults: the server did not start (log {log_path})", file=sys.stderr)
                    return 1
                time.sleep(0.5)
            rss_first = rss_peak = rss_hwm = 0.0
            for rnd in range(args.rounds):
                if time.monotonic() > deadline:
                    failures.append(f"out of time after {rnd} rounds")
                    break
                samples, keys, seed = [], [], 1000 * rnd
                while len(samples) < slots:   # distinct keys: an answer holding another's key must mean a leak
                    sample = task.generate(seed, 0, tokenize=decoding.tokenizer(vocab), n_tokens=args.tokens, depth=0.5)
                    seed += 1
                    if sample.answers[0] not in keys:
                        samples.append(sample)
                        keys.append(sample.answers[0])
                replies: list[tuple[int, dict | str] | None] = [None] * len(samples)

                def ask(k: int) -> None:
                    # 24 tokens: the model often opens with "The five-digit passkey hidden in the text is" (11)
                    question = f"{passkey.INTRO}\n\n{samples[k].context}\n\n{passkey.QUESTION}"
                    replies[k] = request(port, "/v1/chat/completions", {
                        "messages": [{"role": "user", "content": question}], "max_tokens": 24, "temperature": 0},
                        timeout=wait)

                long_prompt = f"{passkey.INTRO}\n\n{samples[0].context}"
                faults = [
                    threading.Thread(target=disconnect_after, args=(port, {"prompt": long_prompt, "n_predict": 8}, 0.5)),
                    threading.Thread(target=disconnect_after, args=(port, {"prompt": "Count: one two", "n_predict": 64,
                                                                           "stream": True}, 0, True)),
                ]
                asks = [threading.Thread(target=ask, args=(k,)) for k in range(len(samples))]
                for t in faults + asks:
                    t.start()
                # (body, what, whether llama-server refuses it or answers it in a bounded way: a negative or huge
                # n_probs is clamped, an empty prompt gets an empty answer, an unknown slot id any free slot)
                bad = [(b"{not json", "invalid JSON", "refuse"),
                       ({"prompt": [10 ** 9], "n_predict": 4}, "token id out of range", "refuse"),
                       ({"prompt": [1] * (args.context + 64), "n_predict": 2}, "a prompt longer than a slot's context",
                        "refuse"),
                       ({"prompt": "hi", "n_predict": 10 ** 30}, "an n_predict beyond 64 bits", "refuse"),
                       ({"prompt": "hi", "n_probs": -7, "n_predict": 2}, "negative n_probs", "serve"),
                       ({"prompt": "", "n_predict": 2}, "empty prompt", "serve"),
                       ({"prompt": "hi", "n_predict": 2, "id_slot": 10 ** 6}, "a slot id that does not exist", "serve"),
                       ({"prompt": "hi", "n_predict": 2, "n_probs": 10 ** 12}, "an absurd n_probs", "serve")]
                for body, what, expect in bad:
                    status, reply = request(port, "/completion", body, timeout=wait)  # may queue for a busy slot
                    counts["requests"] += 1
                    if status == 0:
                        failures.append(f"round {rnd}: {what}: connection dropped ({reply})")
                    elif expect == "refuse" and status >= 400:
                        counts["bad_refused"] += 1
                    elif expect == "serve" and status == 200 and isinstance(reply, dict) \
                            and reply.get("tokens_predicted", 99) <= 2:
                        counts["bad_served"] += 1
                    else:
                        failures.append(f"round {rnd}: {what}: status {status}, expected "
                                        f"{'an HTTP error' if expect == 'refuse' else 'a bounded answer'}: "
                                        f"{str(reply)[:200]}")
                for t in faults + asks:
                    t.join(timeout=wait)
                counts["disconnects"] += len(faults)
                for k, got in enumerate(replies):
                    counts["requests"] += 1
                    if got is None or got[0] != 200 or not isinstance(got[1], dict):
                        failures.append(f"round {rnd}: request {k} failed: {got}")
                        continue
                    counts["answered"] += 1
                    text = answer_text(got[1])
                    counts["own_key"] += keys[k] in text
                    if keys[k] not in text:
                        print(f"round {rnd}: request {k} (key {keys[k]}) answered {text!r}", flush=True)
                    leaked = [key for j, key in enumerate(keys) if j != k and key in text]
                    if leaked:
                        counts["other_key"] += 1
                        failures.append(f"round {rnd}: request {k} answered another request's key {leaked}: {text!r}")
                if server.poll() is not None:
                    failures.append(f"round {rnd}: the server exited with {server.returncode}")
                    break
                status, _ = request(port, "/health", None, timeout=10)
                ok, reply = request(port, "/completion", {"prompt": "The capital of France is", "n_predict": 4,
                                                          "temperature": 0}, timeout=120)
                if status != 200 or ok != 200:
                    failures.append(f"round {rnd}: not serving after the faults (health {status}, request {ok})")
                rss = rss_mib(server.pid)
                rss_first = rss_first or rss
                rss_peak = max(rss_peak, rss)
                rss_hwm = rss_mib(server.pid, "VmHWM")
                held = sum(isinstance(r, tuple) and isinstance(r[1], dict) and k in answer_text(r[1])
                           for k, r in zip(keys, replies))
                print(f"round {rnd}: {len(samples)} passkey requests, {held} answered with their key, RSS {rss:.0f} MiB "
                      f"(peak {rss_hwm:.0f})", flush=True)
        finally:
            stop(server)

    if counts["answered"] and counts["own_key"] < args.min_correct * counts["answered"]:
        failures.append(f"only {counts['own_key']} of {counts['answered']} answers hold their own key")
    if rss_first and rss_peak > (1 + args.rss_growth) * rss_first:
        failures.append(f"RSS grew from {rss_first:.0f} to {rss_peak:.0f} MiB")
    if rss_hwm > planned_mib + args.rss_slack:
        failures.append(f"peak RSS {rss_hwm:.0f} MiB is above the plan's {planned_mib:.0f} MiB + {args.rss_slack:.0f}")
    print(f"server_faults: {slots} slots, {args.rounds} rounds, {counts['requests']} requests ({counts['answered']} passkey answers, "
          f"{counts['own_key']} with their own key, {counts['other_key']} with another's), {counts['bad_refused']} bad "
          f"requests refused with an HTTP error and {counts['bad_served']} answered within bounds, {counts['disconnects']} client disconnects, RSS {rss_first:.0f} -> "
          f"{rss_peak:.0f} MiB, peak {rss_hwm:.0f} MiB (plan {planned_mib:.0f}); log {log_path}")
    for f in failures:
        print(f"FAIL: {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
