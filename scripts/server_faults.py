#!/usr/bin/env python3
"""llama-server with a Locret budget under concurrent load and client faults; exits 0 when it kept serving.

    .venv/bin/python scripts/server_faults.py [--rounds 3] [--slots 2] [--budget 512] [--tokens 1500]

Starts the patched llama-server (build/bin) on a loopback port with the default model and its shipped heads, then
per round sends, all at once: one passkey request per slot (each prompt hides its own key at mid-depth), a client
that disconnects during prefill, a streaming client that disconnects after its first chunk, and bad requests (invalid
JSON, a prompt of out-of-vocabulary token ids, a negative n_probs, an empty prompt). Checks, printed as a report:
- the server answers /health and a plain request after every round (it never died);
- no answer holds another request's key (a slot never serves another request's cache), and most answers hold
  their own key (the model reads its own cache: at least --min-correct of them);
- bad requests get an HTTP error status, never a dropped connection;
- the server's peak RSS at the end is within --rss-growth (10 %) of its RSS after the first round (with
  llama-server's host prompt cache off, --cache-ram 0: with it on, every new prompt adds a saved slot state).
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


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
    finally:
        s.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--ubatch", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=1500, help="passkey prompt length in tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min-correct", type=float, default=0.6, help="share of answers that must hold their own key")
    ap.add_argument("--rss-growth", type=float, default=0.10)
    ap.add_argument("--max-minutes", type=float, default=20)
    ap.add_argument("--cache-ram", type=int, default=0,
                    help="llama-server's host prompt cache in MiB (its default, 8192, keeps every finished slot's "
                         "state: RSS then grows by one state per new prompt up to that cap)")
    ap.add_argument("--log", type=Path, default=None, help="server log (default: a temporary file)")
    args = ap.parse_args()

    import locret  # noqa: F401  (points llama_cpp at our library: first)
    import llama_cpp
    from locret import models, tasks
    from locret.evaluation import decoding
    from locret.tasks import passkey

    model = str(models.resolve("smollm2-135m"))
    heads = str(models.shipped_heads("smollm2-135m"))
    vocab = llama_cpp.Llama(model_path=model, vocab_only=True, verbose=False)
    task = tasks.get("passkey")
    deadline = time.monotonic() + 60 * args.max_minutes

    port = free_port()
    log_path = args.log or Path(os.environ.get("TMPDIR", "/tmp")) / f"server-faults-{port}.log"
    cmd = [str(REPO / "build" / "bin" / "llama-server"), "-m", model, "--locret-heads", heads, "--locret-budget",
           str(args.budget), "-np", str(args.slots), "-c", "65536", "-b", str(args.ubatch), "-ub", str(args.ubatch),
           "-t", str(args.threads), "--cache-ram", str(args.cache_ram), "--host", "127.0.0.1", "--port", str(port)]
    failures: list[str] = []
    counts = {"requests": 0, "answered": 0, "own_key": 0, "other_key": 0, "bad_refused": 0, "disconnects": 0}
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
            rss_first = 0.0
            rss_peak = 0.0
            for rnd in range(args.rounds):
                if time.monotonic() > deadline:
                    failures.append(f"out of time after {rnd} rounds")
                    break
                samples = [task.generate(100 * rnd + k, 0, tokenize=decoding.tokenizer(vocab), n_tokens=args.tokens,
                                         depth=0.5) for k in range(args.slots)]
                keys = [s.answers[0] for s in samples]
                replies: list[tuple[int, dict | str] | None] = [None] * len(samples)

                def ask(k: int) -> None:
                    question = f"{passkey.INTRO}\n\n{samples[k].context}\n\n{passkey.QUESTION}"
                    replies[k] = request(port, "/v1/chat/completions", {
                        "messages": [{"role": "user", "content": question}], "max_tokens": 12, "temperature": 0},
                        timeout=600)

                long_prompt = f"{passkey.INTRO}\n\n{samples[0].context}"
                faults = [
                    threading.Thread(target=disconnect_after, args=(port, {"prompt": long_prompt, "n_predict": 8}, 0.5)),
                    threading.Thread(target=disconnect_after, args=(port, {"prompt": "Count: one two", "n_predict": 64,
                                                                           "stream": True}, 0, True)),
                ]
                asks = [threading.Thread(target=ask, args=(k,)) for k in range(len(samples))]
                for t in faults + asks:
                    t.start()
                bad = [(b"{not json", "invalid JSON"), ({"prompt": [10 ** 9], "n_predict": 4}, "token id out of range"),
                       ({"prompt": "hi", "n_probs": -7, "n_predict": 2}, "negative n_probs"),
                       ({"prompt": "", "n_predict": 2}, "empty prompt")]
                for body, what in bad:
                    status, reply = request(port, "/completion", body, timeout=120)
                    counts["requests"] += 1
                    if status == 0:
                        failures.append(f"round {rnd}: {what}: connection dropped ({reply})")
                    elif status >= 400:
                        counts["bad_refused"] += 1
                for t in faults + asks:
                    t.join(timeout=900)
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
                held = sum(isinstance(r, tuple) and isinstance(r[1], dict) and k in answer_text(r[1])
                           for k, r in zip(keys, replies))
                print(f"round {rnd}: {len(samples)} passkey requests, {held} answered with their key, RSS {rss:.0f} MiB",
                      flush=True)
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()

    if counts["answered"] and counts["own_key"] < args.min_correct * counts["answered"]:
        failures.append(f"only {counts['own_key']} of {counts['answered']} answers hold their own key")
    if rss_first and rss_peak > (1 + args.rss_growth) * rss_first:
        failures.append(f"RSS grew from {rss_first:.0f} to {rss_peak:.0f} MiB")
    print(f"server_faults: {args.rounds} rounds, {counts['requests']} requests ({counts['answered']} passkey answers, "
          f"{counts['own_key']} with their own key, {counts['other_key']} with another's), {counts['bad_refused']} bad "
          f"requests refused with an HTTP error, {counts['disconnects']} client disconnects, RSS {rss_first:.0f} -> "
          f"{rss_peak:.0f} MiB; log {log_path}")
    for f in failures:
        print(f"FAIL: {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
