"""The GPU check's pieces, run here on the CPU (a GPU session runs them for real: scripts/gpu_check.sh).

- bench_eviction.py --positions passes each layout to llama-bench and reads its row counts: kept positions move fewer
  rows than compact positions and re-rotate none on the same prompt; its decode figures span one eviction cycle;
  --decode-split's figure with the heads' graph evicts nothing, and the split it prints adds up to Locret's token;
- backend_check.py's child run saves the last logits and every (layer, KV head)'s kept positions, and its comparison
  counts shared units and logit differences exactly;
- gpu_check.sh refuses unknown stages and arguments, and backend_check.py unknown checks, with exit 2 before doing
  anything;
- gpu_train.sh packs each model with recipes (SmolLM2, Gemma-3) in parts that one call of the device tool carries each
  and that join to it byte for byte, refuses a part from another pack, a damaged or missing one and another model, and
  trains each recipe (two steps on the CPU here).
"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO


def test_bench_eviction_measures_each_positions_layout(model_path, monkeypatch, tmp_path):
    import bench_eviction  # scripts/, on sys.path through conftest

    args = bench_eviction.parse(["--model", str(model_path), "--budget", "256", "--ubatch", "128", "--threads", "1",
                                 "--heads", str(REPO / "heads" / "smollm2-135m-instruct.gguf")])
    bench_eviction.apply_device(args)
    rows = {pos: bench_eviction.bench(args, locret=True, prompt=768, gen=0, depth=0, positions=pos)
            for pos in ("keep", "compact")}
    for r in rows.values():
        assert r["compactions"] >= 3 and r["rows_kept"] > 0
    assert rows["keep"]["rows_kept"] == rows["compact"]["rows_kept"]       # the same evictions
    assert rows["keep"]["rows_rotated"] == 0 < rows["compact"]["rows_rotated"]
    assert rows["keep"]["rows_moved"] < 0.6 * rows["compact"]["rows_moved"]
    with pytest.raises(SystemExit, match="llama-bench failed"):
        bench_eviction.bench(args, locret=True, prompt=256, gen=0, depth=0, positions="sideways")

    # the compaction graphs' profile: one line per compaction; the layers stacked, a few nodes in all (SmolLM2's 30
    # layers took 16 each before: test_compaction_stack.py compares both forms)
    prof = bench_eviction.bench(args, locret=True, prompt=768, gen=0, depth=0, positions="compact", profile=True)
    assert prof["profiled_compactions"] == prof["compactions"] >= 3
    assert 4 <= prof["compaction_nodes"] <= 16  # K (gathered, re-rotated, written), V and scores: one op each
    # the graph built layer by layer, which the profile table sets beside it: the same compactions, nodes per layer
    per_layer = bench_eviction.bench(args, locret=True, prompt=768, gen=0, depth=0, positions="compact", profile=True,
                                     per_layer=True)
    assert per_layer["compactions"] == prof["compactions"] and per_layer["compaction_nodes"] >= 30 * 3
    assert min(prof["build_ms"], prof["alloc_ms"], prof["inputs_ms"], prof["launch_ms"]) >= 0
    # the host's keep lists and moves: one figure per eviction, with the host's selection too
    assert prof["profiled_choices"] == prof["compactions"] and prof["keep_lists_ms"] >= 0
    assert "profiled_compactions" not in rows["compact"]  # without profile, no LOCRET_PROFILE
    assert "profiled_selections" not in prof  # the CPU selects on the host by default

    # with the selection on the device (a GPU's default; forced here), one selection line per eviction is read
    # (and --save-stderr keeps the run's own log, the lines the figures were read from)
    monkeypatch.setenv("LOCRET_DEBUG_SELECT", "graph")
    args.save_stderr = str(tmp_path / "runs")
    prof = bench_eviction.bench(args, locret=True, prompt=768, gen=0, depth=0, positions="compact", profile=True)
    assert prof["profiled_selections"] == prof["profiled_compactions"] == prof["compactions"] >= 3
    assert prof["select_alloc_ms"] >= 0 and prof["select_wait_ms"] >= 0
    saved = list((tmp_path / "runs").iterdir())
    assert [f.name for f in saved] == ["locret-heads-compact-p768-n0-d0-profile.stderr"]
    assert saved[0].read_text().count("locret-profile: compaction build") == prof["profiled_compactions"]



def test_bench_eviction_decode_figures_span_one_eviction_cycle(model_path):
    # a decode figure of fewer tokens than the ubatch holds a decode-time eviction or not by the phase the prompt
    # left (on an H200, 64 tokens after 128K: one in kept positions, none in compact ones); the default, B tokens,
    # holds one in every layout
    import bench_eviction  # scripts/, on sys.path through conftest

    args = bench_eviction.parse(["--model", str(model_path), "--budget", "256", "--ubatch", "64", "--threads", "1",
                                 "--heads", str(REPO / "heads" / "smollm2-135m-instruct.gguf")])
    bench_eviction.apply_device(args)
    assert args.decode_tokens == args.ubatch == 64
    for pos in ("keep", "compact"):
        r = bench_eviction.bench(args, locret=True, prompt=0, gen=args.decode_tokens, depth=1024, positions=pos)
        assert r["compactions"] >= 1 and r["rows_kept"] > 0, pos
    with pytest.raises(SystemExit, match="--decode-tokens must be at least 1"):
        bench_eviction.apply_device(bench_eviction.parse(["--model", str(model_path), "--decode-tokens", "0"]))

def test_bench_eviction_decode_split(model_path, monkeypatch, capsys):
    # the split of a generated token's time: plain llama.cpp's, the heads' graph's (a figure that must not evict, or
    # the split is wrong), and the eviction's; its three parts add up to the Locret token's time
    import re

    import bench_eviction  # scripts/, on sys.path through conftest

    argv = ["--model", str(model_path), "--budget", "256", "--ubatch", "64", "--threads", "1", "--lengths", "512",
            "--plain-lengths", "512", "--decode-depth", "1024", "--decode-split",
            "--heads", str(REPO / "heads" / "smollm2-135m-instruct.gguf")]
    args = bench_eviction.parse(argv)
    bench_eviction.apply_device(args)
    budget = bench_eviction.no_evict_budget(args)
    # main() refuses a no-eviction figure that evicted or whose count it could not read (a decode figure that evicts
    # is counted: test_bench_eviction_decode_figures_span_one_eviction_cycle)
    monkeypatch.setattr(sys, "argv", ["bench_eviction.py", *argv])
    bench_eviction.main()  # exit status: the CPU misses the GPU targets; the figures are what is checked
    out = capsys.readouterr().out
    m = re.search(r"plain llama.cpp after 2560 ([\d.]+) ms; the heads' graph adds (-?[\d.]+) ms .* add (-?[\d.]+) ms; "
                  r"Locret ([\d.]+) ms", out)
    assert m, out[-2000:]
    plain, graph, evict, total = (float(x) for x in m.groups())
    assert plain > 0 and total == pytest.approx(plain + graph + evict, abs=0.002)
    assert f"decode after 2560, no eviction (b = {budget})" in out
    m = re.search(r"layer by layer instead of over the stacked heads adds (-?[\d.]+) ms a token \(stacked: (-?[\d.]+) ms\)",
                  out)
    assert m and float(m.group(2)) == pytest.approx(graph, abs=0.0011), out[-2000:]
    assert re.search(r"\| .*decode after 2560 without eviction, heads stacked / layer by layer \| \d+\.\d+ \|", out)
    # b + B = 320 is not 2560: Locret's decode is also set against plain llama.cpp's at the depth it attends to
    assert "| plain llama.cpp decode after 320 |" in out
    assert re.search(r"\| Locret decode after 1024 / plain decode after 320 \(the same attention depth\) \| \d+\.\d+ \|", out)


def test_backend_check_child_and_comparison(model_path, tmp_path):
    import backend_check

    cfg = dict(model=str(model_path), heads=str(REPO / "heads" / "smollm2-135m-instruct.gguf"), budget=64,
               ubatch=32, tokens=256, name="a", positions="keep", v="f16", fa=True, ngl=0, select=None)
    a = backend_check.run(cfg, tmp_path)
    again = backend_check.run({**cfg, "name": "again"}, tmp_path)  # one backend: deterministic
    assert not isinstance(a, str) and not isinstance(again, str), (a, again)
    assert a["logits"].shape == (49152,) and np.isfinite(a["logits"]).all()
    kept = [a[k] for k in a if k.startswith("kept_")]
    assert len(kept) == 30 * 3
    for k in kept:
        assert len(set(k.tolist())) == len(k) and 64 <= len(k) <= 64 + 32 and k.max() < 256 and k.min() >= 0
    assert backend_check.compare(a, again) == (1.0, pytest.approx(1.0), 0.0)
    b = dict(a, logits=a["logits"] + np.linspace(0, 1, len(a["logits"]), dtype=np.float32))
    share, cos, diff = backend_check.compare(a, b)
    assert share == 1.0 and diff == pytest.approx(1.0) and cos < 1.0
    # one unit swapped in one (layer, head): the shared share falls by exactly one unit
    c = dict(a)
    first = next(k for k in a if k.startswith("kept_"))
    c[first] = np.array(sorted(set(range(256)) - set(a[first].tolist())))[: len(a[first])]
    total = sum(len(k) for k in kept)
    assert backend_check.compare(a, c)[0] == pytest.approx((total - len(a[first])) / total)
    # the per-layer compaction in a child: the same kept units and logits as the stacked one (one backend)
    per_layer = backend_check.run({**cfg, "name": "per-layer", "per_layer": True}, tmp_path)
    assert backend_check.compare(a, per_layer) == (1.0, pytest.approx(1.0), 0.0)
    # the pyramid schedule's selection on the device's graph and on the host (both on this CPU): the same, and the
    # schedule reached the child (layer 0 keeps more than the budget, the last layer less)
    dev = backend_check.run({**cfg, "name": "dev-pyramid", "schedule": "pyramid", "select": "graph"}, tmp_path)
    host = backend_check.run({**cfg, "name": "host-pyramid", "schedule": "pyramid", "select": "host"}, tmp_path)
    assert backend_check.compare(dev, host) == (1.0, pytest.approx(1.0), 0.0)
    assert len(dev["kept_0_0"]) > len(a["kept_0_0"]) > len(dev["kept_29_0"])
    bad = backend_check.run({**cfg, "name": "bad", "model": str(tmp_path / "missing.gguf")}, tmp_path)
    assert isinstance(bad, str) and bad.startswith("failed")


@pytest.mark.parametrize("argv, message", [(["--stage", "measure"], "unknown stage measure"),
                                           (["--fast"], "unknown argument --fast")])
def test_gpu_check_refuses_bad_arguments(argv, message):
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), *argv], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 2 and message in proc.stderr


def test_backend_check_refuses_unknown_checks(capsys):
    import backend_check

    with pytest.raises(SystemExit) as e:
        backend_check.main(["--model", "m.gguf", "--heads", "h.gguf", "--checks", "selection,speed"])
    assert e.value.code == 2 and "--checks takes selection, cache and compaction" in capsys.readouterr().err


def _gpu_train(*argv, env=None, timeout=60):
    import os

    return subprocess.run(["bash", str(REPO / "scripts" / "gpu_train.sh"), *argv], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHON": sys.executable, **(env or {})})


def test_gpu_train_refuses_bad_arguments_and_missing_parts(tmp_path):
    proc = _gpu_train("--epochs", "3")
    assert proc.returncode == 2 and "unknown argument --epochs" in proc.stderr
    # the pack's parts were not carried (or the machine went back between the calls): said, before any work
    proc = _gpu_train("--device", "cpu", env={"LOCRET_GPU_TRAIN_PARTS": str(tmp_path / "none")})
    assert proc.returncode == 1 and f"{tmp_path / 'none'}-1/pack.part is missing" in proc.stderr
    assert not (tmp_path / "none-1").exists()
    # a model without recipes is refused before anything is written
    proc = _gpu_train("--pack", "--model", "llama-3.2-1b", env={"LOCRET_GPU_TRAIN_PARTS": str(tmp_path / "p")})
    assert proc.returncode == 1 and "--model llama-3.2-1b has no recipes here" in proc.stderr
    assert not (tmp_path / "p-1").exists()


def _packed(tmp_path, name):
    """--pack --model name into tmp_path/NAME-1..N: the parts, and each call's size as the script checked it"""
    env = {"LOCRET_GPU_TRAIN_PARTS": str(tmp_path / name), "LOCRET_GPU_TRAIN_WORK": str(tmp_path / f"work-{name}")}
    proc = _gpu_train("--pack", "--model", name, env=env)
    assert proc.returncode == 0, proc.stderr
    parts = sorted(tmp_path.glob(f"{name}-*/pack.part"), key=lambda f: int(f.parent.name.rsplit("-", 1)[1]))
    sizes = [int(line.rsplit(": ", 1)[1].split(" MiB")[0]) for line in proc.stderr.splitlines()
             if "MiB with the tree (the device tool takes 64)" in line]
    return env, parts, sizes


@pytest.mark.parametrize("name, n_parts, query", [("smollm2-135m", 2, True), ("gemma3-270m", 5, False)])
def test_gpu_train_packs_each_model_in_parts_that_one_call_carries(tmp_path, name, n_parts, query):
    """--pack cuts the model, gguf-py and the shipped heads its recipes start from into parts that each travel in one
    call of the device tool (64 MiB with the tree); joined, the archive holds the model byte for byte. The run refuses
    a missing part, a part of another pack, a damaged one, and a --model other than the one packed."""
    import hashlib
    import io
    import tarfile

    from locret import models

    env, parts, sizes = _packed(tmp_path, name)
    assert len(parts) == len(sizes) == n_parts and max(sizes) <= 64
    infos = [(f.parent / "pack.info").read_text().split() for f in parts]
    assert [i[:2] for i in infos] == [[str(k), str(n_parts)] for k in range(1, n_parts + 1)]
    assert {i[3] for i in infos} == {name}
    joined = b"".join(f.read_bytes() for f in parts)
    assert hashlib.sha256(joined).hexdigest() == infos[0][2]
    model = models.resolve(name)
    with tarfile.open(fileobj=io.BytesIO(joined)) as tar:
        assert tar.extractfile(f"pack/{model.name}").read() == model.read_bytes()
        assert tar.extractfile("pack/init.gguf").read() == models.shipped_heads(name, query=query).read_bytes()
        assert tar.extractfile("pack/model.file").read().decode().strip() == model.name
        assert "pack/gguf-py/gguf/__init__.py" in tar.getnames()

    other = "gemma3-270m" if name == "smollm2-135m" else "smollm2-135m"
    proc = _gpu_train("--device", "cpu", "--model", other, env=env)
    assert proc.returncode == 1 and f"the parts carried are {name}'s" in proc.stderr
    # a part of another pack (its line), then a damaged one (its bytes), then one not carried
    info = parts[-1].parent / "pack.info"
    good = info.read_text()
    info.write_text(good.replace(infos[0][2], "0" * 64))
    proc = _gpu_train("--device", "cpu", env=env)
    assert proc.returncode == 1 and "is a part of another --pack" in proc.stderr
    info.write_text(good)
    with open(parts[-1], "ab") as f:
        f.write(b"\0")
    proc = _gpu_train("--device", "cpu", env=env)
    assert proc.returncode == 1 and "sha256 differs" in proc.stderr
    parts[-1].unlink()
    proc = _gpu_train("--device", "cpu", env=env)
    assert proc.returncode == 1 and f"{parts[-1]} is missing" in proc.stderr


@pytest.mark.parametrize("name, runs", [("smollm2-135m", ("plain-scratch", "q-broad")),
                                        ("gemma3-270m", ("g-long", "g-real"))])
def test_gpu_train_trains_each_run(tmp_path, name, runs):
    """The packed model's runs, on the CPU with two steps each: each writes its heads GGUF (the Locret-Q runs'
    recommending the question found and pinned) and its log; Gemma's train its three full-attention layers only."""
    import json

    from locret.gguf_header import read_header

    env, _, _ = _packed(tmp_path, name)
    smoke = "--steps 2 --warmup-steps 1 --min-tokens 256 --max-tokens 512 --tasks passkey,fact --contexts pypackages"
    out = tmp_path / "out"
    proc = _gpu_train("--device", "cpu", "--runs", ",".join(runs), "--out", str(out), "--extra", smoke,
                      env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert sorted(f.name for f in out.iterdir()) == sorted(
        [f"{r}.gguf" for r in runs] + [f"{r}.train-log.json" for r in runs] + ["train.log"])
    for run in runs:
        log = json.loads((out / f"{run}.train-log.json").read_text())
        assert log["steps_done"] == 2 and log["finished"] and log["config"]["max_tokens"] == 512
        query = "auto" if run.startswith("q-") else ""
        assert ("--query-tokens 64" in log["command"]) == bool(query)
        assert ("--freeze-layers 0-4,6-10,12-16" in log["command"]) == (name == "gemma3-270m")
        assert read_header(out / f"{run}.gguf").kv.get("locret.recommended.query", "") == query
    # a run the packed model's recipes do not name
    proc = _gpu_train("--device", "cpu", "--runs", "q-broad" if name == "gemma3-270m" else "g-long", env=env)
    assert "names none of the runs" in proc.stderr
