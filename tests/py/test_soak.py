"""scripts/soak.py on a short stream: checkpoints with memory and speed, a stop by time with a saved context, a
resume that goes on where it stopped (also after the process was killed), and its refusals. The 10M-token run's figures
are in the README."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from conftest import REPO, run

SOAK = REPO / "scripts" / "soak.py"


# the stop, resume and kill mechanics run on the stand-in (the soak's engine is the same; its 4 layers make a turn
# cost a tenth of the real model's): a turn is about 1,250 tokens (its tokenizer spells the text byte by byte), so a
# checkpoint every 250 tokens is one at every turn, and a few turns cover a stop, a resume and a kill
CHECK_EVERY = "250"
STANDIN = ("--standin", "--budget", "256", "--ubatch", "64", "--threads", "1", "--check-every", CHECK_EVERY,
           "--generate", "4")


def soak(*args, timeout=600):
    return run([sys.executable, SOAK, *STANDIN, *args], timeout=timeout)


def test_soak_stops_by_time_and_resumes_where_it_stopped(tmp_path):
    out = tmp_path / "soak"
    first = soak("--tokens", "20000", "--out", out, "--max-minutes", "0.02")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "resume with --resume" in first.stdout
    saved = json.loads((out / "soak.json").read_text())
    assert 0 < saved["tokens"] < 20000 and (out / saved["state"]).stat().st_size > 0
    assert saved["checks"], "the stopped run saved no checkpoint: the resume's keeping them goes unchecked"
    # a fresh run must not overwrite a stopped one
    again = soak("--tokens", "20000", "--out", out)
    assert again.returncode == 2 and "--resume" in again.stderr and json.loads((out / "soak.json").read_text()) == saved

    # two turns more: the resumed part (another process) has checkpoints of its own to compare its memory with
    done = soak("--tokens", str(saved["tokens"] + 2500), "--out", out, "--resume")
    final = json.loads((out / "soak.json").read_text())
    assert final["tokens"] > saved["tokens"] and final["turn"] > saved["turn"]
    resumed = final["checks"][len(saved["checks"]):]
    assert {c["part"] for c in saved["checks"]} == {1} and len(resumed) >= 2 and {c["part"] for c in resumed} == {2}
    # its memory is compared with its own first checkpoint, not with the first process's (which built the stand-in)
    assert f"peak RSS at {resumed[-1]['tokens']:,} / at {resumed[0]['tokens']:,}:" in done.stdout, done.stdout
    # the stream went on from the saved position: the checkpoints before the stop are kept, new ones follow
    assert final["checks"][:len(saved["checks"])] == saved["checks"] and len(final["checks"]) > len(saved["checks"])
    assert final["non_finite"] == 0 and all(c["cells_used"] <= 256 + 64 for c in final["checks"])
    assert "answer" in final and "state" not in final and not list(out.glob("state-*.bin"))
    # the stand-in's answer is not judged: the run passes on its engine checks
    assert "peak RSS at" in done.stdout and done.returncode == 0 and "not judged" in done.stdout, done.stdout


def test_a_killed_soak_resumes_from_its_last_checkpoint(tmp_path):
    # every checkpoint saves the context and the progress: a run killed without warning (a machine restarted under
    # it) loses at most the tokens since its last checkpoint
    out = tmp_path / "soak"
    cmd = [sys.executable, str(SOAK), *STANDIN, "--tokens", "200000", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while time.time() < deadline:  # until two checkpoints were saved (one replaced the other's state file)
            progress = json.loads((out / "soak.json").read_text()) if (out / "soak.json").is_file() else {}
            if len(progress.get("checks", [])) >= 2:
                break
            assert proc.poll() is None, "the soak ended before its second checkpoint"
            time.sleep(0.5)
        else:
            raise AssertionError("no second checkpoint within 300 s")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    saved = json.loads((out / "soak.json").read_text())
    # the state soak.json names is whole (a kill in the middle of a save leaves at most an orphan beside it)
    assert (out / saved["state"]).stat().st_size > 0 and saved["state"] != "state-000000000.bin"

    done = soak("--tokens", str(saved["tokens"] + 700), "--out", out, "--resume")
    final = json.loads((out / "soak.json").read_text())
    assert final["checks"][:len(saved["checks"])] == saved["checks"] and final["turn"] > saved["turn"]
    assert final["non_finite"] == 0 and "answer" in final and not list(out.glob("state-*.bin"))
    assert done.returncode == 0, done.stdout


def test_the_real_model_soak_asks_about_its_last_turn(tmp_path):
    # the default model in its chat template, with its shipped heads: the final question is judged (the exit status
    # says whether the answer named the last turn's code)
    out = tmp_path / "soak"
    proc = run([sys.executable, SOAK, "--budget", "256", "--ubatch", "64", "--threads", "1", "--check-every", "400",
                "--generate", "4", "--tokens", "800", "--out", out])
    final = json.loads((out / "soak.json").read_text())
    assert "standin" not in final["settings"] and final["settings"]["heads"].endswith("smollm2-135m-instruct.gguf")
    assert final["tokens"] >= 800 and len(final["checks"]) >= 2 and final["non_finite"] == 0
    assert all(c["evictions"] == c["predicted_evictions"] for c in final["checks"]) and final["checks"][-1]["evictions"]
    assert proc.returncode == (0 if final["answer_right"] else 1), proc.stdout[-3000:]
    assert ("right" if final["answer_right"] else "WRONG") in proc.stdout


def test_soak_refuses_bad_arguments(tmp_path):
    proc = soak("--tokens", "0", "--out", tmp_path / "a")
    assert proc.returncode == 2 and "must be positive" in proc.stderr
    proc = soak("--resume", "--out", tmp_path / "b")
    assert proc.returncode == 2 and "nothing to resume" in proc.stderr


def test_standin_soak_holds_memory_counts_and_state_size(tmp_path):
    # the 10M-token run's engine checks, on 60K tokens of the stand-in (~25 s): resident memory within 2 % of the
    # first checkpoint's, the eviction count and cells used as Algorithm 1 predicts at every checkpoint, state files of
    # the same cells the same size, finite logits
    out = tmp_path / "soak"
    proc = run([sys.executable, SOAK, "--standin", "--tokens", "60000", "--check-every", "15000", "--threads", "1",
                "--out", out], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    final = json.loads((out / "soak.json").read_text())
    checks = final["checks"]
    assert len(checks) == 4 and final["non_finite"] == 0 and final["settings"]["standin"] == "smollm2-soak"
    assert all((c["evictions"], c["cells_used"]) == (c["predicted_evictions"], c["predicted_cells"]) for c in checks)
    assert checks[-1]["evictions"] > checks[0]["evictions"] >= 30
    assert all(abs(c["rss_mib"] / checks[0]["rss_mib"] - 1) <= 0.02 for c in checks)
    assert len({c["state_bytes"] for c in checks if c["cells_used"] == checks[0]["cells_used"]}) == 1
    assert "evictions and cells used as Algorithm 1 predicts: 4 of 4 checkpoints" in proc.stdout
    assert "not judged (random weights)" in proc.stdout


def test_soak_report_fails_on_a_wrong_count_a_grown_state_or_memory():
    sys.path.insert(0, str(REPO / "scripts"))
    import soak as soak_module

    def check(tokens, rss=300.0, evictions=10, predicted=10, state=1000, cells=2160):
        return {"tokens": tokens, "rss_mib": rss, "peak_mib": rss, "tok_per_s": 1000.0, "cells_used": cells,
                "evictions": evictions, "predicted_evictions": predicted, "predicted_cells": cells,
                "state_bytes": state}

    def verdict(*checks):
        return soak_module.report({"tokens": checks[-1]["tokens"], "seconds": 1.0, "checks": list(checks),
                                   "non_finite": 0}, final=False, first_at=100, standin=True)

    assert verdict(check(100), check(200, evictions=20, predicted=20)) == 0
    assert verdict(check(100), check(200, evictions=20, predicted=21)) == 1   # the engine evicted once less
    assert verdict(check(100), check(200, state=1001)) == 1                    # same cells, a bigger state
    assert verdict(check(100), check(200, rss=309.0)) == 1                     # 3 % more resident memory
