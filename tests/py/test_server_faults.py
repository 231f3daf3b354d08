"""llama-server with a budget keeps serving under concurrent load and client faults (scripts/server_faults.py, two
rounds), with the most slots the planner finds room for on a device: every slot answers its own passkey request while
clients disconnect mid-prefill and mid-stream and bad or absurd requests arrive; no answer holds another request's
key, the server answers after every round, its peak memory stays within the plan and its RSS flat."""
from __future__ import annotations

import re
import subprocess
import sys

from conftest import BIN, REPO, run
from locret import devices, planner

HEADS = REPO / "heads" / "smollm2-135m-instruct.gguf"


def test_the_server_keeps_serving_under_load_and_faults_with_the_most_slots_that_fit(tmp_path, model_path):
    # 50-70 s on 2 cores: one server, three slots, two rounds of every fault and bad request (the script's own
    # checks); a slot's cells must overflow in each round, so the prompts cannot be shorter than b + B
    # a device with room for the model, its buffers and 3.5 slots of b = 256, ub = 64: the plan gives 3 slots. Prompts
    # of 800 tokens overflow each slot's 512 cells (b = 1024 with 1500-token prompts ran the same paths 3x longer)
    one = planner.plan("cpu-2core", str(model_path), heads=str(HEADS), budget=256, ubatch=64, context=32768)
    two = planner.plan("cpu-2core", str(model_path), heads=str(HEADS), budget=256, ubatch=64, context=32768, slots=2)
    gib = (one.total() + 2.5 * (two.total() - one.total())) / (1 << 30)
    text = (devices.DEVICES_DIR / "cpu-2core.toml").read_text().replace('name = "cpu-2core"', 'name = "three-slots"', 1)
    board = tmp_path / "three-slots.toml"
    board.write_text(re.sub(r"available_gib = [0-9.]+", f"available_gib = {gib:.6f}", text))
    proc = run([sys.executable, REPO / "scripts" / "server_faults.py", "--device", board, "--slots", "max",
                "--rounds", "2", "--budget", "256", "--ubatch", "64", "--tokens", "800",
                "--log", tmp_path / "server.log"], timeout=1500)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:] + (tmp_path / "server.log").read_text()[-3000:]
    assert "plan on three-slots: 3 slots" in out and "slots: 3, the most that fit" in out, out[-2000:]
    assert "3 slots, 2 rounds" in out and "0 with another's" in out, out[-2000:]
    assert "8 bad requests refused with an HTTP error and 8 answered within bounds" in out, out[-2000:]


def test_more_slots_than_the_batch_holds_is_an_error_not_an_abort(model_path):
    # llama.cpp reserves an output row per sequence and asserted when -np exceeded -b (patch 0027)
    proc = subprocess.run([str(BIN / "llama-server"), "-m", str(model_path), "-np", "200",
                           "-b", "128", "-ub", "128", "-c", "65536", "--port", "0"],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "n_seq_max (200) is larger than the outputs one batch can hold (128)" in proc.stderr, proc.stderr[-2000:]
