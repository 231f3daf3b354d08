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


# a turn is about 330 tokens (the first 322): a checkpoint every 250 tokens is one at every turn, so that every run
# saves some, and a few turns (seconds at b = 256) cover a stop, a resume and a kill
CHECK_EVERY = "250"


def soak(*args, timeout=600):
    return run([sys.executable, SOAK, "--budget", "256", "--ubatch", "64", "--threads", "1",
                "--check-every", CHECK_EVERY, "--generate", "4", *args], timeout=timeout)


def test_soak_stops_by_time_and_resumes_where_it_stopped(tmp_path):
    out = tmp_path / "soak"
    first = soak("--tokens", "6000", "--out", out, "--max-minutes", "0.02")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "resume with --resume" in first.stdout
    saved = json.loads((out / "soak.json").read_text())
    assert 0 < saved["tokens"] < 6000 and (out / saved["state"]).stat().st_size > 0
    assert saved["checks"], "the stopped run saved no checkpoint: the resume's keeping them goes unchecked"
    # a fresh run must not overwrite a stopped one
    again = soak("--tokens", "6000", "--out", out)
    assert again.returncode == 2 and "--resume" in again.stderr and json.loads((out / "soak.json").read_text()) == saved

    done = soak("--tokens", str(saved["tokens"] + 700), "--out", out, "--resume")
    final = json.loads((out / "soak.json").read_text())
    assert final["tokens"] > saved["tokens"] and final["turn"] > saved["turn"]
    # the stream went on from the saved position: the checkpoints before the stop are kept, new ones follow
    assert final["checks"][:len(saved["checks"])] == saved["checks"] and len(final["checks"]) > len(saved["checks"])
    assert final["non_finite"] == 0 and all(c["cells_used"] <= 256 + 64 for c in final["checks"])
    assert "answer" in final and "state" not in final and not list(out.glob("state-*.bin"))
    assert "peak RSS at" in done.stdout and done.returncode == (0 if final["answer_right"] else 1), done.stdout


def test_a_killed_soak_resumes_from_its_last_checkpoint(tmp_path):
    # every checkpoint saves the context and the progress: a run killed without warning (a machine restarted under
    # it) loses at most the tokens since its last checkpoint
    out = tmp_path / "soak"
    cmd = [sys.executable, str(SOAK), "--budget", "256", "--ubatch", "64", "--threads", "1",
           "--check-every", CHECK_EVERY, "--generate", "4", "--tokens", "100000", "--out", str(out)]
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
    assert done.returncode == (0 if final["answer_right"] else 1), done.stdout


def test_soak_refuses_bad_arguments(tmp_path):
    proc = soak("--tokens", "0", "--out", tmp_path / "a")
    assert proc.returncode == 2 and "must be positive" in proc.stderr
    proc = soak("--resume", "--out", tmp_path / "b")
    assert proc.returncode == 2 and "nothing to resume" in proc.stderr
