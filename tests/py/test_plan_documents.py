"""`locret plan --doc-tokens N --accuracy F`: the budget for documents of a length from the measured points of
planner/accuracy.py, and the slot's KV beside what plain llama-server allocates for such a document.

The rule against hand-made points (where it must stop, round, keep a chunk, or keep the whole document), the shipped
points' own answers for a few targets, the command line's plan (its budget, its cells and the ratio against a full
cache computed here from the GGUF's K/V widths), each refusal with exit 1, and plain llama.cpp's KV as llama.cpp
sizes it (a sliding-window model's window layers hold their window). A few seconds.
"""
from __future__ import annotations

import json
import math
import sys

import pytest

from conftest import run

from locret.planner import accuracy
from locret.planner.accuracy import BUDGET_STEP, GEMMA3, SMOLLM2, Point, budget_for, largest_compression, points_for
from locret.planner.inputs import PlanError, read_model

PTS = (Point(2.0, 1.10, 10, "a"), Point(4.0, 0.95, 10, "b"), Point(8.0, 0.80, 10, "c"), Point(16.0, 0.97, 10, "d"))


def test_the_largest_compression_stops_at_the_first_point_that_misses():
    assert largest_compression(0.9, PTS) == 4.0       # 8 misses 0.9: 16 holds it, but nothing past a miss counts
    assert largest_compression(0.8, PTS) == 16.0
    assert largest_compression(1.0, PTS) == 2.0
    assert largest_compression(1.2, PTS) is None
    # two points at one compression: the worse decides
    assert largest_compression(0.9, PTS + (Point(2.0, 0.5, 3, "e"),)) is None


def test_the_budget_is_the_document_over_that_compression_rounded_up():
    c = budget_for(6000, 0.9, 256, PTS)
    assert c.evicts and c.compression == 4.0
    assert c.budget == math.ceil(6000 / 4 / BUDGET_STEP) * BUDGET_STEP == 1536
    assert {p.source for p in c.basis} == {"a", "b"}
    # never below one chunk (the rule book refuses a chunk larger than the budget)
    assert budget_for(1100, 0.8, 512, PTS).budget == 512


def test_a_document_that_fits_budget_and_chunk_is_kept_whole():
    c = budget_for(1000, 0.9, 512, PTS)                # 1000 / 4 = 250 -> 512 (a chunk) >= 1000 - 512 -> whole
    assert not c.evicts and c.budget == 512 and c.attainable
    c = budget_for(6000, 1.5, 512, PTS)                # no point holds 1.5x: the whole document stays
    assert not c.evicts and not c.attainable and c.budget + 512 >= 6000 and c.budget % BUDGET_STEP == 0
    assert "no measured compression" in c.describe(6000, 1.5)


def test_the_shipped_points():
    # RULER 4K held 1.05x at 2; the 8-user serving run 1.00x at 2.5; the 16-user run 9/14 = 0.64x at 2.7 (plain heads,
    # look-alike needles); RULER 0.96x at 4; the real-text and generated 8-16K points 1.00x at 8; the real text at
    # 28-32K 0 of 8 at 16: so 8 up to 0.64, 2.5 up to 1.0, 2 up to 1.049, then nothing
    def c(target):
        return largest_compression(target, SMOLLM2)
    assert c(0.6) == 8.0 and c(9 / 14) == 8.0
    assert c(0.65) == 2.5 and c(0.9) == 2.5 and c(1.0) == 2.5
    assert c(1.045) == 2.0
    assert c(1.05) is None
    # Gemma-3: real documents served at 3.4x lost every needle, so no target above 0 is held at any compression
    assert largest_compression(0.05, GEMMA3) is None and largest_compression(0.0, GEMMA3) == 16.0
    assert all(p.prompts >= 8 for points in accuracy.MEASURED.values() for p in points)


def test_each_model_gets_its_own_points_and_an_unmeasured_model_none(model_path, tmp_path):
    assert points_for("smollm2-135m") is SMOLLM2 and points_for(str(model_path)) is SMOLLM2   # by name or by file
    assert points_for("gemma3-270m") is GEMMA3
    with pytest.raises(PlanError, match="no accuracy was measured for .*other.gguf.*give --budget"):
        points_for(str(tmp_path / "other.gguf"))


@pytest.mark.parametrize("bad", ["x", "0", "-1", "nan", "3"])
def test_bad_accuracy_is_refused(bad):
    with pytest.raises(PlanError):
        accuracy.parse_accuracy(bad)


def plan(*args):
    return run([sys.executable, "-m", "locret", "plan", "--device", "cpu-2core", "--model", "smollm2-135m", *args],
               timeout=120)


def test_the_command_plans_the_budget_and_sets_it_beside_plain(model_path):
    proc = plan("--doc-tokens", "6000", "--ubatch", "512", "--json")
    assert proc.returncode == 0, proc.stderr
    p = json.loads(proc.stdout)
    want = max(512, math.ceil(6000 / largest_compression(0.9, SMOLLM2) / BUDGET_STEP) * BUDGET_STEP)
    assert p["settings"]["budget"] == want
    n_cells = p["n_cells"]
    assert n_cells >= want + 512
    # the ratio against a full cache of the document, from the model's K/V widths read here: the same bytes a cell
    facts = read_model(model_path)
    per_cell = sum(2 * (k + v) for k, v in zip(facts.n_embd_k_gqa, facts.n_embd_v_gqa))   # f16
    plain_cells = math.ceil(6000 / 256) * 256
    note = p["notes"][-1]
    assert f"{plain_cells} cells): {plain_cells * per_cell / (n_cells * per_cell):.2f}x the slots" in note, note
    assert f"{plain_cells * per_cell / 2**20:.2f} MiB" in note, note
    assert f"{largest_compression(0.9, SMOLLM2):g}x compressed" in p["notes"][-2]


@pytest.mark.parametrize("args, says", [
    (["--accuracy", "0.9"], "--accuracy needs --doc-tokens"),
    (["--doc-tokens", "6000", "--budget", "1024"], "not both"),
    (["--doc-tokens", "6000", "--budget-mib", "40"], "not both"),
    (["--doc-tokens", "6000", "--accuracy", "much"], "such as 0.9"),
    (["--doc-tokens", "0"], "at least 1 token"),
])
def test_refusals_exit_1(args, says):
    proc = plan(*args)
    assert proc.returncode == 1 and says in proc.stderr, (proc.returncode, proc.stderr)


# ---------------------------------------------------------------- plain llama.cpp's KV, llama.cpp's own size

def _gemma():
    from locret import models
    if not models.is_installed("gemma3-270m"):
        pytest.skip("gemma3-270m is not installed")
    return models.resolve("gemma3-270m", fetch=False)


def test_plain_kv_bytes_is_llama_cpps_cache_computed_here(model_path):
    """planner.plain_kv_bytes against the cache computed from the GGUF's hyperparameters: SmolLM2 keeps every layer
    for every cell of every slot; Gemma-3's window layers (all but every sixth) keep their window and a ubatch, padded
    to 256, whatever the context."""
    from locret.planner import plain_kv_bytes
    from locret.planner.inputs import read_header

    facts = read_model(model_path)
    per_cell = sum(2 * (k + v) for k, v in zip(facts.n_embd_k_gqa, facts.n_embd_v_gqa))   # f16
    for ctx, slots in ((2048, 1), (8192, 2)):
        assert plain_kv_bytes(model_path, ctx, slots, 512) == ctx * slots * per_cell

    gemma = _gemma()
    facts = read_model(gemma)
    window = int(read_header(gemma).kv["gemma3.attention.sliding_window"])
    row = [2 * (k + v) for k, v in zip(facts.n_embd_k_gqa, facts.n_embd_v_gqa)]
    full_layers = [il for il in range(facts.n_layer) if (il + 1) % 6 == 0]
    for ctx, slots, ubatch in ((32768, 2, 512), (8192, 3, 256)):
        window_cells = -(-(window + ubatch) // 256) * 256
        want = slots * sum(row[il] * (ctx if il in full_layers else window_cells) for il in range(facts.n_layer))
        got = plain_kv_bytes(gemma, ctx, slots, ubatch)
        assert abs(got - want) <= 0.01 * 2**20, (ctx, slots, got, want)   # llama.cpp logs MiB to 2 decimals
        assert got < 0.25 * ctx * slots * sum(row)                        # far from a full cache of every layer


def test_the_plan_sets_a_window_models_slot_beside_plain_llama_cpps_own_cache():
    """Gemma-3: both sides hold the window layers' window only (the rule book's bytes a slot for ours, llama.cpp's
    own size for plain), not a full cache of every layer."""
    from locret.planner import plain_kv_bytes

    gemma = _gemma()
    proc = run([sys.executable, "-m", "locret", "plan", "--device", "cpu-2core", "--model", "gemma3-270m",
                "--doc-tokens", "20000", "--ubatch", "512", "--json"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    p = json.loads(proc.stdout)
    plain = plain_kv_bytes(gemma, 20224, 1, 512)
    # ours, computed here: the full-attention layers hold the slot's cells, the window layers 512 + 512 cells
    facts = read_model(gemma)
    row = [2 * (k + v) for k, v in zip(facts.n_embd_k_gqa, facts.n_embd_v_gqa)]
    ours = sum(r * (p["n_cells"] if (il + 1) % 6 == 0 else 1024) for il, r in enumerate(row))
    note = p["notes"][-1]
    # Gemma's own points: real documents lost their needles at 3.4x, so the whole document stays
    assert "no measured compression keeps 0.9x" in p["notes"][-2] and p["settings"]["budget"] + 512 >= 20000
    assert f"KV a slot: {ours / 2**20:.2f} MiB in {p['n_cells']} cells" in note, note
    assert f"keeps {plain / 2**20:.2f} MiB for a whole 20000-token document (20224 cells)" in note, note
    assert f"{plain / ours:.2f}x the slots" in note, note
