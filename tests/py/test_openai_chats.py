"""scripts/openai_chats.py: held-out needle tasks sent as chats through the official openai client to `locret serve`
with its defaults. A small real run (two chats at once, 1,000-token prompts in a budget of 256) and its refusals."""
from __future__ import annotations

import json
import sys

from conftest import REPO, run

SCRIPT = REPO / "scripts" / "openai_chats.py"


def test_two_chats_at_once_are_answered_and_their_questions_pinned(tmp_path):
    out = tmp_path / "chats.json"
    proc = run([sys.executable, SCRIPT, "--tasks", "niah_single", "--lengths", 1000, "--haystacks", "weather",
                "--depths", "0.25,0.75", "--budget", 256, "--ubatch", 64, "--threads", 1, "-o", out], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    rows = summary["rows"]
    assert summary["prompts"] == len(rows) == 2 and {r["row"] for r in rows} == {"niah_single@weather"}
    journal = [json.loads(line) for line in out.with_suffix(".answers.jsonl").read_text().splitlines()]
    assert journal == rows                                             # each answer written as it came
    # the server found each chat's closing question by itself and pinned it (no extra field was sent)
    assert summary["pinned_the_tasks_question"] == 2
    assert all(r["prompt_tokens"] > 3 * 256 for r in rows)            # read past the budget: it evicted
    assert "locret-q" not in " ".join(map(str, summary["command"]))    # nothing but the defaults and the heads
    for r in rows:
        assert r["score"] == float(any(g in r["answer"] for g in r["gold"])), r
    mean = sum(r["score"] for r in rows) / 2
    assert f"| niah_single@weather | 2 | {mean:.2f} |" in proc.stdout
    # the families were checked against the heads' training logs
    assert "weather" not in summary["trained_on"] and "prose" in summary["trained_on"]


def test_a_family_the_heads_were_trained_on_is_refused(tmp_path):
    proc = run([sys.executable, SCRIPT, "--haystacks", "legal", "-o", tmp_path / "x.json"], timeout=120)
    assert proc.returncode == 1 and "legal is not held out" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "x.json").exists()
    proc = run([sys.executable, SCRIPT, "--tasks", "ruler", "-o", tmp_path / "x.json"], timeout=120)
    assert proc.returncode == 1 and "unknown task 'ruler'" in proc.stderr, proc.stderr[-2000:]
