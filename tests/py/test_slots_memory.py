"""experiments/slots_memory.py: the KV memory llama-server reports with a budget schedule and several slots.

- the size line it reads is llama.cpp's own (an iSWA model's two caches summed);
- with the pyramid at a small budget, -np 2 allocates exactly twice one slot's KV, and the planner's prediction equals
  what llama.cpp reports up to its rounding of each cache's line (the rule book's size, written once).
"""
from __future__ import annotations

import subprocess
import sys

from conftest import REPO


def test_the_size_line_is_llama_cpps():
    import slots_memory  # experiments/, on sys.path through conftest

    line = ("0.00.510.540 I llama_kv_cache: size =   39.38 MiB (  1792 cells,  30 layers,  1/1 seqs), "
            "K (f16):   19.69 MiB, V (f16):   19.69 MiB")
    assert slots_memory.KV_LINE.findall(line) == [("39.38", "1792", "30", "1", "1")]


def test_two_slots_of_a_pyramid_allocate_twice_one_slot(model_path):
    proc = subprocess.run([sys.executable, str(REPO / "experiments" / "slots_memory.py"), "--budget", "256",
                           "--schedules", "pyramid", "--slots", "1,2", "--n-ctx", "4096", "--ubatch", "128"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in proc.stdout.splitlines()
            if line.startswith("| pyramid")]
    assert [r[1] for r in rows] == ["1", "2"]
    for r in rows:
        # reported == planned, up to llama.cpp's rounding: it reports each cache (a cache per budget of the
        # pyramid: 30) to 0.01 MiB
        assert float(r[4]) > 0 and abs(float(r[2]) - float(r[4])) <= 0.005 * 30 + 1e-9, r
        assert abs(float(r[2]) - float(r[4])) <= 0.02 * float(r[4]), r
    assert rows[1][5] == "2.00"                     # twice one slot's KV
    assert rows[0][3] == rows[1][3]                 # the same cells per slot


def test_bad_slots_are_refused():
    proc = subprocess.run([sys.executable, str(REPO / "experiments" / "slots_memory.py"), "--slots", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--slots must be at least 1" in proc.stderr
