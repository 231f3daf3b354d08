"""A policy's own settings: "NAME:key=value[,key=value...]" after its name (--locret-policy, locret_policy=), parsed
and checked by the policy in the library (llama_locret_policy_from_spec), reported as resolved
(locret_stats()["policy_settings"]). Python builds nothing of its own: it passes the string through, so every
refusal here is the library's, naming the key. What a setting changes is tested with its policy (test_lagkv.py,
test_snapkv.py: the kept sets against numpy, the state files refused under other settings, the tools' options).
"""
from __future__ import annotations

import re

import pytest

import locret  # noqa: F401  (points llama_cpp at our library)
from locret import eviction
from locret.heads import HeadsError
from locret.llama import Llama

UB = 64


def make(model_path, **kw) -> Llama:
    args = dict(n_ctx=4096, n_batch=UB, n_ubatch=UB, locret_budget=256, verbose=False, n_threads=1,
                n_threads_batch=1)
    args.update(kw)
    return Llama(model_path=str(model_path), **args)


def test_a_policy_with_settings_parses_into_its_value_and_the_settings():
    lagkv, snapkv = eviction.policies().index("lagkv"), eviction.policies().index("snapkv")
    assert eviction.parse_policy("lagkv") == (lagkv, "")
    assert eviction.parse_policy("lagkv:lag=32") == (lagkv, "lag=32")
    assert eviction.parse_policy("snapkv:window=16,question=32,pool=3") == (snapkv, "window=16,question=32,pool=3")
    assert eviction.policy_value("lagkv:lag=32") == lagkv
    assert eviction.parse_policy("heads") == (0, "")


@pytest.mark.parametrize("spec, message", [
    ("lagkv:lags=3", "policy lagkv has no setting 'lags' (its settings: lag)"),
    ("lagkv:lag=x", "lagkv:lag must be an integer from 2 to 65536 (got 'x')"),
    ("lagkv:lag=1", "lagkv:lag must be an integer from 2 to 65536 (got '1')"),
    ("lagkv:lag=", "lagkv:lag must be an integer from 2 to 65536 (got '')"),
    ("lagkv:lag=16,lag=32", "lagkv:lag is given twice"),
    ("lagkv:lag", "policy settings are key=value pairs separated by commas (got 'lag')"),
    ("heads:lag=4", "policy heads has no settings (got 'lag=4')"),
    ("sage:window=16", "policy sage has no settings (got 'window=16')"),
    ("snapkv:lag=16", "policy snapkv has no setting 'lag'"),
    ("lagkv2:lag=16", "valid policies: heads, random, streaming, lagkv, sage, snapkv"),
])
def test_settings_a_policy_does_not_take_are_refused_naming_the_key(spec, message, model_path):
    with pytest.raises(HeadsError, match=re.escape(message)):
        eviction.parse_policy(spec)
    # the same refusal from the planner's rule book and from locret.Llama, before any model is read
    with pytest.raises(HeadsError, match=re.escape(message)):
        eviction.planned_kv_cells(model_path, budget=256, policy=spec, n_ctx=4096, n_ubatch=UB)
    with pytest.raises(HeadsError, match=re.escape(message)):
        make(model_path, locret_policy=spec)


def test_the_settings_a_context_runs_with_are_reported(model_path):
    for policy, resolved in (("lagkv:lag=32", "lag=32"), ("lagkv", "lag=128"), ("streaming", "")):
        llm = make(model_path, locret_budget=512, locret_policy=policy)
        stats = llm.locret_stats()
        assert stats["policy"] == policy.partition(":")[0] and stats["policy_settings"] == resolved, stats
        # what the rule book plans for the settings is what the context allocates
        assert eviction.planned_kv_cells(model_path, budget=512, policy=policy, n_ctx=4096,
                                         n_ubatch=UB) == stats["n_cells"]
        llm.close()


def test_each_policy_lists_its_own_settings():
    for name in eviction.policies():
        help_line = eviction.policy_settings_help(name)
        keys = re.findall(r"(?:^|; )(\w+)=N: ", help_line)
        defaults = [int(d) for d in re.findall(r"default (\d+)\)", help_line)]
        assert len(keys) == len(defaults), help_line
        # one default per key, and the defaults given back as settings are taken
        if keys:
            spec = f"{name}:" + ",".join(f"{k}={d}" for k, d in zip(keys, defaults))
            assert eviction.parse_policy(spec)[1] == spec.partition(":")[2]
    assert eviction.policy_settings_help("heads") == ""
    assert re.findall(r"(?:^|; )(\w+)=N: ", eviction.policy_settings_help("lagkv")) == ["lag"]


def test_a_keyword_locret_llama_does_not_know_is_refused(model_path):
    # llama_cpp.Llama takes any keyword and ignores it: a Locret setting that is now part of another would be dropped
    with pytest.raises(HeadsError, match=r"locret.Llama has no argument locret_lag: a policy's own settings follow its "
                                         r"name in locret_policy"):
        make(model_path, locret_policy="lagkv", locret_lag=64)


def test_locret_serve_passes_a_policy_with_settings_and_refuses_an_unknown_one(model_path):
    import subprocess
    import sys

    def serve(policy):
        return subprocess.run([sys.executable, "-m", "locret", "serve", "--model", str(model_path), "--policy", policy,
                               "--print-command"], capture_output=True, text=True, timeout=120)
    proc = serve("lagkv:lag=32")
    assert proc.returncode == 0, proc.stderr
    cmd = proc.stdout.split()
    assert cmd[cmd.index("--locret-policy") + 1] == "lagkv:lag=32"
    assert "--locret-heads" not in cmd  # LagKV reads no heads (its traits say so)
    proc = serve("lagkv:lags=3")
    assert proc.returncode == 2 and "policy lagkv has no setting 'lags' (its settings: lag)" in proc.stderr
    proc = serve("nope")
    assert proc.returncode == 2 and "valid policies: heads" in proc.stderr, proc.stderr
