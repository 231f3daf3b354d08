"""Budgets in memory (--locret-budget-mib, locret_budget_mib, eviction.budget_for_mib): the rule book's sizes
(llama_locret_resolve_file's kv_bytes, window_bytes, store_bytes and per-layer bytes) are compared with what a
created context really allocates (its K/V tensors, score and query stores), and the budget resolved for a size is
checked to fit it while one unit more does not.
"""
from __future__ import annotations

import json
import re
import urllib.request

import pytest

import locret  # noqa: F401  (points llama_cpp at our library)
from locret import eviction, models
from locret.heads import HeadsError
from locret.llama import Llama
from locret.serve import free_port

from conftest import run, tool

MIB = 1 << 20
UB = 128


def created(model_path, **kw) -> Llama:
    args = dict(n_ctx=8192, n_batch=UB, n_ubatch=UB, verbose=False, n_threads=1, n_threads_batch=1)
    args.update(kw)
    return Llama(model_path=str(model_path), **args)


def allocated(llm: Llama) -> dict:
    """What the context holds: K/V bytes of its cache tensors, and its Locret stores' buffers."""
    b = eviction.locret_buffers(llm._ctx.ctx)
    return dict(kv=llm.locret_stats()["kv_bytes"], scores=b["score_store"], queries=b["query_store"])


def per_seq_total(r: dict) -> int:
    return r["kv_bytes"] + r["window_bytes"] + r["store_bytes"]


def gemma_or_skip():
    if not models.is_installed("gemma3-270m"):
        pytest.skip("gemma3-270m is not installed")
    return models.resolve("gemma3-270m", fetch=False), models.shipped_heads("gemma3-270m")


# (model, settings): the heads' store, a policy that also stores queries, a schedule (the cache is
# sized for its largest layer), an 8-bit cache, and a sliding-window model whose window layers have their own cache
CASES = {
    "heads": ("smollm2", dict(locret_budget=640)),
    "snapkv": ("smollm2", dict(locret_budget=640, locret_stabilizers=64, locret_policy="snapkv")),
    "pyramid": ("smollm2", dict(locret_budget=640, locret_stabilizers=16, locret_budget_schedule="pyramid")),
    "q8_0": ("smollm2", dict(locret_budget=640, type_k=8, type_v=8, flash_attn=True)),
    "gemma iswa": ("gemma", dict(locret_budget=1024, swa_full=False)),
    "gemma full window": ("gemma", dict(locret_budget=1024, swa_full=True)),
}


def case_model(name, model_path, heads_file):
    if name == "gemma":
        return gemma_or_skip()
    return model_path, heads_file


@pytest.mark.parametrize("case", list(CASES))
def test_the_rule_books_memory_is_what_a_context_allocates(model_path, heads_file, case):
    which, settings = CASES[case]
    model, heads = case_model(which, model_path, heads_file)
    llm = created(model, locret_heads=heads, **settings)
    got = allocated(llm)
    kw = {k.removeprefix("locret_"): v for k, v in settings.items() if k.startswith("locret_")}
    kv_type = "q8_0" if settings.get("type_k") == 8 else "f16"
    r = eviction.resolve_file(model, heads=heads, n_ctx=8192, n_ubatch=UB, kv_type=kv_type,
                              swa_full=settings.get("swa_full"), **kw)
    assert r["n_cells"] == llm.locret_stats()["n_cells"]
    # K/V: exactly the bytes of the cache's tensors (evicting and window layers)
    assert r["kv_bytes"] + r["window_bytes"] == got["kv"], (r, got)
    assert sum(r["layer_kv_bytes"]) == got["kv"]
    if case == "gemma full window":
        assert r["n_cells_window"] == r["n_cells"] and r["window_bytes"] > 0
    elif which == "gemma":
        assert 0 < r["n_cells_window"] < r["n_cells"] and r["window_bytes"] > 0
        # a window layer holds n_cells_window rows, an evicting one n_cells: two sizes among the layers
        assert len({b for b in r["layer_kv_bytes"] if b}) == 2
    else:
        assert r["window_bytes"] == 0 and r["n_cells_window"] == 0
    # the stores: their buffers, up to the backend's alignment
    stores = got["scores"] + got["queries"]
    assert abs(r["store_bytes"] - stores) <= 4096, (r, got)
    assert r["store_bytes"] > 0


def test_the_planner_places_the_bytes_the_rule_book_gives(model_path):
    """locret plan's per-layer KV (what it places on devices) is the rule book's, window layers included."""
    from locret.planner import Settings, kv_bytes_per_layer, predict_kv_bytes, sized
    from locret.planner.inputs import read_model

    for model in (model_path, gemma_or_skip()[0]):
        facts = read_model(model)
        s = sized(facts, Settings(size_class="test", size_class_covers=True, context=8192, budget=1024, ubatch=UB,
                                  stabilizers=64, kv_type="f16", gpu_layers=0, overridden=(), slots=2))
        r = eviction.resolve_file(model, budget=1024, stabilizers=64, n_ctx=2 * 8192, n_ubatch=UB, n_seq=2,
                                  n_batch=UB, swa_full=False)  # the tools' window cache, which the planner plans for
        assert kv_bytes_per_layer(facts, s) == [2 * b for b in r["layer_kv_bytes"]]
        assert predict_kv_bytes(facts, s) == 2 * (r["kv_bytes"] + r["window_bytes"])


# (model, settings, MiB): sizes that fall inside a 256-cell step, a schedule, an 8-bit cache, a sliding-window model
FITS = {
    "heads 30 MiB": ("smollm2", {}, 30.0),
    "streaming 47.5 MiB, ub 512": ("smollm2", dict(policy="streaming", n_ubatch=512), 47.5),
    "pyramid": ("smollm2", dict(budget_schedule="pyramid", stabilizers=16), 40.0),
    "q8_0": ("smollm2", dict(kv_type="q8_0"), 30.0),
    "gemma iswa": ("gemma", dict(swa_full=False), 20.0),
}


@pytest.mark.parametrize("case", list(FITS))
def test_the_budget_for_a_size_fits_it_and_one_unit_more_does_not(model_path, heads_file, case):
    which, settings, mib = FITS[case]
    model, heads = case_model(which, model_path, heads_file)
    kw = dict(n_ctx=65536, n_ubatch=UB)
    kw.update(settings)
    r = eviction.budget_for_mib(model, mib, heads=heads, **kw)
    assert per_seq_total(r) <= mib * MIB
    assert per_seq_total(eviction.resolve_file(model, heads=heads, budget=r["budget"], **kw)) == per_seq_total(r)
    above = eviction.resolve_file(model, heads=heads, budget=r["budget"] + 1, **kw)
    assert per_seq_total(above) > mib * MIB, (r, above)
    if case == "pyramid":
        # a cache per distinct budget: the smaller budgets' caches grow unit by unit, the largest's by 256 cells
        assert above["kv_bytes"] > r["kv_bytes"]
    else:
        assert above["n_cells"] > r["n_cells"]


def test_a_context_made_with_a_size_holds_at_most_that_size(model_path, heads_file):
    mib = 30.0
    llm = created(model_path, locret_heads=heads_file, locret_budget_mib=mib)
    st, got = llm.locret_stats(), allocated(llm)
    assert st["budget"] == eviction.budget_for_mib(model_path, mib, heads=heads_file, n_ctx=8192, n_ubatch=UB)["budget"]
    assert got["kv"] + got["scores"] + got["queries"] <= mib * MIB
    # 256 cells more (what one more unit costs) would not fit
    per_cell = (got["kv"] + got["scores"]) / st["n_cells"]
    assert got["kv"] + got["scores"] + 256 * per_cell > mib * MIB


def test_a_size_too_small_names_the_smallest_that_works(model_path, heads_file):
    with pytest.raises(HeadsError) as e:
        eviction.budget_for_mib(model_path, 2.0, heads=heads_file, n_ctx=8192, n_ubatch=UB)
    m = re.search(r"needs ([0-9.]+) MiB", str(e.value))
    assert "too small" in str(e.value) and m, str(e.value)
    smallest = float(m.group(1))
    assert smallest > 2.0
    assert eviction.budget_for_mib(model_path, smallest + 0.01, heads=heads_file, n_ctx=8192, n_ubatch=UB)["budget"] >= 1


@pytest.mark.parametrize("settings, message", [
    (dict(budget_schedule="pyramid", policy="sage"), "SAGE-KV's cache holds the whole prompt"),
    (dict(policy="sage"), "SAGE-KV's cache holds the whole prompt"),
    (dict(pool=4), "must be odd"),
])
def test_sizes_the_rule_book_cannot_resolve_are_refused(model_path, heads_file, settings, message):
    with pytest.raises(HeadsError, match=re.escape(message)):
        eviction.budget_for_mib(model_path, 40.0, heads=heads_file, n_ctx=8192, n_ubatch=UB, **settings)


def test_a_schedule_file_and_a_size_are_refused(model_path, heads_file, tmp_path):
    schedule = tmp_path / "schedule.txt"
    schedule.write_text(" ".join(["640"] * 30))
    with pytest.raises(HeadsError, match="sets the budget itself"):
        eviction.budget_for_mib(model_path, 40.0, heads=heads_file, n_ctx=8192, n_ubatch=UB, budget_schedule=schedule)
    with pytest.raises(HeadsError, match="not both"):
        created(model_path, locret_heads=heads_file, locret_budget=640, locret_budget_mib=30)


def test_the_tools_resolve_a_size_and_refuse_bad_ones(model_path, heads_file):
    base = [tool("llama-completion"), "-m", model_path, "--locret-heads", heads_file, "-ub", str(UB), "-b", str(UB),
            "-c", "8192", "-p", "hi", "-n", "1", "-no-cnv", "-lv", "4"]
    proc = run(base + ["--locret-budget-mib", "30"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = eviction.budget_for_mib(model_path, 30, heads=heads_file, n_ctx=8192, n_ubatch=UB)
    assert f"--locret-budget-mib 30 resolves to a budget of {r['budget']} units: {r['n_cells']} KV cells" in proc.stderr
    cells = re.search(r"-> (\d+) KV cells per sequence", proc.stderr)
    assert cells and int(cells.group(1)) == r["n_cells"], proc.stderr[-3000:]
    for extra, message in ((["--locret-budget-mib", "thirty"], "is not a size in MiB"),
                           (["--locret-budget-mib", "0"], "is not a size in MiB"),
                           (["--locret-budget-mib", "1"], "is too small"),
                           (["--locret-budget-mib", "30", "--locret-budget", "640"], "not both")):
        proc = run(base + extra, timeout=120)
        assert proc.returncode != 0 and message in proc.stderr, (extra, proc.stderr[-2000:])
        assert "Aborted" not in proc.stderr


def test_the_server_gives_every_slot_the_budget_a_size_resolves_to(model_path, heads_file):
    """-np with a size: each slot gets its own budget (the server's slot count does not fall back to a unified cache)."""
    import subprocess

    port = free_port()
    server = subprocess.Popen([tool("llama-server"), "-m", str(model_path), "--locret-heads", str(heads_file),
                               "--locret-budget-mib", "30", "-np", "2", "-c", "16384", "-ub", str(UB), "-b", str(UB),
                               "--port", str(port), "-t", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            assert server.poll() is None, server.stderr.read()[-3000:]
            import time
            time.sleep(0.2)
        with urllib.request.urlopen(url + "/slots", timeout=10) as resp:
            slots = json.loads(resp.read())
        r = eviction.budget_for_mib(model_path, 30, heads=heads_file, n_ctx=8192, n_ubatch=UB, n_seq=2,
                                    n_batch=UB)
        assert len(slots) == 2
        assert [s["locret"]["budget"] for s in slots] == [r["budget"]] * 2
        assert [s["locret"]["n_cells"] for s in slots] == [r["n_cells"]] * 2
    finally:
        server.terminate()
        server.wait(timeout=30)
