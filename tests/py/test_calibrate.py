"""`locret calibrate` (py/locret/calibrate.py): per-layer budgets from how concentrated the heads' scores are, written
as a schedule file that names its model. The arithmetic by hand; a real calibration of the default model with the
shipped heads (short samples); the library's refusal of a file made for another model; bad input."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from conftest import REPO, run

from locret import Llama, calibrate
from locret.calibrate import CalibrationError, fit_budgets, mass_share
from locret.heads import HeadsError
from locret.query import pin_room

HEADS = REPO / "heads" / "smollm2-135m-instruct.gguf"
N_LAYER, B, UB = 30, 240, 64


def test_mass_share_by_hand():
    # one head with attention 0.5, 0.3, 0.2 (as logits): 0.75 of the mass needs the top 2 of 3 units
    scores = np.log(np.array([[0.2], [0.5], [0.3]]))
    assert mass_share(scores, 0.75) == pytest.approx(2 / 3)
    assert mass_share(scores, 0.5) == pytest.approx(1 / 3)       # 0.5 itself is reached by the top unit
    assert mass_share(scores + 7.0, 0.75) == pytest.approx(2 / 3)  # a softmax: shifting every score changes nothing
    # two heads: a flat one (4 units carry 0.9 of 4 equal ones: all 4) and a peaked one (1 unit): mean (1 + 1/4) / 2
    two = np.stack([np.zeros(4), np.array([10.0, 0.0, 0.0, 0.0])], axis=1)
    assert mass_share(two, 0.9) == pytest.approx((1.0 + 0.25) / 2)


def test_budgets_follow_the_needs_within_the_bounds():
    assert fit_budgets([1, 1, 2], 400, 50, 300) == [100, 100, 200]
    # the third layer would get 200 > cap 150: it keeps the cap, the other two share the remaining 250 equally
    assert fit_budgets([1, 1, 2], 400, 50, 150) == [125, 125, 150]
    # a layer below the floor is raised to it and the rest shrink: needs 1, 10, 10 of 210 -> 10, 100, 100; floor 30
    assert fit_budgets([1, 10, 10], 210, 30, 210) == [30, 90, 90]
    # rounding: 100 / 3 = 33.33 each; the one unit left goes to the lowest layer of the equal remainders
    assert fit_budgets([1, 1, 1], 100, 1, 100) == [34, 33, 33]
    # remainders: 10 x (0.15, 0.35, 0.5) = 1.5, 3.5, 5 -> 1, 3, 5 and one unit left to 1.5 (its remainder ties 3.5's,
    # the lower layer wins)
    assert fit_budgets([0.15, 0.35, 0.5], 10, 1, 10) == [2, 3, 5]
    # a floor near the mean: the bounds take most layers, and the sum still holds (the first water-filling fixed the
    # layers under the floor and over the cap in the same round and ended 315 units over)
    needs = [0.64, 0.37, 0.38, 0.22, 0.31, 0.22, 0.47, 0.31, 0.38, 0.42, 0.42, 0.58, 0.45, 0.31, 0.31] * 2
    got = fit_budgets(needs, 30 * 240, 225, 480)
    assert sum(got) == 7200 and min(got) == 225 and max(got) <= 480
    rng = np.random.default_rng(0)
    for _ in range(200):  # the defining property on random needs: free layers follow one scale, bounds hold
        n = int(rng.integers(2, 40))
        needs = rng.uniform(0.01, 1.0, n).tolist()
        floor = int(rng.integers(1, 200))
        cap = floor + int(rng.integers(0, 400))
        total = int(rng.integers(n * floor, n * cap + 1))
        got = fit_budgets(needs, total, floor, cap)
        assert sum(got) == total and all(floor <= v <= cap for v in got)
        free = [i for i in range(n) if floor < got[i] < cap]
        if len(free) >= 2:
            scale = [got[i] / needs[i] for i in free]
            lo, hi = min(free, key=lambda i: got[i] / needs[i]), max(free, key=lambda i: got[i] / needs[i])
            # within one unit of rounding of a common scale
            assert (got[hi] - 1) / needs[hi] <= (got[lo] + 1) / needs[lo] + 1e-9, (scale, got, needs)
    with pytest.raises(CalibrationError, match="3 layers cannot share 100 units with budgets between 40 and 90"):
        fit_budgets([1, 1, 1], 100, 40, 90)
    with pytest.raises(CalibrationError, match="possible totals: 30 to 60"):
        fit_budgets([1, 1, 1], 100, 10, 20)


@pytest.fixture(scope="module")
def calibrated(model_path, tmp_path_factory):
    """A calibration of the default model with the shipped plain heads: one text of 384 tokens, mean budget B."""
    out = tmp_path_factory.mktemp("calibrate") / "schedule.txt"
    proc = run([sys.executable, "-m", "locret", "calibrate", "--model", model_path, "--heads", HEADS, "--budget", B,
                "--texts", "prose", "--tokens", 384, "--threads", 1, "-o", out], timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return out, proc.stdout


def test_the_schedule_names_its_model_and_keeps_the_memory_of_the_uniform_budget(calibrated, model_path):
    out, stdout = calibrated
    lines = out.read_text().splitlines()
    budgets = [int(x) for x in lines if not x.startswith("#")]
    header = {k.strip(): v.strip() for k, v in (line[2:].split(":", 1) for line in lines if line.startswith("# ")
                                                 and ":" in line)}
    assert len(budgets) == N_LAYER and sum(budgets) == N_LAYER * B
    floor = 128 + pin_room() + 1                                       # the shipped heads' stabilizers, 128
    # the floor (225) is near the mean (240): most layers sit at it, the needier ones above
    assert min(budgets) == floor and max(budgets) <= 2 * B and len(set(budgets)) >= 3
    needs = [float(x) for x in header["needs (share of units per layer)"].split()]
    assert len(needs) == N_LAYER and all(0 < v <= 1 for v in needs)
    # where no bound holds, the budgets are in proportion to the needs
    free = [i for i, b in enumerate(budgets) if floor < b < 2 * B]
    assert len(free) >= 2
    ratios = [budgets[i] / needs[i] for i in free]
    assert max(ratios) / min(ratios) < 1.05, ratios
    from locret import planner
    assert header["model"] == planner.read_model(model_path).name
    assert f"sum {N_LAYER * B} (mean {B})" in stdout


def test_the_same_sample_gives_the_same_schedule(calibrated, model_path):
    # in-process, the same texts and seed as the command line's run: the same file, word for word
    out, _ = calibrated
    again = calibrate.calibrate(str(model_path), heads=str(HEADS), budget=B, texts=("prose",), n_tokens=384,
                                threads=1)
    assert again.text() == out.read_text()


def test_the_library_uses_the_schedule_and_refuses_it_for_another_model(calibrated, model_path, tmp_path):
    out, _ = calibrated
    budgets = [int(x) for x in out.read_text().splitlines() if not x.startswith("#")]
    kw = dict(n_ctx=4096, n_batch=UB, n_ubatch=UB, locret_heads=str(HEADS), locret_budget=B, n_threads=1,
              verbose=False)
    llm = Llama(model_path=str(model_path), locret_budget_schedule=str(out), **kw)
    try:
        assert [llm.locret_layer_budget(il) for il in range(N_LAYER)] == budgets
    finally:
        llm.close()
    other = tmp_path / "other.txt"
    other.write_text(out.read_text().replace("# model: ", "# model: Another "))
    with pytest.raises(HeadsError, match=r"was made for model 'Another .*'; this model is '.*make one for it with "
                                         r"locret calibrate"):
        Llama(model_path=str(model_path), locret_budget_schedule=str(other), **kw)
    # the same refusal through llama.cpp's own tool
    from conftest import tool
    proc = run([tool("llama-completion"), "-m", model_path, "--locret-heads", HEADS, "--locret-budget", B,
                "--locret-budget-schedule", other, "-p", "hello", "-n", 1, "-no-cnv"], timeout=120)
    assert proc.returncode != 0 and "was made for model 'Another" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("args,message", [
    (["--budget", 100], "the floor (225) must be at least 1 and at most the cap (200)"),
    (["--budget", 100, "--floor", 150], "30 layers cannot share 3000 units with budgets between 150 and 200"),
    (["--budget", 512, "--mass", 1.5], "--mass must be between 0 and 1"),
    (["--budget", 512, "--texts", "poetry"], "unknown text family poetry"),
    (["--budget", 512, "--tokens", 100], "--tokens must be at least 256"),
])
def test_what_it_cannot_do_is_refused(args, message, model_path, tmp_path):
    out = tmp_path / "s.txt"
    proc = run([sys.executable, "-m", "locret", "calibrate", "--model", model_path, "--heads", HEADS, *args,
                "--tokens" if "--tokens" not in args else "--seed", 256 if "--tokens" not in args else 0, "-o", out],
               timeout=300)
    assert proc.returncode == 1 and message in proc.stderr, proc.stderr[-2000:]
    assert not out.exists()
