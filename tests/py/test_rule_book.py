"""The rule book: every refusal and every KV size of an evicting context is decided once, in the library
(llama_locret_check_params, llama_locret_kv_cells, llama_locret_fit_n_ctx), and the tools, the planner and Python
ask it. These tests check that what a caller is told (cells, refusals) is what a context really does when it is
created with the same settings: the allocated cells are read from the created context, and each refusal's message
is compared with the one context creation gives.
"""
from __future__ import annotations

import ctypes
import re

import llama_cpp
import pytest

import locret  # noqa: F401  (points llama_cpp at our library)
from locret import eviction
from locret.heads import HeadsError
from locret.llama import Llama

from conftest import run, tool

UB = 128


def created(model_path, heads, **kw) -> Llama:
    args = dict(n_ctx=4096, n_batch=UB, n_ubatch=UB, verbose=False, n_threads=1, n_threads_batch=1,
                locret_heads=heads)
    args.update(kw)
    return Llama(model_path=str(model_path), **args)


def padded(n: int) -> int:
    return -(-n // 256) * 256


# (settings, uniform cells that a rule written as "b + ubatch" would give): each case allocates something else
SIZES = {
    "uniform": (dict(locret_budget=256), None),
    "pyramid": (dict(locret_budget=1024, locret_stabilizers=16, locret_budget_schedule="pyramid"), padded(1024 + UB)),
    "sage": (dict(locret_budget=256, locret_policy="sage"), padded(256 + UB)),
    "lagkv": (dict(locret_budget=512, locret_policy="lagkv:lag=64"), None),
}


@pytest.mark.parametrize("case", list(SIZES))
def test_the_planned_cells_are_the_cells_a_context_allocates(model_path, heads_file, case):
    settings, naive = SIZES[case]
    llm = created(model_path, heads_file, **settings)
    allocated = llm.locret_stats()["n_cells"]
    if naive is not None:
        assert allocated != naive, "the case must tell the rule book from b + ubatch"
    kw = {k.removeprefix("locret_"): v for k, v in settings.items()}
    assert eviction.planned_kv_cells(model_path, heads=heads_file, n_ctx=4096, n_ubatch=UB, **kw) == allocated
    # two sequences: twice the cells (one stream each)
    assert eviction.planned_kv_cells(model_path, heads=heads_file, n_ctx=8192, n_ubatch=UB, n_seq=2, **kw) == 2 * allocated

    # the C API on a loaded model gives the same count per sequence
    api = eviction._api()
    policy, policy_settings = eviction.parse_policy(kw.get("policy", "heads"))
    p = eviction._Params(heads=None, budget=kw["budget"], stabilizers=kw.get("stabilizers", -1), local=-1,
                         policy=policy, pool=-1, policy_settings=policy_settings.encode() or None,
                         budget_schedule=kw.get("budget_schedule", "uniform").encode())
    if kw.get("policy", "heads") == "heads":  # the heads' recommended settings are the defaults
        assert api.llama_locret_file_recommended(str(heads_file).encode(), ctypes.byref(p.defaults)) >= 0
    assert api.llama_locret_kv_cells(llm.model, ctypes.byref(p), 4096, UB) == allocated


# settings every caller must refuse with the message context creation gives
REFUSED = {
    "4-bit K cache": (dict(locret_budget=256, type_k=llama_cpp.GGML_TYPE_Q4_0), dict(kv_type="q4_0"),
                      "K cache loses what it holds"),
    "stabilizers past the ubatch": (dict(locret_budget=512, locret_stabilizers=200), {}, "must fit in one ubatch"),
    "even pooling window": (dict(locret_budget=256, locret_pool=4), {}, "must be odd"),
    "pooling without heads": (dict(locret_budget=256, locret_policy="random", locret_pool=5), {},
                              "policy random has none to pool"),
    "SnapKV budget within its window": (dict(locret_budget=32, locret_stabilizers=16, locret_policy="snapkv"), {},
                                        "must be larger than its observation window"),
    "LagKV budget too small": (dict(locret_budget=64, locret_policy="lagkv"), {}, "must exceed what it keeps unscored"),
    "LagKV partition too large for the budget": (dict(locret_budget=128, locret_policy="lagkv:lag=64"), {},
                                                 "(lower lagkv:lag or --locret-stabilizers, or raise the budget)"),
    "settings for a policy without any": (dict(locret_budget=256, locret_policy="streaming:lag=4"), {},
                                          "policy streaming has no settings (got 'lag=4')"),
    "a setting the policy does not have": (dict(locret_budget=256, locret_policy="snapkv:windw=16"), {},
                                           "policy snapkv has no setting 'windw'"),
    "a setting out of its range": (dict(locret_budget=256, locret_policy="lagkv:lag=1"), {},
                                   "lagkv:lag must be an integer from 2 to 65536 (got '1')"),
    "SAGE-KV in a short context": (dict(locret_budget=4000, locret_policy="sage"), {}, "must be larger than the budget plus"),
    "schedule with SAGE-KV": (dict(locret_budget=256, locret_policy="sage", locret_budget_schedule="pyramid"), {},
                              "a budget schedule works with the heads, random and streaming policies, not sage"),
    "unreadable schedule file": (dict(locret_budget=256, locret_budget_schedule="/nonexistent/schedule.txt"), {},
                                 "is neither uniform, pyramid nor a readable file"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_refusal_is_the_same_for_every_caller(model_path, heads_file, case):
    settings, planner_kw, message = REFUSED[case]
    with pytest.raises(HeadsError) as at_creation:
        created(model_path, heads_file, **settings)
    assert message in str(at_creation.value)
    kw = {k.removeprefix("locret_"): v for k, v in settings.items() if k.startswith("locret_")}
    with pytest.raises(HeadsError) as planned:
        eviction.planned_kv_cells(model_path, heads=heads_file, n_ctx=4096, n_ubatch=UB, **kw, **planner_kw)
    # the same rule, word for word (creation may add its own prefix)
    assert str(planned.value) in str(at_creation.value), (str(planned.value), str(at_creation.value))


def test_fit_plans_a_pyramid_schedule_with_the_bytes_its_caches_allocate(model_path, heads_file):
    """-fit used to plan b + ubatch cells for a schedule, then the largest layer budget plus a chunk in every layer;
    a schedule's layers now sit in a cache per budget, and -fit (which sizes the same cells in every layer) plans the
    cells that hold those bytes."""
    proc = run([tool("llama-completion"), "-m", model_path, "--locret-heads", heads_file, "--locret-budget", "1024",
                "--locret-stabilizers", "16", "--locret-budget-schedule", "pyramid", "-c", "1000000", "-b", "128",
                "-ub", "128", "-fit", "on", "-lv", "4", "-p", "hi", "-n", "1", "-no-cnv"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fitted = re.search(r"Locret: fitting with (\d+) KV cells instead of -c 1000000", proc.stderr)
    allocated = re.search(r"-> (\d+) KV cells per sequence, 1 sequence", proc.stderr)
    assert fitted and allocated, proc.stderr[-3000:]
    r = eviction.resolve_file(model_path, heads=heads_file, budget=1024, stabilizers=16, budget_schedule="pyramid",
                              n_ctx=1000000, n_ubatch=128, n_batch=128)
    n_layer = len(r["layer_kv_bytes"])
    assert int(allocated.group(1)) == r["n_cells"] == padded(max(r["layer_budgets"]) + 128)
    cell_bytes = 2 * 2 * 192 * n_layer  # SmolLM2: K and V of 3 KV heads x 64, F16, every layer
    assert int(fitted.group(1)) == -(-r["kv_bytes"] // cell_bytes) < r["n_cells"], (fitted.group(1), r)


def test_fit_stops_on_settings_the_rule_book_refuses(model_path, heads_file):
    proc = run([tool("llama-completion"), "-m", model_path, "--locret-heads", heads_file, "--locret-budget", "256",
                "--locret-pool", "4", "-fit", "on", "-p", "hi", "-n", "1", "-no-cnv"], timeout=120)
    assert proc.returncode != 0 and "must be odd" in proc.stderr, proc.stderr[-2000:]
    assert "Aborted" not in proc.stderr


def test_the_policies_come_from_one_registry(model_path):
    names = eviction.policies()
    assert names == ("heads", "random", "streaming", "lagkv", "sage", "snapkv")
    assert eviction.POLICIES == names
    proc = run([tool("llama-completion"), "--help"], timeout=60)
    assert proc.returncode == 0
    shown = " ".join(proc.stdout.split())  # the tools wrap their help
    for name in names:
        help_line = eviction.policy_help(name)
        assert help_line and f"{name}: {help_line}" in shown, (name, help_line)
    with pytest.raises(HeadsError, match="valid policies: heads, random, streaming, lagkv, sage, snapkv"):
        eviction.policy_value("snapkv-typo")
    with pytest.raises(HeadsError, match="valid policies: heads, random, streaming, lagkv, sage, snapkv"):
        eviction.policy_value("snapkv-typo:window=16")
    # each policy's settings are its own: named by the registry's help, nowhere else
    for name in names:
        settings_help = eviction.policy_settings_help(name)
        if name in ("lagkv", "snapkv"):
            assert settings_help and "\n" not in settings_help, (name, settings_help)
        else:
            assert settings_help == "", (name, settings_help)
    assert "lag=" in eviction.policy_settings_help("lagkv") and "default 128" in eviction.policy_settings_help("lagkv")
    assert all(f"{key}=" in eviction.policy_settings_help("snapkv") for key in ("window", "question", "pool"))
