"""Device profiles (devices/*.toml), `locret plan` and `scripts/setup.sh --device`.

The planner's KV-cache and weight bytes are checked against what llama.cpp itself reports for a real
context with the same settings (its statistics and its own log lines); a plan over a device's memory
must be refused with a message that names the limit and a change that really fits.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, run
from locret import devices, planner

HEADS = REPO / "heads" / "smollm2-135m-instruct.gguf"
REQUIRED = {  # name: (memory kind, CUDA architecture)
    "rtx4090": ("discrete", "89"),
    "jetson-agx-orin-64gb": ("unified", "87"),
    "jetson-orin-nx-16gb": ("unified", "87"),
    "jetson-orin-nano-8gb": ("unified", "87"),
    "cpu-2core": ("host", None),
}
MIB = 1 << 20


def locret_plan(*args: str):
    return run([sys.executable, "-m", "locret", "plan", *map(str, args)], timeout=300)


def one_error_line(proc) -> str:
    """The CLI's contract for errors: one `locret: error:` line, never a traceback."""
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("locret: error: "), proc.stderr
    return lines[0]


def profile_copy(tmp_path: Path, source: str, name: str, edit=lambda text: text) -> Path:
    """A profile written from a shipped one: renamed (the file name must match `name`) and edited."""
    text = (devices.DEVICES_DIR / f"{source}.toml").read_text()
    text = text.replace(f'name = "{source}"', f'name = "{name}"', 1)
    path = tmp_path / f"{name}.toml"
    path.write_text(edit(text))
    return path


def fake_model(path: Path, *, n_layer=40, n_embd=5120, n_head=40, n_head_kv=8, n_ff=13824, n_vocab=152064,
               heads=True) -> Path:
    """A 12.6B-parameter f16 llama-shaped GGUF whose tensor data is a sparse hole: the header is real, the
    23 GiB of data take no disk space and are never read (the planner reads headers, and llama.cpp's metadata load
    for the rule book reads no tensor data; a placeholder vocabulary of the right size stands for the tokenizer)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("no_vocab")
    w.add_vocab_size(n_vocab)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_block_count(n_layer)
    w.add_embedding_length(n_embd)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_context_length(32768)
    w.add_feed_forward_length(n_ff)
    hd = n_embd // n_head
    shapes = {"token_embd.weight": (n_vocab, n_embd), "output.weight": (n_vocab, n_embd), "output_norm.weight": (n_embd,)}
    for i in range(n_layer):
        shapes.update({f"blk.{i}.attn_q.weight": (n_embd, n_embd), f"blk.{i}.attn_k.weight": (n_head_kv * hd, n_embd),
                       f"blk.{i}.attn_v.weight": (n_head_kv * hd, n_embd), f"blk.{i}.attn_output.weight": (n_embd, n_embd),
                       f"blk.{i}.ffn_gate.weight": (n_ff, n_embd), f"blk.{i}.ffn_up.weight": (n_ff, n_embd),
                       f"blk.{i}.ffn_down.weight": (n_embd, n_ff), f"blk.{i}.attn_norm.weight": (n_embd,),
                       f"blk.{i}.ffn_norm.weight": (n_embd,)})
        if heads:  # merged retaining heads, so that the plan needs no heads file
            shapes.update({f"locret.blk.{i}.fc1.weight": (256, (n_head + 2 * n_head_kv) * hd),
                           f"locret.blk.{i}.fc2.weight": (n_head_kv, 256)})
    data = 0
    for name, shape in shapes.items():
        nbytes = int(np.prod(shape)) * 2
        w.add_tensor_info(name, shape, np.dtype(np.float16), nbytes)
        data += -(-nbytes // 32) * 32
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    os.truncate(path, -(-path.stat().st_size // 32) * 32 + data)
    return path


# --- profiles -------------------------------------------------------------------------------------

def test_the_required_devices_have_profiles():
    assert set(REQUIRED) <= set(devices.known_devices())


@pytest.mark.parametrize("name", devices.known_devices())
def test_every_profile_loads_with_all_fields(name):
    dev = devices.load(name)
    assert dev.name == name and dev.description and dev.path == devices.DEVICES_DIR / f"{name}.toml"
    mem = dev.memory
    assert 0 < mem.available_gib <= mem.total_gib and mem.bandwidth_gbs > 0 and mem.reserve_note
    assert mem.available_bytes == int(mem.available_gib * (1 << 30))
    assert dev.compute.klass
    if name in REQUIRED:
        assert (mem.kind, dev.build.cuda_architectures) == REQUIRED[name]
    if mem.kind == "unified":  # CPU, OS and CUDA share the memory: some of it must be set aside
        assert mem.available_gib <= mem.total_gib - 1
    if dev.build.backend == "cuda":
        assert "-DLOCRET_CUDA=ON" in dev.build.cmake_flags
        assert f"-DCMAKE_CUDA_ARCHITECTURES={dev.build.cuda_architectures}" in dev.build.cmake_flags
    else:
        assert dev.build.cuda_architectures is None and "-DLOCRET_CUDA=OFF" in dev.build.cmake_flags
    # every hardware figure is cited, by an address or (the local box) by how it was read
    cited = {f for s in dev.sources for f in s.figures}
    needed = set(devices.CITED_FIGURES) | ({"build.cuda_architectures"} if dev.build.backend == "cuda" else set())
    assert needed <= cited
    assert all(re.match(r"^(https?://|measured: )", s.url) and s.says for s in dev.sources)
    names = [sc.name for sc in dev.size_classes]
    assert {"<1B", "1-4B", "7-8B"} <= set(names)
    for sc in dev.size_classes:
        assert 1 <= sc.ubatch <= sc.budget and 0 <= sc.stabilizers < sc.budget and sc.stabilizers <= sc.ubatch
        assert sc.kv_type in devices.KV_TYPES
        assert sc.gpu_layers == 0 if dev.build.backend == "cpu" else sc.gpu_layers != 0


def test_size_classes_pick_defaults_by_parameter_count():
    dev = devices.load("rtx4090")
    assert dev.size_class_for(135e6) == (dev.size_classes[0], True)
    assert dev.size_class_for(8.03e9)[0].name == "7-8B"
    largest, covered = dev.size_class_for(70e9)
    assert largest == dev.size_classes[-1] and covered is False


def test_a_profile_path_works_like_a_name(tmp_path):
    path = profile_copy(tmp_path, "jetson-orin-nx-16gb", "my-board")
    dev = devices.load(str(path))
    assert dev.name == "my-board" and dev.memory.available_gib == 11.5


@pytest.mark.parametrize("edit, message", [
    (lambda t: re.sub(r"available_gib = [0-9.]+", "available_gib = 30.0", t), "must be > 0 and <= memory.total_gib"),
    (lambda t: t.replace('figures = ["memory.bandwidth_gbs", "compute.class"]', 'figures = ["compute.class"]')
              .replace('figures = ["memory.bandwidth_gbs"]', 'figures = ["compute.class"]'),
     "no [[source]] cites memory.bandwidth_gbs"),
    (lambda t: t.replace('"-DCMAKE_CUDA_ARCHITECTURES=89"', '"-DCMAKE_CUDA_ARCHITECTURES=87"'),
     "must contain -DLOCRET_CUDA=ON and -DCMAKE_CUDA_ARCHITECTURES=89"),
    (lambda t: t.replace('"-DLOCRET_CUDA=ON"', '"-DLOCRET_CUDA=ON; rm -rf /"'), "is not a -DNAME=VALUE flag"),
    (lambda t: t.replace("ubatch = 2048", "ubatch = 32768", 1), "ubatch (32768) above the budget (16384)"),
    (lambda t: t.replace('kv_type = "f16"', 'kv_type = "q3"', 1), "kv_type must be one of"),
    (lambda t: t.replace('gpu_layers = "all"', 'gpu_layers = "most"', 1), "gpu_layers must be \"all\" or a number"),
    (lambda t: t.replace("max_params_b = 9.0", "max_params_b = 0.5", 1), "size classes must grow"),
    (lambda t: t.replace("schema = 1", "schema = 2"), "schema must be 1"),
    (lambda t: t.replace("[memory]", "[memory\n"), "not valid TOML"),
])
def test_invalid_profiles_are_refused_with_the_reason(tmp_path, edit, message):
    path = profile_copy(tmp_path, "rtx4090", "bad-board", edit)
    with pytest.raises(devices.DeviceError) as e:
        devices.load(str(path))
    assert message in str(e.value) and "bad-board.toml" in str(e.value)


def test_a_profile_must_be_named_after_its_file(tmp_path):
    path = tmp_path / "other.toml"
    path.write_text((devices.DEVICES_DIR / "rtx4090.toml").read_text())
    with pytest.raises(devices.DeviceError, match="does not match the file name 'other'"):
        devices.load(str(path))


def test_unknown_device_lists_the_known_ones():
    with pytest.raises(devices.DeviceError) as e:
        devices.load("rtx9090")
    assert "unknown device 'rtx9090'" in str(e.value)
    assert all(name in str(e.value) for name in REQUIRED)


# --- planner: settings and inputs -----------------------------------------------------------------

@pytest.mark.parametrize("text, tokens", [("128k", 131072), ("131072", 131072), ("64K", 65536), ("1m", 1 << 20),
                                          (" 8k ", 8192), (4096, 4096)])
def test_context_sizes_are_parsed(text, tokens):
    assert planner.parse_context(text) == tokens


@pytest.mark.parametrize("text", ["abc", "0", "12kb", "-5", "1.5k", "", "99999999999"])
def test_bad_context_sizes_are_refused(text):
    with pytest.raises(planner.PlanError):
        planner.parse_context(text)


def test_gpu_layers_follow_llama_cpp_placement():
    # n_layer 30: layer il (the output layer is il = 30) is on the GPU when il >= 31 - N; -1 is all
    assert planner._on_gpu(30, -1, "cuda") == (set(range(30)), True)
    assert planner._on_gpu(30, 99, "cuda") == (set(range(30)), True)
    assert planner._on_gpu(30, 10, "cuda") == (set(range(21, 30)), True)
    assert planner._on_gpu(30, 1, "cuda") == (set(), True)
    assert planner._on_gpu(30, 0, "cuda") == (set(), False)
    assert planner._on_gpu(30, -1, "cpu") == (set(), False)


def test_a_discrete_gpu_holds_only_the_offloaded_layers(model_path):
    p = planner.plan("rtx4090", str(model_path), heads=str(HEADS), gpu_layers=10, measure_buffers=False)
    facts = p.model
    sizes = dict(facts.tensors)
    # layers 21..29 and the output layer (its norm; the matrix is token_embd's, see below)
    on_gpu = sum(b for n, b in sizes.items() if re.match(r"blk\.(2[1-9])\.|output", n))
    # SmolLM2 ties its output matrix to token_embd: llama.cpp puts a copy of it on the output layer's GPU
    assert facts.tied_output
    weights = next(x for x in p.parts if x.what == "weights")
    assert weights.device_bytes == on_gpu + sizes["token_embd.weight"]
    assert weights.device_bytes + weights.host_bytes == facts.weight_bytes + sizes["token_embd.weight"]
    kv = next(x for x in p.parts if x.what == "KV cache")
    assert kv.device_bytes * 30 == (kv.device_bytes + kv.host_bytes) * 9


def test_settings_come_from_the_size_class_and_can_be_overridden(model_path):
    p = planner.plan("jetson-orin-nano-8gb", str(model_path), heads=str(HEADS), measure_buffers=False)
    sc = devices.load("jetson-orin-nano-8gb").size_classes[0]
    s = p.settings
    assert (s.size_class, s.budget, s.ubatch, s.kv_type, s.gpu_layers, s.overridden) == \
        ("<1B", sc.budget, sc.ubatch, sc.kv_type, -1, ())
    p = planner.plan("jetson-orin-nano-8gb", str(model_path), heads=str(HEADS), budget=1024, ubatch=256,
                     kv_type="q8_0", context="64k", measure_buffers=False)
    s = p.settings
    assert (s.budget, s.ubatch, s.kv_type, s.context, s.n_cells) == (1024, 256, "q8_0", 65536, 1280)
    assert s.stabilizers == min(sc.stabilizers, 256, 512)   # the profile's, fitted to chunk and half budget
    assert set(s.overridden) == {"budget", "ubatch", "kv_type", "context"}


# --- planner against llama.cpp --------------------------------------------------------------------

@pytest.mark.parametrize("kv_type, ggml_type", [("f16", 1), ("q8_0", 8)])
def test_predicted_kv_and_weight_bytes_match_llama_cpp(model_path, capfd, kv_type, ggml_type):
    p = planner.plan("cpu-2core", str(model_path), heads=str(HEADS), budget=1024, ubatch=512, context="8k",
                     kv_type=kv_type)
    parts = {x.what: x for x in p.parts}
    kv_pred, weights_pred, heads_pred = (parts[k].host_bytes for k in ("KV cache", "weights", "retaining heads"))
    assert p.settings.n_cells == 1536                        # pad(1024 + 512, 256)
    assert p.fits and p.measured is not None

    from locret import Llama
    import llama_cpp

    capfd.readouterr()
    llm = Llama(str(model_path), n_ctx=8192, n_batch=512, n_ubatch=512, locret_budget=1024,
                locret_heads=str(HEADS), type_k=ggml_type, type_v=ggml_type, flash_attn=kv_type != "f16",
                verbose=True)
    log = capfd.readouterr().err
    try:
        stats = llm.locret_stats()
        model_size = llama_cpp.llama_model_size(llm.model)
    finally:
        llm.close()
    # what llama.cpp reports for a real context: its statistics and its own log lines
    kv_log = float(re.search(r"llama_kv_cache: size = +([0-9.]+) MiB \( *(\d+) cells", log).group(1)) * MIB
    model_log = sum(float(x) for x in re.findall(r"model buffer size = +([0-9.]+) MiB", log)) * MIB
    heads_log = float(re.search(r"load_heads: .*, ([0-9.]+) MiB", log).group(1)) * MIB
    assert stats["n_cells"] == 1536
    for reported in (stats["kv_bytes"], kv_log, p.measured.kv_bytes):
        assert abs(kv_pred - reported) <= 0.05 * reported, (kv_pred, reported)
    for reported in (model_size, model_log, p.measured.model_size):
        assert abs(weights_pred - reported) <= 0.05 * reported, (weights_pred, reported)
    assert abs(heads_pred - heads_log) <= 0.05 * heads_log
    # the compute buffers are llama.cpp's numbers, not the planner's: positive, and in the total
    assert p.measured.compute and all(b > 0 for b in p.measured.compute.values())
    assert parts["compute buffers"].host_bytes == sum(p.measured.compute.values())
    assert p.total() == sum(x.host_bytes for x in p.parts)


def test_plan_prints_settings_and_breakdown(model_path):
    proc = locret_plan("--device", "cpu-2core", "--model", model_path, "--heads", HEADS, "--budget", 1024,
                       "--ubatch", 512, "--context", "128k")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "budget 1024, chunk (ubatch) 512" in out and "context 131072" in out
    assert "--locret-budget 1024 -ub 512" in out
    for row in ("weights", "retaining heads", "KV cache", "compute buffers", "output buffer", "total"):
        assert re.search(rf"^  {row} +[0-9.]+ (MiB|GiB)", out, re.M), row
    assert "1536 cells = pad(1024 + 512, 256)" in out and "fits" in out
    proc = locret_plan("--device", "cpu-2core", "--model", model_path, "--heads", HEADS, "--json")
    import json

    data = json.loads(proc.stdout)
    assert data["fits"] and data["limit_bytes"] == 20 << 30 and data["settings"]["budget"] == 2048


def test_a_sage_plan_caches_the_whole_context_and_llama_cpp_agrees(model_path):
    # SAGE-KV reads each prompt whole: the plan sizes the cache by the context, and llama.cpp's own context (measured
    # in the plan) holds exactly that many cells; the budget does not change the memory
    proc = locret_plan("--device", "cpu-2core", "--model", model_path, "--policy", "sage", "--budget", 1024,
                       "--ubatch", 512, "--context", "8k")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "8192 cells = pad(8192, 256)" in out and "(llama.cpp: KV cache" in out
    assert re.search(r"llama\.cpp: KV cache [0-9.]+ MiB in 8192 cells", out), out
    assert "policy sage reads each prompt whole" in out and "policy sage needs no heads" in out
    assert "--locret-policy sage" in out and "--locret-stabilizers" not in out
    small = planner.plan("cpu-2core", str(model_path), policy="sage", budget=256, ubatch=256, context="8k",
                         measure_buffers=False)
    large = planner.plan("cpu-2core", str(model_path), policy="sage", budget=4096, ubatch=256, context="8k",
                         measure_buffers=False)
    kv = [next(x for x in p.parts if x.what == "KV cache").host_bytes for p in (small, large)]
    assert kv[0] == kv[1] > 0 and small.settings.stabilizers == 64
    for kw, msg in ((dict(stabilizers=8), "do not apply"), (dict(context="1k", budget=1024, ubatch=256),
                                                              "must be larger than the budget plus the ubatch"),
                    (dict(budget=4), "at least 8 units"), (dict(policy="sag"), "unknown Locret policy 'sag'")):
        args = dict(policy="sage", budget=1024, ubatch=256, context="8k") | kw
        with pytest.raises(planner.PlanError, match=msg):
            planner.plan("cpu-2core", str(model_path), measure_buffers=False, **args)


def test_a_budget_schedule_plan_sizes_each_budgets_cache_and_llama_cpp_agrees(model_path, tmp_path):
    # pyramid at b = 2048, n_s = 128: the first layer keeps 2 * 2048 - max(2048 / 20, 129) = 3967 (+1 for rounding);
    # its cache holds pad(3968 + 512, 256) = 4608 cells (llama.cpp's own context, measured in the plan, agrees)
    proc = locret_plan("--device", "cpu-2core", "--model", model_path, "--budget", 2048, "--ubatch", 512,
                       "--stabilizers", 128, "--budget-schedule", "pyramid")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "4608 cells = pad(3968 + 512, 256)" in out, out
    assert re.search(r"llama\.cpp: KV cache [0-9.]+ MiB in 4608 cells", out), out
    assert "--locret-budget-schedule pyramid" in out and "the largest 3968" in out
    # each budget's layers in a cache of that budget plus the ubatch (the largest's 4608): the planned KV is what
    # llama.cpp's own context allocates
    budgets = [int(b) for b in re.search(r"layer budgets \(evicting layers in order\): ([0-9 ]+)", out).group(1).split()]
    cells = [4608 if b == 3968 else b + 512 for b in budgets]
    assert "layer cells (evicting layers in order): " + " ".join(map(str, cells)) in out, out
    planned = float(re.search(r"KV cache +([0-9.]+) MiB", out).group(1))
    measured = float(re.search(r"llama\.cpp: KV cache ([0-9.]+) MiB", out).group(1))
    assert planned == measured == round(sum(cells) * 768 / 2**20, 2), out
    schedule = tmp_path / "layers.txt"
    schedule.write_text("# 30 layers\n" + " ".join(["2000"] * 29 + [str(2048 * 30 - 2000 * 29)]) + "\n")
    p = planner.plan("cpu-2core", str(model_path), budget=2048, ubatch=512, schedule=str(schedule),
                     measure_buffers=False)
    assert p.settings.largest_budget == 2048 * 30 - 2000 * 29 == 3440 and p.settings.n_cells == 4096  # pad(3952)
    assert p.settings.layer_budgets == tuple([2000] * 29 + [3440])
    assert "layer budgets (evicting layers in order): " + " ".join(["2000"] * 29 + ["3440"]) in p.notes
    # the heads given are the rule book's: Locret-Q heads keep room for their pinned question in the pyramid's last
    # layer, the plain heads do not
    from locret.query import pin_room
    lq, plain = (planner.plan("cpu-2core", str(model_path), budget=2048, ubatch=512, stabilizers=128,
                              schedule="pyramid", measure_buffers=False, heads=str(h))
                 for h in (REPO / "heads" / "smollm2-135m-instruct.query.gguf",
                           REPO / "heads" / "smollm2-135m-instruct.gguf"))
    assert lq.settings.layer_budgets[-1] == 128 + 1 + pin_room() and plain.settings.layer_budgets[-1] == 129
    assert lq.settings.largest_budget == max(lq.settings.layer_budgets) < plain.settings.largest_budget == 3968
    assert sum(lq.settings.layer_budgets) == sum(plain.settings.layer_budgets) == 30 * 2048
    for kw, msg in ((dict(schedule=str(tmp_path / "none.txt")), "neither uniform, pyramid nor a readable file"),
                    (dict(schedule="pyramid", policy="lagkv"), "heads, random and streaming policies")):
        with pytest.raises(planner.PlanError, match=msg):
            planner.plan("cpu-2core", str(model_path), budget=2048, ubatch=512, measure_buffers=False, **kw)


def test_slots_multiply_the_cache_and_llama_cpp_agrees(model_path):
    # llama-server -np 3: one stream of pad(1024 + 128, 256) = 1280 cells per slot, -c split between the slots
    one = planner.plan("cpu-2core", str(model_path), heads=str(HEADS), budget=1024, ubatch=128, context=8192)
    three = planner.plan("cpu-2core", str(model_path), heads=str(HEADS), budget=1024, ubatch=128, context=8192, slots=3)
    kv = [next(x for x in p.parts if x.what == "KV cache").host_bytes for p in (one, three)]
    assert kv[1] == 3 * kv[0] == 3 * 1280 * 30 * (192 + 192) * 2
    assert three.measured.kv_bytes == kv[1]            # llama.cpp's own context with n_seq_max 3, non-unified
    assert "-np 3" in " ".join(three.settings.llama_args(HEADS)) and "-c 24576" in " ".join(three.settings.llama_args(HEADS))
    assert "1280 cells = pad(1024 + 128, 256) x 3 slots" in planner.format_plan(three)
    # Locret's own buffers (the eviction graphs' from the C API, the rest from its creation log): the score store is a
    # float per cell, KV head and layer of every stream, and the host keeps the units' positions in the same shape; the
    # eviction graphs and move tables are sized for the sequences of one compaction, at most planner.COMPACT_MAX_SEQ
    # whatever the slots
    n_max = planner.COMPACT_MAX_SEQ
    at_max, twice = (planner.plan("cpu-2core", str(model_path), heads=str(HEADS), budget=1024, ubatch=128,
                                  context=8192, slots=n) for n in (n_max, 2 * n_max))
    for p, n in ((one, 1), (three, 3), (at_max, n_max), (twice, 2 * n_max)):
        assert abs(p.measured.locret["score store"] - n * 1280 * 3 * 30 * 4) < 0.01 * MIB, p.measured.locret
        assert p.measured.compact_seq == min(n, n_max), (n, p.measured.compact_seq)
        scores = next(x for x in p.parts if x.what == planner.LOCRET_SCORES_PART)
        assert scores.host_bytes == 2 * p.measured.locret["score store"]
        part = next(x for x in p.parts if x.what == planner.LOCRET_PART)
        assert part.host_bytes == p.measured.locret["eviction graphs"] + p.measured.locret["move tables"]
    assert three.measured.locret["move tables"] > 2.5 * one.measured.locret["move tables"] > 0
    assert twice.measured.locret["move tables"] == at_max.measured.locret["move tables"]
    assert twice.measured.locret["eviction graphs"] == at_max.measured.locret["eviction graphs"] > 0
    # every sequence's sampler: arrays over the vocabulary (llama-server's RSS per slot, see planner.SAMPLING_PART)
    for p, n in ((one, 1), (three, 3), (twice, 2 * n_max)):
        sampling = next(x for x in p.parts if x.what == planner.SAMPLING_PART)
        assert p.measured.n_vocab == 49152 and sampling.host_bytes == n * 49152 * planner.SAMPLING_BYTES_PER_TOKEN
    # and the plan for more slots, scaled from one slot's measurement, agrees with llama.cpp's at those slots
    for p in (three, at_max, twice):
        assert abs(planner._variant_total(one, slots=p.settings.slots) - p.total()) < 0.02 * p.total(), p.settings.slots


def test_max_slots_is_the_most_that_fit(tmp_path, model_path):
    one = planner.plan("cpu-2core", str(model_path), heads=str(HEADS), budget=1024, ubatch=128)
    per_slot = planner.plan("cpu-2core", str(model_path), heads=str(HEADS), budget=1024, ubatch=128, slots=2).total() \
        - one.total()
    # a board with room for the fixed parts and 4.5 slots' worth: 4 slots fit, 5 do not
    gib = (one.total() + 3.5 * per_slot) / (1 << 30)
    board = profile_copy(tmp_path, "cpu-2core", "slot-board",
                         lambda t: re.sub(r"available_gib = [0-9.]+", f"available_gib = {gib:.6f}", t))
    best = planner.plan(str(board), str(model_path), heads=str(HEADS), budget=1024, ubatch=128, slots="max")
    assert best.settings.slots == 4 and best.fits, planner.format_plan(best)
    assert any(n.startswith("slots: 4, the most that fit (one more slot adds") for n in best.notes), best.notes
    assert not planner.plan(str(board), str(model_path), heads=str(HEADS), budget=1024, ubatch=128, slots=5).fits
    # on this machine's profile memory is not the limit for SmolLM2: llama.cpp's 256 sequences are
    roomy = planner.plan("cpu-2core", str(model_path), heads=str(HEADS), budget=1024, ubatch=128, slots="max")
    assert roomy.settings.slots == planner.MAX_SLOTS and roomy.fits
    assert any("llama.cpp's limit of 256 sequences" in n for n in roomy.notes)
    for slots, msg in ((0, "slots must be between 1 and 256"), (257, "slots must be between 1 and 256"),
                       ("lots", "slots must be a whole number or 'max'")):
        with pytest.raises(planner.PlanError, match=msg):
            planner.plan("cpu-2core", str(model_path), heads=str(HEADS), slots=slots, measure_buffers=False)


def test_serve_passes_the_slots_to_llama_server(tmp_path, model_path):
    def command(*args):
        proc = run([sys.executable, "-m", "locret", "serve", "--model", model_path, "--heads", HEADS, *args,
                    "--print-command"], timeout=120)
        return proc.returncode, proc.stdout.split(), proc.stderr
    rc, cmd, _ = command("--slots", "3", "--context", "8k")
    assert rc == 0 and cmd[cmd.index("-np") + 1] == "3" and cmd[cmd.index("-c") + 1] == str(3 * 8192)
    rc, cmd, _ = command("--slots", "max", "--device", "cpu-2core", "--budget", "1024", "--ubatch", "128")
    assert rc == 0 and cmd[cmd.index("-np") + 1] == "256", cmd
    rc, _, err = command("--slots", "max")
    assert rc == 1 and "--slots max needs --device" in err


# --- refusals -------------------------------------------------------------------------------------

def test_an_absurd_budget_is_refused_naming_the_limit(model_path):
    proc = locret_plan("--device", "cpu-2core", "--model", model_path, "--heads", HEADS, "--budget", 100_000_000)
    assert proc.returncode == planner.EXIT_DOES_NOT_FIT
    msg = one_error_line(proc)
    assert "does not fit on cpu-2core" in msg and "> 20.00 GiB of memory available" in msg
    assert "memory.available_gib in cpu-2core.toml" in msg and "--budget" in msg
    assert "does NOT fit" in proc.stdout


def test_the_suggested_changes_really_fit(tmp_path, model_path):
    # a board with 250 MiB for the model: the default plan (about 271 MiB) does not fit
    board = profile_copy(tmp_path, "cpu-2core", "tiny-board",
                         lambda t: re.sub(r"available_gib = [0-9.]+", "available_gib = 0.244140625", t))
    p = planner.plan(str(board), str(model_path), heads=str(HEADS))
    assert p.measured is not None and not p.fits
    msg = planner.refusal(p)
    assert "does not fit on tiny-board" in msg and "250.00 MiB" in msg and "tiny-board.toml" in msg
    budget = int(re.search(r"--budget (\d+)", msg).group(1))
    assert budget < p.settings.budget
    assert planner.plan(str(board), str(model_path), heads=str(HEADS), budget=budget).fits
    assert "--kv-type q8_0" in msg
    assert planner.plan(str(board), str(model_path), heads=str(HEADS), kv_type="q8_0").fits


def test_a_model_too_large_for_a_jetson_nano_is_refused(tmp_path):
    model = fake_model(tmp_path / "fake-12b-f16.gguf")
    proc = locret_plan("--device", "jetson-orin-nano-8gb", "--model", model)
    assert proc.returncode == planner.EXIT_DOES_NOT_FIT
    msg = one_error_line(proc)
    assert "does not fit on jetson-orin-nano-8gb" in msg and "5.50 GiB" in msg
    assert "the weights alone (23.41 GiB) exceed it" in msg and "smaller or more quantized model" in msg
    assert "above every size class" in proc.stdout   # 12.6B: the Nano's largest class (7-8B) was used


def test_on_a_discrete_gpu_fewer_gpu_layers_are_suggested(tmp_path):
    model = fake_model(tmp_path / "fake-12b-f16.gguf")
    p = planner.plan("rtx4090", str(model), measure_buffers=False)
    assert p.total() > p.limit
    layers = int(re.search(r"--gpu-layers (\d+)", planner.refusal(p)).group(1))
    assert planner.plan("rtx4090", str(model), gpu_layers=layers, measure_buffers=False).total() <= p.limit
    assert planner.plan("rtx4090", str(model), gpu_layers=layers + 1, measure_buffers=False).total() > p.limit


@pytest.mark.parametrize("args, message", [
    (["--device", "nope"], "unknown device 'nope': known devices are cpu-2core, jetson-agx-orin-64gb"),
    (["--model", "/nonexistent/model.gguf"], "no such file"),
    (["--budget", "0"], "the budget must be at least 1"),
    (["--budget", "-3"], "the budget must be at least 1"),
    (["--budget", "1024", "--ubatch", "2048"], "the ubatch (2048) is larger than the budget (1024)"),
    (["--ubatch", "0"], "the ubatch (chunk) must be at least 1"),
    (["--context", "lots"], "context 'lots' is not a number of tokens"),
    (["--context", "100"], "the ubatch (-ub 512) is larger than the context"),
    (["--stabilizers", "600"], "the stabilizers (600) must fit in one ubatch"),
    (["--kv-type", "q3"], "unknown KV cache type 'q3'"),
    (["--kv-type", "q4_0"], "K cache loses what it holds under repeated eviction"),
    (["--gpu-layers", "4"], "cpu-2core has no GPU"),
    (["--heads", "MODEL"], "is not a retaining heads file"),
    (["--model", "HEADS"], "is a retaining heads file, not a model"),
    (["--model", "FAKE_WITHOUT_HEADS"], "no retaining heads for"),
])
def test_bad_inputs_are_one_line_errors(tmp_path, model_path, args, message):
    swap = {"MODEL": model_path, "HEADS": HEADS}
    if "FAKE_WITHOUT_HEADS" in args:  # a model that neither embeds heads nor has shipped ones
        swap["FAKE_WITHOUT_HEADS"] = fake_model(tmp_path / "no-heads.gguf", heads=False)
    given = {k: swap.get(v, v) for k, v in zip(args[::2], args[1::2])}
    full = {"--device": "cpu-2core", "--model": model_path, "--heads": HEADS, **given}
    if "FAKE_WITHOUT_HEADS" in args:
        del full["--heads"]
    proc = locret_plan(*[x for kv in full.items() for x in kv])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert message in one_error_line(proc)


# --- setup.sh --device ----------------------------------------------------------------------------

def setup_config(*args: str):
    env = {**os.environ, "PYTHON": sys.executable}   # devices.py runs with the setup's Python
    return run(["bash", REPO / "scripts" / "setup.sh", *args, "--print-config"], timeout=60, env=env)


@pytest.mark.parametrize("device, flags", [
    ("cpu-2core", "-DLOCRET_CUDA=OFF"),
    ("rtx4090", "-DLOCRET_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=89"),
    ("jetson-agx-orin-64gb", "-DLOCRET_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=87"),
    ("jetson-orin-nx-16gb", "-DLOCRET_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=87"),
    ("jetson-orin-nano-8gb", "-DLOCRET_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=87"),
])
def test_setup_builds_for_the_device_profile(device, flags):
    proc = setup_config("--device", device)
    assert proc.returncode == 0, proc.stderr
    cmake = re.search(r"^cmake: +cmake (.*)$", proc.stdout, re.M).group(1)
    assert cmake == f"-S {REPO} -B {REPO / 'build'} -G Ninja -DCMAKE_BUILD_TYPE=Release {flags}"


def test_setup_device_matches_the_plain_builds():
    def cmake(*args):
        return re.search(r"^cmake: +(.*)$", setup_config(*args).stdout, re.M).group(1)

    # the same configuration key as before profiles existed, so existing build folders are kept
    assert cmake("--device", "cpu-2core") == cmake()
    assert cmake("--device", "rtx4090") == cmake("--cuda", "89")
    assert cmake("--device", "jetson-orin-nano-8gb", "--build-dir", "/tmp/x") == cmake("--cuda", "87", "--build-dir", "/tmp/x")


def test_setup_passes_a_profiles_extra_flags(tmp_path):
    board = profile_copy(tmp_path, "jetson-orin-nano-8gb", "nano-fa", lambda t: t.replace(
        '"-DCMAKE_CUDA_ARCHITECTURES=87"]', '"-DCMAKE_CUDA_ARCHITECTURES=87", "-DGGML_CUDA_FA_ALL_QUANTS=ON"]'))
    proc = setup_config("--device", str(board))
    assert proc.returncode == 0, proc.stderr
    assert "-DCMAKE_CUDA_ARCHITECTURES=87 -DGGML_CUDA_FA_ALL_QUANTS=ON" in proc.stdout


@pytest.mark.parametrize("args, rc, message", [
    (["--device", "nope"], 1, "unknown device 'nope': known devices are"),
    (["--device", "rtx4090", "--cuda", "89"], 2, "give --device or --cuda, not both"),
    (["--device"], 2, "--device needs a device name"),
])
def test_setup_refuses_bad_devices(args, rc, message):
    proc = setup_config(*args) if args != ["--device"] else run(["bash", REPO / "scripts" / "setup.sh", "--device"])
    assert proc.returncode == rc and message in proc.stderr


def test_setup_sanitize_builds_apart_with_both_sanitizers():
    proc = setup_config("--sanitize")
    assert proc.returncode == 0, proc.stderr
    cmake = re.search(r"^cmake: +cmake (.*)$", proc.stdout, re.M).group(1)
    assert cmake == (f"-S {REPO} -B {REPO / 'build-sanitize'} -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "
                     "-DLLAMA_SANITIZE_ADDRESS=ON -DLLAMA_SANITIZE_UNDEFINED=ON -DGGML_SANITIZE_ADDRESS=ON "
                     "-DGGML_SANITIZE_UNDEFINED=ON -DLOCRET_CUDA=OFF")
    proc = setup_config("--sanitize", "--cuda", "89")
    assert proc.returncode == 2 and "--sanitize is a CPU build" in proc.stderr
    # the check script refuses a build without the sanitizers, with the command that makes one
    proc = run(["bash", REPO / "scripts" / "sanitize_check.sh"], timeout=60,
               env={**os.environ, "LOCRET_SANITIZE_BUILD": str(REPO / "build")})
    assert proc.returncode == 1 and "run 'bash scripts/setup.sh --sanitize' first" in proc.stderr
