"""`locret eval`: methods side by side on the same prompts, its outputs and resumption, benchmark files,
the device memory check, and refusals. Short prompts (about 600 tokens), a small budget and a small chunk keep
it fast (prefill is most of the time: about 100 tokens/s on 2 cores); the eviction still runs over several chunks,
and the prompt is long enough against budget + chunk for streaming to leave its middle empty."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from locret.files import sha256_file
from locret.query import pin_room
from conftest import REPO, SHIPPED_HEADS_FAMILIES, THREADS, run

BUDGET, UBATCH = 128, 64
LENGTH = 600
COMMON = ["--budgets", str(BUDGET), "--ubatch", str(UBATCH), "--threads", str(THREADS)]


def locret_cmd(*args) -> list:
    return [sys.executable, "-m", "locret", *args]


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def side_by_side(tmp_path_factory, model_path):
    # 45-60 s on 2 cores beside the other worker: `locret eval` end to end (three methods x two tasks, each run in its
    # own worker process with the model loaded, plots and heatmaps); six of this file's tests read its outputs
    out = tmp_path_factory.mktemp("eval") / "run"
    cmd = locret_cmd("eval", "--model", model_path, "--tasks", "passkey,niah", "--lengths", LENGTH, "--depths", "0.5",
                     "--methods", "full,locret,streaming", *COMMON, "-o", out)
    proc = run(cmd, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc, cmd


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_every_method_answers_the_same_prompts(side_by_side):
    out, proc, _ = side_by_side
    samples = read_jsonl(out / "samples.jsonl")
    assert len(samples) == 6  # 2 tasks x 3 methods
    by_item: dict[str, list] = {}
    for s in samples:
        by_item.setdefault(s["item"], []).append(s)
    assert sorted(by_item) == [f"niah/{LENGTH}/d0.50/0", f"passkey/{LENGTH}/d0.50/0"]
    for item, group in by_item.items():
        assert sorted(s["method"] for s in group) == ["full", "locret", "streaming"]
        assert len({s["prompt_tokens"] for s in group}) == 1  # the very same prompt
        assert LENGTH * 5 // 6 < group[0]["prompt_tokens"] <= LENGTH


def test_scores_are_the_tasks_own_and_the_summary_their_mean(side_by_side):
    out, _, _ = side_by_side
    samples = read_jsonl(out / "samples.jsonl")
    for s in samples:
        if s["source"] == "passkey":  # independent of the task module: the key as a whole number
            key = s["answers"][0]
            assert s["score"] == float(bool(re.search(rf"(?<!\d){key}(?!\d)", s["answer"])))
        else:  # niah: the share of the gold numbers present as whole numbers
            found = sum(1 for a in s["answers"] if re.search(rf"(?<!\d){a}(?!\d)", s["answer"]))
            assert s["score"] == pytest.approx(found / len(s["answers"]))
    summary = json.loads((out / "summary.json").read_text())["summary"]
    assert len(summary) == 6
    for row in summary:
        mine = [s["score"] for s in samples if (s["source"], s["method"], s["budget"]) ==
                (row["source"], row["method"], row["budget"])]
        assert row["samples"] == len(mine) and row["accuracy"] == pytest.approx(np.mean(mine), abs=1e-4)


def test_timings_cells_and_memory_are_reported_per_run(side_by_side):
    out, _, _ = side_by_side
    samples = read_jsonl(out / "samples.jsonl")
    runs = {r["run"]: r for r in read_jsonl(out / "runs.jsonl")}
    assert set(runs) == {f"full/{LENGTH}", f"locret-b{BUDGET}/{LENGTH}", f"streaming-b{BUDGET}/{LENGTH}"}
    for s in samples:
        assert s["prefill_tok_s"] > 0 and s["prefill_s"] > 0
        assert s["new_tokens"] == 0 or s["decode_tok_s"] > 0
        if s["method"] == "full":
            assert s["cells_used_max"] is None and s["evictions"] == 0
        else:
            # read after every chunk: the peak, the budget plus the chunk each eviction follows
            assert s["cells_used_max"] == BUDGET + UBATCH and s["evictions"] >= 1
            # this prompt's evictions (at most one per chunk and one in decoding), not the run's running count
            assert s["evictions"] <= math.ceil(s["prompt_tokens"] / UBATCH) + 1, s
            assert s["n_cells"] == 256  # pad(128 + 64, 256)
    for r in runs.values():
        assert 50 << 20 < r["peak_rss_bytes"] < 4 << 30
    # KV cache: 256 cells under eviction, pad(prompt + answer room) cells for full attention; SmolLM2 stores
    # 30 layers x (K + V) x 3 KV heads x 64 dims x 2 bytes = 23,040 bytes per cell
    assert runs[f"locret-b{BUDGET}/{LENGTH}"]["kv_bytes"] == 256 * 23040
    assert runs[f"full/{LENGTH}"]["kv_bytes"] == runs[f"full/{LENGTH}"]["n_ctx"] * 23040
    md = (out / "summary.md").read_text()
    assert md.count("\n| passkey |") == 3 and "peak RSS MiB" in md


def test_plots_and_heatmaps_are_written(side_by_side):
    out, _, _ = side_by_side
    for name in ("accuracy_vs_budget", "accuracy_vs_length", "accuracy_vs_depth"):
        w, h = png_size(out / "plots" / f"{name}.png")
        assert w > 300 and h > 200
    heatmaps = sorted((out / "heatmaps").glob("*.npz"))
    # the first prompt of each evicting run (passkey comes first), none for full attention
    assert [p.name for p in heatmaps] == [f"locret-b{BUDGET}__passkey_{LENGTH}_d0.50_0.npz",
                                          f"streaming-b{BUDGET}__passkey_{LENGTH}_d0.50_0.npz"]
    for p in heatmaps:
        assert png_size(out / "plots" / (p.stem + ".png"))[0] > 300


def test_heatmaps_hold_the_retained_units_after_every_chunk(side_by_side):
    out, _, _ = side_by_side
    sample = next(s for s in read_jsonl(out / "samples.jsonl") if s["method"] == "streaming" and s["source"] == "passkey")
    data = np.load(out / "heatmaps" / sample["heatmap"])
    retained = data["retained"].astype(np.float32)       # [chunks, layers, kv heads, bins]
    n = sample["prompt_tokens"]
    assert retained.shape == (math.ceil(n / UBATCH), 30, 3, 128)
    width = n / 128
    held = retained.sum(axis=-1) * width                   # units held per (chunk, layer, head)
    # before any eviction everything fed is held; afterwards at most b + B units
    assert held[0] == pytest.approx(np.full((30, 3), UBATCH), abs=1.0)
    assert (held <= BUDGET + UBATCH + 1).all()
    # streaming after the last chunk: the prompt's start (sinks, stabilizers) and its end, nothing between
    last = retained[-1]
    middle = slice(int(0.35 * 128), int(0.65 * 128))
    assert last[:, :, middle].max() == 0.0
    # the last bins fully held: each bin spans floor(width) or ceil(width) positions, so at least floor(width)
    last_held = last[:, :, -3:] * width
    assert last_held.min() >= math.floor(width) - 1e-3, (width, last_held.min())
    assert last[:, :, 0].min() > 0


def test_a_second_run_resumes_and_other_settings_are_refused(side_by_side):
    out, _, cmd = side_by_side
    before = (out / "samples.jsonl").read_text()
    proc = run(cmd, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "6 samples already in" in proc.stdout
    assert (out / "samples.jsonl").read_text() == before
    changed = [c if c != "0.5" else "0.25" for c in cmd]
    proc = run(changed, timeout=120)
    assert proc.returncode == 1 and "other settings (depths differ)" in proc.stderr
    # the heads a method ran with are part of the settings by content, not only `--heads` as given: the shipped heads
    # re-trained in place (here: another digest on record) refuse the resume
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    name, digest = config["heads_used"]["locret"].split(" sha256:")
    assert name == "smollm2-135m-instruct.gguf" and len(digest) == 64
    assert config["heads_used"]["locret"] == json.loads((out / "summary.json").read_text())["settings"]["heads_used"]["locret"]
    try:
        config_path.write_text(json.dumps(dict(config, heads_used={"locret": f"{name} sha256:{'0' * 64}"})))
        proc = run(cmd, timeout=120)
        assert proc.returncode == 1 and "other settings (heads_used differ)" in proc.stderr, proc.stderr[-2000:]
        # a run from before the record resumes: locret's heads resolve as they did then
        config_path.write_text(json.dumps({k: v for k, v in config.items() if k != "heads_used"}))
        proc = run(cmd, timeout=300)
        assert proc.returncode == 0 and "6 samples already in" in proc.stdout, proc.stderr[-2000:]
    finally:
        config_path.write_text(json.dumps(config))


LONG_BENCH = [
    {"_id": "q1", "input": "Which city hosts the copper fair?", "answers": ["Varna"], "length": 700,
     "all_classes": None, "dataset": "hotpotqa", "language": "en"},
    {"_id": "q2", "input": "Which river runs through Olm?", "answers": ["the Tesse"], "length": 700,
     "all_classes": None, "dataset": "hotpotqa", "language": "en"},
]


def longbench_file(tmp_path: Path) -> Path:
    # about 700 tokens a record: several chunks past budget + chunk, so the cache evicts (checked below)
    filler = " ".join(f"Ledger line {i} lists barrels, ropes and lanterns." for i in range(28))
    path = tmp_path / "hotpotqa.jsonl"
    rows = [dict(r, context=f"{filler} The copper fair is held in Varna every spring. The river Tesse runs through "
                             f"Olm. {filler}") for r in LONG_BENCH]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_benchmark_records_are_scored_with_the_benchmarks_metric(tmp_path, model_path):
    from locret import benchmarks

    data = longbench_file(tmp_path)
    out = tmp_path / "lb"
    proc = run(locret_cmd("eval", "--model", model_path, "--benchmark", "longbench", "--dataset", data,
                          "--methods", "locret", "--max-new-tokens", "16", *COMMON, "--no-plots", "-o", out), timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    samples = read_jsonl(out / "samples.jsonl")
    records = {f"longbench/hotpotqa/{r.id}": r for r in benchmarks.load("longbench", data)}
    assert sorted(s["item"] for s in samples) == sorted(records)
    for s in samples:
        assert s["score"] == pytest.approx(benchmarks.score(records[s["item"]], s["answer"]))
        assert s["cells_used_max"] <= BUDGET + UBATCH
        assert s["evictions"] >= 1 and s["prompt_tokens"] > BUDGET + UBATCH, s
    row = json.loads((out / "summary.json").read_text())["summary"][0]
    assert row["source"] == "longbench/hotpotqa" and row["length"] is None and row["samples"] == 2


def test_a_run_over_the_devices_memory_fails(tmp_path, model_path):
    text = (REPO / "devices" / "cpu-2core.toml").read_text()
    tiny = re.sub(r"(?m)^available_gib = .*$", "available_gib = 0.05", text)
    assert tiny != text
    device = tmp_path / "tiny.toml"
    device.write_text(tiny.replace('name = "cpu-2core"', 'name = "tiny"'))
    proc = run(locret_cmd("eval", "--model", model_path, "--tasks", "passkey", "--lengths", "600", "--depths", "0.5",
                          "--methods", "locret", "--budgets", "256", "--ubatch", "128", "--device", device,
                          "--no-plots", "-o", tmp_path / "out"), timeout=600)
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert re.search(r"measured peak RSS [\d.]+ MiB exceeds tiny's 0.05 GiB", proc.stdout)
    # the profile's settings were used where none was given: its stabilizers, fitted to the chunk
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["stabilizers"] == 128 and config["kv_type"] == "f16" and config["gpu_layers"] == 0


@pytest.mark.parametrize("args, message", [
    (["--tasks", "passkey,haystack", "--lengths", "600", "--budgets", "256"], "unknown task 'haystack'"),
    (["--tasks", "passkey", "--lengths", "600", "--budgets", "256", "--methods", "locret,h2o"], "unknown method(s) h2o"),
    (["--tasks", "passkey", "--lengths", "600", "--methods", "locret"], "need --budgets"),
    (["--tasks", "passkey", "--budgets", "256"], "--tasks needs --lengths"),
    (["--tasks", "passkey", "--lengths", "600", "--budgets", "256", "--stabilizers", "256"],
     "must be larger than the stabilizers (256)"),
    (["--tasks", "passkey", "--lengths", "600", "--budgets", "256", "--depths", "1.5"], "depth 1.5 is outside [0, 1]"),
    (["--tasks", "passkey", "--lengths", "600", "--budgets", "256", "--device", "jetson-nano-2gb"], "jetson-nano-2gb"),
    (["--benchmark", "longbench", "--budgets", "256"], "needs --dataset"),
    (["--benchmark", "ruler", "--dataset", "conftest.py", "--budgets", "256"], "unknown benchmark 'ruler'"),
    (["--benchmark", "longbench", "--dataset", "conftest.py", "--budgets", "256", "--methods", "locret-q-auto"],
     "locret-q-auto places each generated task's question"),
    (["--tasks", "passkey", "--lengths", "600", "--budgets", "256", "--pool", "4"], "must be odd"),
    (["--tasks", "passkey", "--lengths", "600", "--budgets", "256", "--haystacks", "prose,poetry"],
     "unknown haystack family poetry; valid: prose, code, legal, logs, recipes, weather, manual, minutes"),
    (["--tasks", "common_words", "--lengths", "600", "--budgets", "256", "--haystacks", "code"], "has no haystack"),
    (["--tasks", "passkey", "--lengths", "600", "--budgets", "256", "--methods", "locret,locret-q", "--haystacks",
      "recipes,code", "--held-out"], "code is not held out for locret: its heads were trained on code, legal, logs, "
                                    "prose, pydoc"),
    (["--benchmark", "longbench", "--dataset", "conftest.py", "--budgets", "256", "--methods", "locret",
      "--held-out"], "--held-out is about the generated tasks' haystack families"),
    (["--tasks", "passkey", "--lengths", "600", "--budgets", "256", "--pool", "5", "--methods", "streaming"],
     "--pool smooths the retaining heads' scores"),
    (["--tasks", "passkey", "--lengths", "600", "--budgets", "256", "--methods", "locret-schedule"],
     "locret-schedule (and METHOD@schedule) runs the per-layer budgets of --schedule FILE"),
    (["--tasks", "passkey", "--lengths", "600", "--budgets", "256", "--methods", "locret-q-auto@schedule"],
     "locret-schedule (and METHOD@schedule) runs the per-layer budgets of --schedule FILE"),
    (["--tasks", "passkey", "--lengths", "600", "--budgets", "256", "--methods", "locret-pyramid@pyramid"],
     "locret-pyramid@pyramid: a budget schedule variant is METHOD@pyramid|schedule with METHOD one of locret, "),
    (["--tasks", "passkey", "--lengths", "600", "--budgets", "256", "--methods", "locret@uniform"],
     "locret@uniform: a budget schedule variant is METHOD@pyramid|schedule"),
    (["--tasks", "passkey", "--lengths", "600", "--budgets", "256", "--methods", "locret,streaming,locret"],
     "a method is given twice"),
    (["--tasks", "passkey", "--lengths", "600", "--budgets", "256", "--schedule", "conftest.py"],
     "locret-schedule (and METHOD@schedule) runs the per-layer budgets of --schedule FILE"),
    (["--tasks", "passkey", "--lengths", "600", "--budgets", "256", "--methods", "locret-schedule", "--schedule",
      "none.txt"], "schedule file none.txt does not exist"),
    (["--tasks", "passkey", "--lengths", "600", "--budgets", "256", "--methods", "locret-schedule", "--schedule",
      "conftest.py"], "is not a budget"),
    (["--tasks", "passkey", "--lengths", "600", "--budgets", "256", "--methods", "lagkv", "--policy-settings",
      "snapkv:window=16"], "--policy-settings snapkv:window=16: the method snapkv is not in this run's --methods (lagkv)"),
    (["--tasks", "passkey", "--lengths", "600", "--budgets", "256", "--methods", "lagkv", "--policy-settings", "lagkv"],
     "--policy-settings takes METHOD:key=value[,key=value...]"),
    (["--tasks", "passkey", "--lengths", "600", "--budgets", "256", "--methods", "lagkv", "--policy-settings",
      "lagkv:lag=32", "--policy-settings", "lagkv:lag=64"], "--policy-settings gives the settings of lagkv twice"),
    (["--tasks", "passkey", "--lengths", "600", "--budgets", "256", "--methods", "full,lagkv", "--policy-settings",
      "full:lag=32"], "full attention evicts nothing and has no policy to set"),
    # the keys and values are the library's to check, before any run starts: naming the run and the key
    (["--tasks", "passkey", "--lengths", "600", "--budgets", "256", "--methods", "lagkv", "--policy-settings",
      "lagkv:lags=32"], "policy lagkv has no setting 'lags' (its settings: lag)"),
    (["--tasks", "passkey", "--lengths", "600", "--budgets", "256", "--methods", "locret", "--policy-settings",
      "locret:lag=32"], "policy heads has no settings (got 'lag=32')"),
])
def test_bad_settings_are_refused(args, message, tmp_path, model_path, monkeypatch, capsys):
    # in this process, through the command's own entry point (a new interpreter per case cost a second each); the
    # next test runs one refusal as the command a user types, for its exit status and a stderr with no traceback
    from locret import cli

    monkeypatch.chdir(REPO / "tests" / "py")
    try:
        status = cli.main(["eval", "--model", str(model_path), *map(str, args), "-o", str(tmp_path / "out")])
    except SystemExit as e:  # sys.exit("...") prints its message and exits 1, argparse exits 2
        status = 1 if isinstance(e.code, str) else e.code
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    err = capsys.readouterr().err
    assert status == 1, err[-1500:]
    assert message in err
    # nothing recorded: the corrected command may run in the same folder (a refused run's settings refused it)
    assert not (tmp_path / "out" / "config.json").exists()


def test_a_refused_setting_exits_1_from_the_command(tmp_path, model_path):
    proc = run(locret_cmd("eval", "--model", model_path, "--tasks", "passkey", "--lengths", "600", "--budgets", "256",
                          "--pool", "4", "-o", tmp_path / "out"), timeout=300, cwd=REPO / "tests" / "py")
    assert proc.returncode == 1, proc.stdout[-1500:] + proc.stderr[-1500:]
    assert "must be odd" in proc.stderr and "Traceback" not in proc.stderr


# one niah prompt for the question methods, with and without heads: the next test and
# test_snapkv_with_the_question_found_pins_it_as_its_window read its samples (--pool reaches the heads methods only)
NIAH_Q_ARGS = ["eval", "--tasks", "niah", "--lengths", LENGTH, "--depths", "0.5",
               "--methods", "locret,locret-q,locret-q-auto,snapkv,snapkv-q-auto", "--pool", "5", *COMMON, "--no-plots"]


@pytest.fixture(scope="module")
def niah_questions(tmp_path_factory, model_path):
    out = tmp_path_factory.mktemp("eval") / "q"
    proc = run(locret_cmd(*NIAH_Q_ARGS, "--model", model_path, "-o", out), timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_locret_q_pins_each_question_and_pooling_reaches_the_context(niah_questions, tmp_path, model_path):
    from locret.evaluation import items as items_module

    out = tmp_path / "q"
    shutil.copytree(niah_questions, out)  # the folder is changed below: a copy, the fixture's stays as it was run
    by_method = {s["method"]: s for s in read_jsonl(out / "samples.jsonl")}
    # the auto rule finds niah's question at the end of the user message: the same prompt, pin and answer as locret-q
    auto, explicit = by_method["locret-q-auto"], by_method["locret-q"]
    assert auto["query_is_the_tasks"] is True
    assert (auto["prompt_tokens"], auto["pinned"], auto["answer"]) == \
        (explicit["prompt_tokens"], explicit["pinned"], explicit["answer"])
    assert explicit["pinned"] > 0 and "query_found" not in explicit
    assert by_method["locret"]["pinned"] == 0 and by_method["locret"]["evictions"] >= 3
    assert by_method["locret"]["pool"] == 5 and by_method["locret-q"]["pool"] == 5
    # without --heads, Locret-Q scores with the heads trained with the question in front, Locret with the plain ones
    heads_files = json.loads((out / "summary.json").read_text())["settings"]["heads_files"]
    assert heads_files == {"locret": "smollm2-135m-instruct.gguf", "locret-q": "smollm2-135m-instruct.query.gguf",
                          "locret-q-auto": "smollm2-135m-instruct.query.gguf"}
    # a folder from before the heads were recorded cannot tell which heads its locret-q samples had: refused
    config = json.loads((out / "config.json").read_text())
    assert config["heads_used"]["locret-q"].startswith("smollm2-135m-instruct.query.gguf sha256:")
    (out / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "heads_used"}))
    again = run(locret_cmd(*NIAH_Q_ARGS, "--model", model_path, "-o", out), timeout=300)
    assert again.returncode == 1 and "did not record which heads it used" in again.stderr, again.stderr[-2000:]
    # the same sample, built here: locret-q's prompt opens the user turn with the question, and the pin ends with it
    vocab = items_module.vocab_model(str(model_path))
    try:
        (item,) = items_module.task_items(vocab, ["niah"], [LENGTH], [0.5], 1, 0)
        n = by_method["locret-q"]["pinned"]
        text = lambda toks: vocab.detokenize(list(toks)).decode()
        assert by_method["locret-q"]["prompt_tokens"] == len(item.query_tokens) > len(item.tokens)
        assert text(item.query_tokens[:n]).rstrip().endswith(item.query.strip())
        assert item.query.strip() not in text(item.query_tokens[:n - 1])
        assert text(item.query_tokens[:n]).endswith("user\n" + item.query.strip())  # it opens the user turn
        k = len(item.tokens) - 200  # past the head (template, instructions): filler, needles and tail unchanged
        assert item.query_tokens[-k:] == item.tokens[-k:]
        assert auto["query_found"] == item.auto_query == item.query and item.auto_query_tokens == item.query_tokens
    finally:
        vocab.close()


def test_the_auto_rule_finds_every_generated_tasks_question(model_path):
    # locret-q-auto runs what `--locret-query auto` would pin: on the generated tasks (every haystack family) the rule
    # finds the task's own question at the end of the user message; where it finds none the prompt stays plain
    from locret import tasks
    from locret.evaluation import items as items_module, worker
    from locret.tasks import haystacks

    with_depth = [t for t in tasks.TASKS if tasks.get(t).USES_DEPTH]
    real = [t for t in with_depth if "prose" not in items_module.families_of(tasks.get(t))]  # real text only
    vocab = items_module.vocab_model(str(model_path))
    try:
        found = items_module.task_items(vocab, [t for t in with_depth if t not in real], [1200], [0.5], 1, 0)
        found += items_module.task_items(vocab, ["passkey"], [1200], [0.5], 1, 0,
                                         haystacks=tuple(f for f in haystacks.FAMILIES if f != "prose"))
        found += items_module.task_items(vocab, real, [1200], [0.5], 1, 0, haystacks=("man",))
    finally:
        vocab.close()
    # every generated task with a depth (niah_name the eighth), passkey in each other family, each real-text task
    assert len(real) == 3 and len(found) == 8 + 7 + 3
    for item in found:
        assert item.auto_query == item.query and item.auto_query_tokens == item.query_tokens, item.id
    spec = worker.RunSpec(model_path=str(model_path), method="locret-q-auto", budget=256, heads=None,
                          stabilizers=None, local=None, n_ctx=2048, ubatch=128, threads=THREADS)
    none_found = dataclasses.replace(found[0], auto_query="", auto_query_tokens=())
    assert worker.query_of(spec, none_found) == "" and worker.prompt_of(spec, none_found) == list(found[0].tokens)
    assert worker.prompt_of(spec, found[0]) == list(found[0].query_tokens)


def test_locret_pyramid_and_a_schedule_file_give_each_layer_its_budget(tmp_path, model_path):
    out = tmp_path / "pyr"
    # a schedule file (as locret calibrate writes one): the second half of the layers keeps 32 units more
    schedule = tmp_path / "schedule.txt"
    mine = [BUDGET - 16] * 15 + [BUDGET + 16] * 15
    schedule.write_text("# per-layer budgets\n" + "\n".join(map(str, mine)) + "\n")
    proc = run(locret_cmd("eval", "--model", model_path, "--tasks", "passkey", "--lengths", LENGTH, "--depths", "0.5",
                          "--methods", "locret,locret-pyramid,locret-schedule,locret-q-auto@pyramid",
                          "--schedule", schedule, "--stabilizers", "16", *COMMON,
                          "-o", out, "--no-plots"), timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    by_method = {s["method"]: s for s in read_jsonl(out / "samples.jsonl")}
    assert by_method["locret-schedule"]["layer_budgets"] == mine and by_method["locret-schedule"]["evictions"] >= 1
    config = json.loads((out / "config.json").read_text())
    assert config["schedule"]["sha256"] == sha256_file(schedule)   # a changed file does not resume the run
    flat, pyr = by_method["locret"]["layer_budgets"], by_method["locret-pyramid"]["layer_budgets"]
    assert len(flat) == len(pyr) == 30 and sum(pyr) == sum(flat) and len(set(flat)) == 1
    assert pyr[0] > flat[0] > pyr[-1] and pyr == sorted(pyr, reverse=True)
    # the cache holds the largest layer's budget plus a chunk
    assert by_method["locret-pyramid"]["evictions"] >= 1
    assert by_method["locret-pyramid"]["cells_used_max"] == pyr[0] + UBATCH > by_method["locret"]["cells_used_max"]
    # METHOD@variant: the question found and pinned with PyramidKV's budgets; the last layer raised for the Locret-Q heads' pinned question: 16 stabilizers, the room, one unit
    q_pyr = by_method["locret-q-auto@pyramid"]
    assert q_pyr["layer_budgets"][-1] == 16 + pin_room() + 1 > pyr[-1] == 16 + 1
    assert sum(q_pyr["layer_budgets"]) == sum(pyr) and q_pyr["evictions"] >= 1
    assert q_pyr["query_is_the_tasks"] and q_pyr["pinned"] > 0 and by_method["locret-pyramid"]["pinned"] == 0
    runs = {r["method"] for r in read_jsonl(out / "runs.jsonl")}
    assert runs == set(by_method), runs


def test_a_schedule_variant_is_its_method_with_the_schedule(tmp_path, model_path):
    from locret.evaluation import runner, split_method
    from locret.evaluation.worker import locret_settings

    schedule = tmp_path / "schedule.txt"
    schedule.write_text("\n".join(["128"] * 30) + "\n")
    cfg = runner.EvalConfig(output=tmp_path / "o", model=str(model_path), tasks=["passkey"], lengths=[600],
                            depths=[0.5], budgets=[128], ubatch=64, schedule=str(schedule),
                            methods=["locret-schedule", "locret@schedule", "locret-pyramid", "locret@pyramid",
                                     "locret-q-auto@schedule"])
    runner.validate(cfg)
    assert split_method("locret-q-auto@pyramid") == ("locret-q-auto", "pyramid")
    assert split_method("lagkv") == ("lagkv", "")
    facts = runner.planner.read_model(model_path)
    heads, random_heads = runner._heads_for(cfg, model_path, facts)
    vocab = runner.items_module.vocab_model(str(model_path))
    try:
        its = runner.items_module.task_items(vocab, cfg.tasks, cfg.lengths, cfg.depths, 1, 0)
    finally:
        vocab.close()
    runs, _ = runner.plan_runs(cfg, its, model_path, facts, heads, random_heads, tmp_path)
    specs = {spec.labels["method"]: spec for spec, _ in runs}
    settings = {m: locret_settings(s) for m, s in specs.items()}
    assert settings["locret@schedule"] == settings["locret-schedule"]
    assert settings["locret@schedule"]["locret_budget_schedule"] == str(schedule)
    assert settings["locret@pyramid"] == settings["locret-pyramid"]
    assert settings["locret@pyramid"]["locret_budget_schedule"] == "pyramid"
    assert settings["locret-q-auto@schedule"]["locret_budget_schedule"] == str(schedule)
    # each variant runs apart: its own run name
    assert len({spec.labels["run"] for spec in specs.values()}) == 5
    assert specs["locret@pyramid"].name == "locret@pyramid-b128"


def test_policy_settings_reach_their_methods_runs_and_old_records_read_as_them(tmp_path, model_path):
    from locret.evaluation import runner
    from locret.evaluation.worker import locret_settings

    cfg = runner.EvalConfig(output=tmp_path / "o", model=str(model_path), tasks=["passkey"], lengths=[600],
                            depths=[0.5], budgets=[256], ubatch=64, methods=["lagkv", "snapkv-q-auto", "streaming"],
                            policy_settings=runner.parse_policy_settings(["lagkv:lag=32", "snapkv-q-auto:window=16"]))
    runner.validate(cfg)
    facts = runner.planner.read_model(model_path)
    vocab = runner.items_module.vocab_model(str(model_path))
    try:
        its = runner.items_module.task_items(vocab, cfg.tasks, cfg.lengths, cfg.depths, 1, 0)
    finally:
        vocab.close()
    runs, _ = runner.plan_runs(cfg, its, model_path, facts, {}, None, tmp_path)
    policies = {spec.labels["method"]: locret_settings(spec)["locret_policy"] for spec, _ in runs}
    # each method's settings after its policy's name, as they were given; the others at their policy's defaults
    assert policies == {"lagkv": "lagkv:lag=32", "snapkv-q-auto": "snapkv:window=16", "streaming": "streaming"}
    runner.check_runs(runs)  # the library takes them
    # the settings decide the results: a run with other ones does not resume; a run without any keeps its old record
    fingerprint = cfg.fingerprint()
    assert fingerprint["policy_settings"] == {"lagkv": "lag=32", "snapkv-q-auto": "window=16"}
    assert "policy_settings" not in dataclasses.replace(cfg, policy_settings={}).fingerprint()
    # a record from before policy settings, when LagKV's partition was a key of its own, reads as today's form
    lag_only = dataclasses.replace(cfg, policy_settings={"lagkv": "lag=32"}).fingerprint()
    old = {k: v for k, v in lag_only.items() if k != "policy_settings"}
    assert runner.upgrade_record(dict(old, lag=32)) == lag_only
    assert runner.upgrade_record(dict(old, lag=None)) == old
    assert runner.upgrade_record(old) == old


def test_haystack_families_get_rows_of_their_own(tmp_path, model_path):
    out = tmp_path / "families"
    n = 300  # short prompts: what is checked is the rows, not what the heads keep
    proc = run(locret_cmd("eval", "--model", model_path, "--tasks", "niah", "--lengths", n, "--depths", "0.5",
                          "--haystacks", "prose,logs", "--methods", "locret", *COMMON, "-o", out, "--no-plots"),
               timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    samples = {s["item"]: s for s in read_jsonl(out / "samples.jsonl")}
    assert sorted(samples) == [f"niah/{n}/d0.50/0", f"niah@logs/{n}/d0.50/0"]
    assert samples[f"niah@logs/{n}/d0.50/0"]["source"] == "niah@logs"
    # the same keys and numbers (same seed and index), another haystack: another prompt
    assert samples[f"niah/{n}/d0.50/0"]["answers"] == samples[f"niah@logs/{n}/d0.50/0"]["answers"]
    summary = json.loads((out / "summary.json").read_text())
    rows = summary["summary"]
    assert {r["source"] for r in rows} == {"niah", "niah@logs"}
    assert "niah@logs" in (out / "summary.md").read_text()


def test_a_malformed_dataset_is_refused_with_its_line(tmp_path, model_path):
    data = longbench_file(tmp_path)
    data.write_text(data.read_text() + '{"_id": "q3", "input": 5}\n')
    proc = run(locret_cmd("eval", "--model", model_path, "--benchmark", "longbench", "--dataset", data,
                          "--methods", "locret", "--budgets", "256", "-o", tmp_path / "out"), timeout=300)
    assert proc.returncode == 1 and f"{data}:3" in proc.stderr and "Traceback" not in proc.stderr


def test_bench_takes_a_devices_settings_and_checks_its_memory(model_path, tmp_path, capsys):
    import bench_eviction  # scripts/, on sys.path through conftest

    text = (REPO / "devices" / "cpu-2core.toml").read_text()
    device = tmp_path / "tiny.toml"
    device.write_text(re.sub(r"(?m)^available_gib = .*$", "available_gib = 0.25", text).replace('name = "cpu-2core"',
                                                                                               'name = "tiny"'))
    args = bench_eviction.parse(["--model", str(model_path), "--heads", "h.gguf", "--device", str(device)])
    dev = bench_eviction.apply_device(args)
    # the profile's "<1B" class: budget 2048, chunk 512, 128 stabilizers, f16, CPU only; passed on to the children
    assert (args.budget, args.ubatch, args.stabilizers, args.kv_type, args.gpu_layers) == (2048, 512, 128, "f16", 0)
    assert args.argv[-10:] == ["--budget", "2048", "--ubatch", "512", "--stabilizers", "128", "--kv-type", "f16",
                               "--gpu-layers", "0"]
    rows = [("small", {"peak_rss_mib": 200.0}), ("large", {"peak_rss_mib": 300.0})]
    assert [line.split(":")[0] for line in bench_eviction.device_check(dev, rows)] == ["large"]
    assert "bench_eviction: error: large: peak RSS 300 MiB > 256 MiB" in capsys.readouterr().out
    # a discrete GPU's memory is not what llama-bench's RSS measures: said, not checked
    gpu = bench_eviction.parse(["--model", str(model_path), "--heads", "h.gguf", "--device", "rtx4090"])
    assert bench_eviction.device_check(bench_eviction.apply_device(gpu), rows) == []
    assert "was not checked here" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no GPU: GPU layers must be 0"):
        bench_eviction.apply_device(bench_eviction.parse(["--model", str(model_path), "--device", str(device),
                                                          "--gpu-layers", "10"]))


def _children(pid: int, marker: str) -> list[int]:
    """The child processes of `pid` whose command line holds `marker` (read from /proc)."""
    try:
        listed = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except FileNotFoundError:
        return []
    found = []
    for child in map(int, listed):
        with contextlib.suppress(FileNotFoundError):
            if marker in Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace"):
                found.append(child)
    return found


def _signal_and_check_children_end(proc: subprocess.Popen, marker: str, sig: int) -> str:
    """Wait for a child of `proc` with `marker` in its command line, send `proc` the signal, and assert that every such
    child is gone (or a zombie) 20 s after `proc` ended; `proc`'s stderr (when piped). A failed check leaves nothing
    running either."""
    if not Path(f"/proc/{proc.pid}/task/{proc.pid}/children").exists():
        proc.kill()
        pytest.fail("this check reads /proc (Linux)")
    found: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while not _children(proc.pid, marker) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        found = _children(proc.pid, marker)
        assert found, f"the evaluation started no {marker} (exit {proc.poll()})"
        time.sleep(3)  # the child is past its start and computing
        proc.send_signal(sig)
        err = proc.communicate(timeout=60)[1] or ""
        deadline = time.monotonic() + 20
        alive = found
        while alive and time.monotonic() < deadline:
            time.sleep(0.5)
            alive = [p for p in found if Path(f"/proc/{p}").exists()
                     and "Z" not in Path(f"/proc/{p}/stat").read_text().split(")")[-1].split()[0]]
        assert not alive, f"{marker} {alive} outlived the evaluation"
        return err
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in found:
            if Path(f"/proc/{pid}").exists():
                os.kill(pid, signal.SIGKILL)


def test_a_killed_evaluation_leaves_no_worker_behind(tmp_path, model_path):
    # a signal ends `locret eval` without its cleanup; its worker process (a long prompt still in prefill) must not
    # go on computing for nobody
    proc = subprocess.Popen([str(c) for c in locret_cmd(
        "eval", "--model", model_path, "--tasks", "passkey", "--lengths", "16384", "--depths", "0.5", "--methods",
        "locret", "--budgets", "256", "--ubatch", "128", "--threads", "1", "--no-plots", "-o", tmp_path / "out")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _signal_and_check_children_end(proc, "spawn_main", signal.SIGTERM)


def _sigterm_command(tmp_path, model_path) -> list[str]:
    """A RULER run of llama-server's full attention, then kvpress's SnapKV (kvpress_side) on the same prompt."""
    return [str(c) for c in locret_cmd(
        "eval", "--model", model_path, "--suite", "ruler", "--tasks", "vt", "--lengths", "4096", "--samples", "1",
        "--methods", "full", "--presses", "snapkv", "--ratios", "0.75", "--threads", "1", "--no-plots",
        "-o", tmp_path / "out")]


def _sigterm_and_check(cmd: list[str], marker: str) -> None:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err = _signal_and_check_children_end(proc, marker, signal.SIGTERM)
    assert proc.returncode == 143, err[-2000:]
    assert "locret: terminated" in err and "Traceback" not in err, err[-2000:]


def test_sigterm_stops_the_servers_an_evaluation_started(tmp_path, model_path):
    # SIGTERM's default action ends Python at once, past the finally blocks that stop llama-server and kvpress's
    # process: they went on computing for nobody (seen on a press run stopped with kill). `locret` turns it into a clean
    # exit: 143, a message, and its children gone. Here while llama-server answers; kvpress's process, which the same
    # command starts once llama-server's run is done, in the long lane (the next test).
    _sigterm_and_check(_sigterm_command(tmp_path, model_path), "llama-server")


def test_sigterm_stops_kvpress_an_evaluation_started(tmp_path, model_path):
    # the same command as above, signalled while llama-server answers, then resumed and signalled while kvpress
    # replays the prompt (after llama-server's run of it, about a minute on 2 cores: the long lane)
    cmd = _sigterm_command(tmp_path, model_path)
    for marker in ("llama-server", "kvpress_side"):
        _sigterm_and_check(cmd, marker)


def test_held_out_families_are_checked_against_the_heads_training_logs(tmp_path, model_path):
    # the shipped heads' logs (conftest.SHIPPED_HEADS_FAMILIES): the four newer families are held out from both
    from locret.evaluation.heldout import check_held_out, training

    out = tmp_path / "held"
    # short prompts (300 tokens): what is checked is the run's settings and rows, not what the heads keep
    proc = run(locret_cmd("eval", "--model", model_path, "--tasks", "passkey", "--lengths", "300", "--depths", "0.5",
                          "--haystacks", "recipes,minutes", "--held-out", "--methods", "locret,locret-q",
                          *COMMON, "-o", out, "--no-plots"), timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    settings = json.loads((out / "summary.json").read_text())["settings"]
    assert settings["held_out"] == {"families": ["recipes", "minutes"], "heads_trained_on": SHIPPED_HEADS_FAMILIES}
    rows = {r["source"] for r in json.loads((out / "summary.json").read_text())["summary"]}
    assert rows == {"passkey@recipes", "passkey@minutes"}

    # logs of our own: a chain through init_heads, data files, a missing log
    def heads(name, **config):
        (tmp_path / f"{name}.run").mkdir()
        (tmp_path / f"{name}.run" / "train-log.json").write_text(json.dumps({"log_version": 1, "config": config}))
        (tmp_path / f"{name}.gguf").write_bytes(b"")
        return str(tmp_path / f"{name}.gguf")

    base = heads("base", data=[])
    child = heads("child", data=[], contexts=["logs", "weather"], init_heads="elsewhere/base.gguf")
    files = heads("files", data=["corpus.jsonl"])
    assert training(base).families == {"pydoc"} and training(child).families == {"pydoc", "logs", "weather"}
    assert check_held_out(["prose", "manual"], {"a": base, "b": child}) == {"a": ["pydoc"],
                                                                            "b": ["logs", "pydoc", "weather"]}
    with pytest.raises(ValueError, match="weather is not held out for b: its heads were trained on logs, pydoc, "
                                         "weather"):
        check_held_out(["manual", "weather"], {"a": base, "b": child})
    with pytest.raises(ValueError, match=r"cannot report held-out families for c: .*data files \(corpus.jsonl\)"):
        check_held_out(["manual"], {"c": files})
    with pytest.raises(ValueError, match="cannot report held-out families for d: no training log at"):
        check_held_out(["manual"], {"d": str(tmp_path / "none.gguf")})
    with pytest.raises(ValueError, match="heads embedded in the model"):
        check_held_out(["manual"], {"e": None})
    orphan = heads("orphan", data=[], init_heads="gone.gguf")
    assert training(orphan).families is None and "gone.gguf" in training(orphan).why
    # a file replaced by its fine-tuned successor: only its log is left, and it still counts
    replaced = heads("replaced", data=[], contexts=["pydoc", "legal"])
    Path(replaced).unlink()
    successor = heads("successor", data=[], contexts=["pypackages"], init_heads="elsewhere/replaced.gguf")
    assert training(successor).families == {"pypackages", "pydoc", "legal"}
    # a log naming itself as its start is no chain
    (tmp_path / "loop.run").mkdir()
    (tmp_path / "loop.run" / "train-log.json").write_text(json.dumps({"config": {"init_heads": "loop.gguf"}}))
    assert training(str(tmp_path / "loop.gguf")).families is None


def test_snapkv_with_the_question_found_pins_it_as_its_window(niah_questions, model_path):
    # the training-free counterpart of locret-q-auto: SnapKV with the question the auto rule finds placed at the start
    # and pinned, so that it is SnapKV's observation window at every eviction (test_snapkv checks the scores)
    from locret.evaluation import items as items_module

    out = niah_questions
    by_method = {s["method"]: s for s in read_jsonl(out / "samples.jsonl")}
    snap, snap_q = by_method["snapkv"], by_method["snapkv-q-auto"]
    vocab = items_module.vocab_model(str(model_path))
    try:
        item, = items_module.task_items(vocab, ["niah"], [LENGTH], [0.5], 1, 0)
    finally:
        vocab.close()
    # the question placed at the start (locret-q's prompt) and pinned; SnapKV alone reads the plain prompt, unpinned
    assert snap_q["query_is_the_tasks"] is True and snap_q["query_found"] == item.query and "query_found" not in snap
    assert snap_q["prompt_tokens"] == len(item.query_tokens) and snap["prompt_tokens"] == len(item.tokens)
    assert 0 < snap_q["pinned"] < 64 and snap["pinned"] == 0
    assert snap["evictions"] >= 3 and snap_q["evictions"] >= 3
    heads_files = json.loads((out / "summary.json").read_text())["settings"]["heads_files"]
    assert "snapkv" not in heads_files and "snapkv-q-auto" not in heads_files   # no heads: training-free
