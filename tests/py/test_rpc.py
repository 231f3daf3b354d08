"""Eviction over llama.cpp's RPC backend: two ggml-rpc-server processes on 127.0.0.1 hold every layer and its cache.

The Python parity run (kept sets after every call, greedy tokens, a Locret-Q run, a state round trip) is
experiments/rpc_check.py in a process of its own: registered RPC devices stay for the process, and a later model load in
a test worker would reach for servers that are gone. llama-completion and llama-server are run here with --rpc.
"""
from __future__ import annotations

import json
import os
import re
import sys
import threading

import pytest
from conftest import REPO, free_port, http_server, post_json, run, tool

from locret import rpc
from locret.heads import HeadsError

BUDGET, UBATCH = 128, 32
EVICTION = re.compile(r"Locret eviction \d+ of sequence (\d+):")
DOCUMENT = (REPO / "scripts" / "data" / "harbor-log.txt").read_text()
SHIPPED_HEADS = REPO / "heads" / "smollm2-135m-instruct.gguf"


@pytest.mark.parametrize("select", ["default", "host"])
def test_rpc_runs_evict_as_the_local_cpu_run_does(select, tmp_path):
    # default: the selection runs on the servers (where the score store is); host: the client reads every layer's
    # scores from the servers, queued together and waited for once
    out = tmp_path / "rpc.json"
    env = dict(os.environ, **({"LOCRET_DEBUG_SELECT": "host"} if select == "host" else {}))
    proc = run([sys.executable, REPO / "experiments" / "rpc_check.py", "--tokens", "420", "--generate", "8",
                "--budget", BUDGET, "--ubatch", UBATCH, "--json", out], timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["failures"] == []
    # several evictions, every one compared: kept sets after each of the 14 calls of both runs (plain and Locret-Q)
    assert got["evictions"] >= 5 and got["snapshots"] >= 20
    assert got["tokens_local"] == got["tokens_rpc"] and len(got["tokens_rpc"]) == 8
    rpc_row = next(v for k, v in got["figures"].items() if k.startswith("RPC"))
    # one round trip per eviction on either side: the device selection's graph and read-back go together, the host's
    # selection reads the scores after one wait, and neither waits for its compaction
    assert rpc_row["host_syncs_per_eviction"] == 1.0 and got["figures"]["local CPU"]["host_syncs_per_eviction"] == 1.0
    assert "RPC / local prefill speed" in proc.stdout


def test_the_parity_check_catches_a_different_kept_set():
    # the comparison the parity run relies on fails on a single moved unit, on other tokens and other evictions
    sys.path.insert(0, str(REPO / "scripts"))
    import rpc_check

    base = {"kept": [[[[0, 1, 2]]]], "tokens": [5, 6], "stats": {"n_evictions": 3}}
    same = json.loads(json.dumps(base))
    failures: list[str] = []
    rpc_check.compare("x", base, same, failures)
    assert failures == []
    for change in ({"kept": [[[[0, 1, 3]]]]}, {"tokens": [5, 7]}, {"stats": {"n_evictions": 4}}):
        failures = []
        rpc_check.compare("x", base, {**same, **change}, failures)
        assert len(failures) == 1, change


def completion(model_path, heads, prompt_file, *extra):
    return run([tool("llama-completion"), "-m", model_path, "--locret-heads", heads, "--locret-budget", BUDGET,
                "-ub", UBATCH, "-b", UBATCH, "-c", 2048, "-fa", "on", "-f", prompt_file,
                "-n", 16, "--temp", 0, "--seed", 1, "-no-cnv", "--no-display-prompt", "-t", 1, "-lv", 5, *extra],
               timeout=600)


def test_llama_completion_over_rpc_gives_the_local_tokens(model_path, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(DOCUMENT[:1800])  # ~450 tokens: about eight evictions at b = 128, ub = 32
    local = completion(model_path, SHIPPED_HEADS, prompt)
    assert local.returncode == 0, local.stderr[-3000:]
    with rpc.RpcServers(2, log_dir=tmp_path) as servers:
        remote = completion(model_path, SHIPPED_HEADS, prompt, "--rpc", servers.servers, "-ngl", 99)
        assert servers.alive()
    assert remote.returncode == 0, remote.stderr[-3000:]
    # every layer went to the two servers, and the evictions ran there
    assert re.search(r"offloaded (\d+)/\1 layers to GPU", remote.stderr), remote.stderr[-3000:]
    assert "RPC0" in remote.stderr and "RPC1" in remote.stderr
    n_local, n_remote = len(EVICTION.findall(local.stderr)), len(EVICTION.findall(remote.stderr))
    assert n_local >= 5 and n_remote == n_local
    assert remote.stdout.strip() and remote.stdout == local.stdout


def test_llama_server_serves_two_slots_over_rpc(model_path, tmp_path):
    port = free_port()
    with rpc.RpcServers(2, log_dir=tmp_path) as servers:
        cmd = [tool("llama-server"), "-m", model_path, "--locret-heads", SHIPPED_HEADS, "--locret-budget", BUDGET,
               "-ub", UBATCH, "-b", UBATCH, "-c", 4096, "-np", 2, "-fa", "on", "-t", 1, "--rpc", servers.servers,
               "-ngl", 99, "--port", port, "-lv", 5]
        log = tmp_path / "server.log"
        with http_server(cmd, log, port, startup_s=180) as url:
            results: dict[int, dict] = {}
            prompts = [DOCUMENT[:1600] + "\nThe first ship named above is", DOCUMENT[1000:2600] + "\nIn short,"]

            def ask(i: int) -> None:
                results[i] = post_json(url + "/completion", {"prompt": prompts[i], "n_predict": 8, "temperature": 0,
                                                             "cache_prompt": False})

            threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=600)
            text = log.read_text()
        assert servers.alive()
    assert sorted(results) == [0, 1]
    for r in results.values():
        assert r["tokens_predicted"] == 8 and r["content"], r
    # both slots evicted, each in its own sequence, on the layers behind RPC
    per_slot: dict[int, int] = {}
    for m in EVICTION.finditer(text):
        per_slot[int(m.group(1))] = per_slot.get(int(m.group(1)), 0) + 1
    assert sorted(per_slot) == [0, 1] and min(per_slot.values()) >= 3, per_slot
    assert re.search(r"offloaded (\d+)/\1 layers to GPU", text)


def test_unreachable_or_malformed_rpc_servers_are_refused(model_path):
    from locret.llama import Llama

    with pytest.raises(rpc.RpcError, match="is not host:port"):
        Llama(str(model_path), rpc_servers="localhost", n_gpu_layers=99, verbose=False)
    with pytest.raises(rpc.RpcError, match="cannot be reached"):
        Llama(str(model_path), rpc_servers=f"127.0.0.1:{free_port()}", n_gpu_layers=99, verbose=False)
    assert not issubclass(rpc.RpcError, HeadsError)  # a refusal of its own kind, not a heads problem
