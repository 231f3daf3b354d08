#!/usr/bin/env python3
"""Held-out needle tasks as people send them: chats through the official `openai` client to `locret serve`.

Each prompt is a `locret eval` task sample (the same generator, seed and families), sent as one user message: the
document with the question at its end, no extra field, so the server's defaults decide everything (the heads file's
recommended settings: Locret-Q auto finds and pins the question, its pooling window). `--slots` chats run at once
(one client thread per slot). The server's log says what it pinned for each request; the script checks it against
the task's question and prints one markdown table (accuracy per task, prompts counted) and writes the answers to -o
(and each one as it comes to <output>.answers.jsonl).

    .venv/bin/python scripts/openai_chats.py --tasks niah_single,niah_code --lengths 16384 \
        --haystacks recipes,weather,manual,minutes --depths 0.25,0.75 -o results/openai-16k.json

The families must be held out from the heads (their training logs are read, as `locret eval --held-out` does).
Exit 1 on a bad input, 2 when the server does not start.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "py"))

from locret import models, planner, serve  # noqa: E402  (before llama_cpp: our libllama)
from locret.evaluation import decoding, heldout, items as items_module  # noqa: E402

PIN = re.compile(r'pinned: "(.*)"')


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=models.DEFAULT_MODEL)
    p.add_argument("--heads", help="retaining heads (default: the model's shipped Locret-Q heads)")
    p.add_argument("--tasks", default="niah_single,niah_code,niah_quote")
    p.add_argument("--lengths", default="16384", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--haystacks", default="recipes,weather,manual,minutes")
    p.add_argument("--depths", default="0.25,0.75")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", type=int, help=f"Locret budget (default: locret serve's, {serve.DEFAULT_BUDGET})")
    p.add_argument("--ubatch", type=int, help=f"chunk (default: locret serve's, {serve.DEFAULT_UBATCH})")
    p.add_argument("--slots", type=int, default=2, help="chats at once (llama-server -np; default 2)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--startup-s", type=float, default=300)
    p.add_argument("-o", "--output", required=True, help="JSON file for the answers and the table")
    return p.parse_args(argv)


def chats(args, vocab) -> list[dict]:
    """The prompts `locret eval` makes for these tasks, families, lengths and depths (its generator: seed and sample
    indices, one sample per depth), each as the user message: the document with the question at its end."""
    chat = decoding.chat_format(vocab)
    return [{"id": ts.id, "row": ts.source, "sample": ts.sample, "text": items_module.user_message(ts.sample, chat),
             "max_tokens": ts.task.MAX_NEW_TOKENS}
            for ts in items_module.task_samples(vocab, args.tasks.split(","), [int(x) for x in args.lengths.split(",")],
                                                [float(x) for x in args.depths.split(",")], 1, args.seed,
                                                args.haystacks.split(","))]


def ask(url: str, text: str, max_tokens: int) -> tuple[str, int, float]:
    import openai  # the official client, no extra field: what a user's code sends

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    t0 = time.monotonic()
    reply = client.chat.completions.create(model="locret", messages=[{"role": "user", "content": text}],
                                           max_tokens=max_tokens, temperature=0)
    return reply.choices[0].message.content or "", reply.usage.prompt_tokens, time.monotonic() - t0


def table(rows: list[dict]) -> str:
    by_task: dict[str, list[float]] = {}
    for r in rows:
        by_task.setdefault(r["row"], []).append(r["score"])
    lines = ["| task | prompts | score |", "|---|---:|---:|"]
    lines += [f"| {t} | {len(s)} | {sum(s) / len(s):.2f} |" for t, s in sorted(by_task.items())]
    every = [r["score"] for r in rows]
    lines.append(f"| all | {len(every)} | {sum(every) / len(every):.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from tqdm import tqdm

    args = parse_args(argv)
    try:
        model_path = models.resolve(args.model)
        facts = planner.read_model(model_path)
        heads = args.heads or planner.resolve_heads(args.model, model_path, facts, None, query=True)[0]
        trained = heldout.check_held_out(args.haystacks.split(","), {"server": heads})
        import llama_cpp

        vocab = llama_cpp.Llama(model_path=str(model_path), vocab_only=True, verbose=False)
        todo = chats(args, vocab)
    except (ValueError, planner.PlanError, models.ModelError, items_module.ItemError) as e:
        print(f"openai_chats: {e}", file=sys.stderr)
        return 1
    longest = max(len(c["sample"].tokens) + c["max_tokens"] for c in todo)
    port = serve.free_port()
    cmd = [sys.executable, "-m", "locret", "serve", "--model", str(model_path), "--heads", str(heads),
           "--context", str(args.slots * (longest + 256)), "--slots", str(args.slots), "--threads", str(args.threads),
           "--port", str(port)]
    cmd += ["--budget", str(args.budget)] if args.budget else []
    cmd += ["--ubatch", str(args.ubatch)] if args.ubatch else []
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.with_suffix(".server.log")
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as log_file:
        server = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO)
        try:
            try:
                serve.wait_healthy(url, server, log, args.startup_s)
            except RuntimeError as e:
                print(f"openai_chats: {e}", file=sys.stderr)
                return 2
            rows = []
            journal = out.with_suffix(".answers.jsonl")  # each answer as it comes: an interrupted run keeps them
            journal.write_text("")
            with ThreadPoolExecutor(max_workers=args.slots) as pool, tqdm(total=len(todo), unit="chat") as bar:
                futures = [(c, pool.submit(ask, url, c["text"], c["max_tokens"])) for c in todo]
                for c, fut in futures:
                    answer, prompt_tokens, seconds = fut.result()
                    s = c["sample"]
                    rows.append({"id": c["id"], "row": c["row"], "question": s.question.strip(), "answer": answer,
                                 "gold": list(s.answers), "score": s.score(answer), "prompt_tokens": prompt_tokens,
                                 "seconds": round(seconds, 1)})
                    with open(journal, "a") as j:
                        j.write(json.dumps(rows[-1]) + "\n")
                    bar.update()
        finally:
            server.terminate()
            server.wait(timeout=60)
    pinned = PIN.findall(log.read_text(errors="replace"))
    questions = [r["question"] for r in rows]
    summary = {"command": cmd, "heads": str(heads), "trained_on": trained["server"],
               "pinned_the_tasks_question": sum(q in pinned for q in questions), "prompts": len(rows),
               "table": table(rows), "rows": rows}
    out.write_text(json.dumps(summary, indent=1))
    print(summary["table"])
    print(f"the server pinned the task's own question for {summary['pinned_the_tasks_question']} of {len(rows)} chats "
          f"(log: {log})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
