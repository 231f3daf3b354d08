"""scripts/soak.py on a short stream: checkpoints with memory and speed, a stop by time with a saved context, a
resume that goes on where it stopped, and its refusals. The 10M-token run's figures are in the README."""
from __future__ import annotations

import json
import sys

from conftest import REPO, run

SOAK = REPO / "scripts" / "soak.py"


def soak(*args, timeout=600):
    return run([sys.executable, SOAK, "--budget", "256", "--ubatch", "64", "--threads", "1", "--check-every", "1000",
                "--generate", "4", *args], timeout=timeout)


def test_soak_stops_by_time_and_resumes_where_it_stopped(tmp_path):
    out = tmp_path / "soak"
    first = soak("--tokens", "6000", "--out", out, "--max-minutes", "0.05")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "resume with --resume" in first.stdout
    saved = json.loads((out / "soak.json").read_text())
    assert 0 < saved["tokens"] < 6000 and (out / "state.bin").stat().st_size > 0

    done = soak("--tokens", "3500" if saved["tokens"] < 3000 else str(saved["tokens"] + 1500), "--out", out, "--resume")
    final = json.loads((out / "soak.json").read_text())
    assert final["tokens"] > saved["tokens"] and final["turn"] > saved["turn"]
    # the stream went on from the saved position: the checkpoints before the stop are kept, new ones follow
    assert final["checks"][:len(saved["checks"])] == saved["checks"] and len(final["checks"]) > len(saved["checks"])
    assert final["non_finite"] == 0 and all(c["cells_used"] <= 256 + 64 for c in final["checks"])
    assert "answer" in final and not (out / "state.bin").exists()
    assert "peak RSS at" in done.stdout and done.returncode == (0 if final["answer_right"] else 1), done.stdout


def test_soak_refuses_bad_arguments(tmp_path):
    proc = soak("--tokens", "0", "--out", tmp_path / "a")
    assert proc.returncode == 2 and "must be positive" in proc.stderr
    proc = soak("--resume", "--out", tmp_path / "b")
    assert proc.returncode == 2 and "nothing to resume" in proc.stderr
