"""RULER's table pooled over several `locret eval --suite ruler` folders (scripts/ruler_table.py, locret.ruler.pool):
the pooled scores are the means over every prompt (computed here by hand from the samples written), n counts them, and
what must not be mixed is refused with the folder named."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import REPO, run

HEADS = {"locret": "h.gguf sha256:aa", "locret-q-auto": "q.gguf sha256:bb"}


def _sample(method, task, index, seed, score, *, budget=None, mode="chat", wall=10.0, ratio=0.75):
    return {"method": method, "budget": budget, "run": f"{method}/4096", "item": f"ruler/{task}/4096/{index}",
            "source": f"ruler/{task}", "length": 4096, "depth": None, "prompt_tokens": 3900, "score": score,
            "compression_ratio": None if budget is None else ratio, "wall_s": wall, "prefill_tok_s": 200.0,
            "decode_tok_s": 20.0, "cells_used_max": None, "n_cells": None,
            "extra": {"mode": mode, "seed": seed, "index": index}}


def _folder(root: Path, name: str, samples: list[dict], *, suite="ruler", model="smollm2-135m", heads=None) -> Path:
    folder = root / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"suite": suite, "model": model, "heads_used": heads or HEADS}))
    (folder / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    return folder


def _two_seeds(tmp_path: Path) -> list[Path]:
    a = _folder(tmp_path, "seed1", [
        _sample("full", "niah_single_1", 0, 1, 1.0), _sample("full", "qa_1", 0, 1, 0.5),
        _sample("locret", "niah_single_1", 0, 1, 1.0, budget=1024, wall=4.0),
        _sample("locret", "qa_1", 0, 1, 0.0, budget=1024, wall=6.0)])
    b = _folder(tmp_path, "seed2", [
        _sample("full", "niah_single_1", 0, 2, 0.0), _sample("full", "qa_1", 0, 2, 1.0),
        _sample("full", "niah_single_1", 1, 2, 1.0),
        _sample("locret", "niah_single_1", 0, 2, 0.0, budget=1024, wall=8.0),
        _sample("locret", "qa_1", 0, 2, 1.0, budget=1024, wall=2.0)])
    return [a, b]


def test_pooled_scores_are_the_means_over_every_prompt(tmp_path):
    from locret.ruler.pool import pool

    entries, tasks, n = pool(_two_seeds(tmp_path))
    assert tasks == ["niah_single_1", "qa_1"] and n == 9
    by_method = {e["method"]: e for e in entries}
    full, locret = by_method["full"], by_method["locret"]
    # full: niah_single_1 over 3 prompts (1, 0, 1), qa_1 over 2 (0.5, 1)
    assert full["scores"] == {"niah_single_1": pytest.approx(100 * 2 / 3, abs=0.01), "qa_1": 75.0}
    assert full["samples"] == 5 and full["average"] == pytest.approx((100 * 2 / 3 + 75) / 2, abs=0.01)
    assert locret["scores"] == {"niah_single_1": 50.0, "qa_1": 50.0} and locret["average"] == 50.0
    assert locret["samples"] == 4 and locret["budget"] == 1024 and locret["ratio"] == 0.75


def test_the_script_prints_the_pooled_table_and_refuses_what_must_not_mix(tmp_path):
    folders = _two_seeds(tmp_path)
    script = REPO / "scripts" / "ruler_table.py"
    ok = run([sys.executable, script, *folders])
    assert ok.returncode == 0, ok.stderr
    row = next(line for line in ok.stdout.splitlines() if "| locret |" in line)
    assert row.split("|")[5:9] == [" 4 ", " 50.0 ", " 50 ", " 50 "], row
    assert "Pooled from 2 folders (9 samples)" in ok.stdout

    cases = [
        # the same prompt twice
        ([folders[0], folders[0]], "the same prompt would count twice"),
        # another suite, another model
        ([folders[0], _folder(tmp_path, "gen", [_sample("full", "qa_1", 0, 3, 1.0)], suite=None)], "not a RULER run"),
        ([folders[0], _folder(tmp_path, "gemma", [_sample("full", "qa_1", 0, 4, 1.0)], model="gemma3-270m")],
         "model gemma3-270m"),
        # a method's heads differ between the folders
        ([folders[0], _folder(tmp_path, "newheads", [_sample("locret", "qa_1", 0, 5, 1.0, budget=1024)],
                              heads={"locret": "h.gguf sha256:cc"})], "locret used other heads"),
        # RULER asked as a completion in one folder, as a chat in the other
        ([folders[0], _folder(tmp_path, "completion", [_sample("full", "qa_1", 0, 6, 1.0, mode="completion")])],
         "RULER modes chat and completion"),
        ([tmp_path / "nothing"], "not a `locret eval` folder"),
    ]
    for args, message in cases:
        proc = run([sys.executable, script, *args])
        assert proc.returncode == 1 and message in proc.stderr, (message, proc.stderr)


def test_folders_of_several_ratios_give_the_side_by_side_and_its_plot(tmp_path):
    """kvpress's grid run a ratio a folder: the pooled output has the average against the ratio, a row a method, and
    --plot writes one PNG a length."""
    r75 = _folder(tmp_path, "r0.75", [
        _sample("full", "niah_single_1", 0, 0, 1.0), _sample("full", "qa_1", 0, 0, 0.5),
        _sample("locret", "niah_single_1", 0, 0, 1.0, budget=1024), _sample("locret", "qa_1", 0, 0, 0.0, budget=1024),
        _sample("kvpress:snapkv+q", "niah_single_1", 0, 0, 0.0, budget=1024),
        _sample("kvpress:snapkv+q", "qa_1", 0, 0, 1.0, budget=1024)])
    r875 = _folder(tmp_path, "r0.875", [
        _sample("locret", "niah_single_1", 0, 0, 1.0, budget=512, ratio=0.875),
        _sample("locret", "qa_1", 0, 0, 1.0, budget=512, ratio=0.875),
        _sample("kvpress:snapkv+q", "niah_single_1", 0, 0, 0.0, budget=512, ratio=0.875),
        _sample("kvpress:snapkv+q", "qa_1", 0, 0, 0.0, budget=512, ratio=0.875)])
    png = tmp_path / "plots" / "ruler.png"
    proc = run([sys.executable, REPO / "scripts" / "ruler_table.py", r75, r875, "--plot", png])
    assert proc.returncode == 0, proc.stderr
    side = proc.stdout.split("Average against compression ratio", 1)[1]
    assert "**4096 tokens** (full attention: 75.0)" in side
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in side.splitlines() if line.startswith("| ") and "method" not in line}
    assert rows == {"locret": ["50.0", "100.0"], "kvpress:snapkv+q": ["50.0", "0.0"]}, rows
    written = tmp_path / "plots" / "ruler-4096.png"
    assert f"Plots: {written}" in proc.stdout
    assert written.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and written.stat().st_size > 10_000
