"""Saved states of an evicting context are refused, with a reason, wherever loading them would mix them with other
settings: another budget, other retaining heads, another policy, a context that does not evict, a state saved without
eviction; and a truncated session file. After every refusal the context is empty and keeps working.

The settings are those of test_eviction (SmolLM2, b = 96, ubatch 32); the saved state has been through evictions.
"""
from __future__ import annotations

import ctypes
import sys
from contextlib import contextmanager

import numpy as np
import pytest

import locret  # noqa: F401  (points llama_cpp at our library)
import llama_cpp
from llama_cpp import _logger

from conftest import run
from test_eviction import B, CONVERTER, UB, decode, last_logits, make, prompt_tokens  # noqa: F401 (shared fixture)

N_PROMPT = 320  # tokens before the state is saved: several evictions at b = 96, ubatch 32


@contextmanager
def captured_log():
    """llama.cpp's log lines while inside, as (level, text); llama-cpp-python's own logger afterwards"""
    lines: list[tuple[int, str]] = []

    @llama_cpp.llama_log_callback
    def on_log(level, text, user_data):
        lines.append((level, (text or b"").decode(errors="replace")))

    llama_cpp.llama_log_set(on_log, ctypes.c_void_p(0))
    try:
        yield lines
    finally:
        llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))


def errors(lines) -> str:
    return "".join(text for level, text in lines if level == 4)  # GGML_LOG_LEVEL_ERROR


def prefill(llm, tokens):
    n_past = 0
    for i in range(0, len(tokens), UB):
        n_past = decode(llm, tokens[i:i + UB], n_past, i + UB >= len(tokens))
    return n_past


@pytest.fixture(scope="module")
def saved(model_path, heads_file, prompt_tokens, tmp_path_factory):
    """the state of an evicting context after N_PROMPT tokens: bytes, a session file with its tokens, and
    llama-cpp-python's LlamaState"""
    llm = make(model_path, heads_file)
    tokens = prompt_tokens[:N_PROMPT]
    prefill(llm, tokens)
    assert llm.locret_stats()["n_evictions"] >= 5
    state = llm.save_state()
    data = bytes(state.llama_state)
    path = tmp_path_factory.mktemp("state") / "session.bin"
    arr = (llama_cpp.llama_token * len(tokens))(*tokens)
    assert llama_cpp.llama_state_save_file(llm._ctx.ctx, str(path).encode(), arr, len(tokens))
    seq_path = path.with_name("sequence.bin")  # one sequence's state, as llama-server saves a slot
    assert llama_cpp.llama_state_seq_save_file(llm._ctx.ctx, str(seq_path).encode(), 0, arr, len(tokens)) > 0
    llm.close()
    return data, path, state, seq_path


@pytest.fixture(scope="module")
def other_heads(model_path, tmp_path_factory):
    """heads of the same shape as test_eviction's, from another seed: only their fingerprint tells them apart"""
    work = tmp_path_factory.mktemp("other-heads")
    ckpt, out = work / "random.safetensors", work / "heads.gguf"
    for args in (["make-random", "--base", model_path, "--d-r", "64", "--seed", "4", "-o", ckpt],
                 ["--base", model_path, "--heads", ckpt, "-o", out]):
        proc = run([sys.executable, CONVERTER, *args], timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def load_bytes(llm, data: bytes) -> int:
    buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
    return llama_cpp.llama_state_set_data(llm._ctx.ctx, buf, len(data))


def refusal_of(llm, data: bytes) -> str:
    """Loads `data`, which must be refused, and returns the errors the refusal logged."""
    with captured_log() as lines:
        assert load_bytes(llm, data) == 0
    return errors(lines)


def load_file(llm, path) -> bool:
    tokens = (llama_cpp.llama_token * 4096)()
    n = ctypes.c_size_t(0)
    return bool(llama_cpp.llama_state_load_file(llm._ctx.ctx, str(path).encode(), tokens, 4096, ctypes.byref(n)))


def load_seq_file(llm, path) -> bool:
    tokens = (llama_cpp.llama_token * 4096)()
    n = ctypes.c_size_t(0)
    return llama_cpp.llama_state_seq_load_file(llm._ctx.ctx, str(path).encode(), 0, tokens, 4096, ctypes.byref(n)) > 0


def assert_empty_and_working(llm, prompt_tokens):
    """nothing of the refused state is left, and a prefill gives a fresh context's logits"""
    mem = llama_cpp.llama_get_memory(llm._ctx.ctx)
    assert llama_cpp.llama_memory_seq_pos_max(mem, 0) == -1
    prefill(llm, prompt_tokens[:2 * UB])
    got = last_logits(llm)
    assert np.isfinite(got).all()
    return got


# (what differs in the loading context, keyword arguments of make, what the refusal says)
MISMATCHES = {
    "budget": (dict(locret_budget=B + 32), "another model or budget"),
    "policy": (dict(locret_policy="streaming", locret_heads=None), "another policy or other retaining heads"),
    "heads": (None, "another policy or other retaining heads"),  # other_heads
    "pool": (dict(locret_pool=5), "scores were pooled over 0 tokens, this context's over 5"),
}


@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_a_state_from_other_settings_is_refused_with_the_reason(case, saved, model_path, heads_file, other_heads,
                                                               prompt_tokens):
    kw, reason = MISMATCHES[case]
    llm = make(model_path, other_heads) if kw is None else make(model_path, heads_file, **kw)
    decode(llm, prompt_tokens[:UB], 0, True)  # something the refusal must not leave behind
    data, path, state, seq_path = saved
    refused = refusal_of(llm, data)
    assert reason in refused, refused
    assert_empty_and_working(llm, prompt_tokens)

    llm.reset()
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm._ctx.ctx), True)
    with captured_log() as lines:
        assert not load_file(llm, path)
    assert reason in errors(lines), errors(lines)
    assert_empty_and_working(llm, prompt_tokens)
    llm.close()


def test_a_state_saved_without_eviction_is_refused(model_path, heads_file, prompt_tokens):
    # heads attached, no eviction; flash attention as an evicting context has it by default (V by rows), so that what
    # refuses the state is its missing Locret section, not llama.cpp's check of the V layout
    plain = make(model_path, heads_file, locret_budget=None, locret_stabilizers=None, locret_local=None, flash_attn=True)
    prefill(plain, prompt_tokens[:2 * UB])
    data = bytes(plain.save_state().llama_state)
    plain.close()

    llm = make(model_path, heads_file)
    refused = refusal_of(llm, data)
    assert "ends before its Locret section" in refused, refused
    assert_empty_and_working(llm, prompt_tokens)
    llm.close()


def test_an_evicting_state_is_refused_by_a_context_that_does_not_evict(saved, model_path, heads_file):
    """A cache without eviction reads the cells and stops before the Locret section; llama.cpp's loaders refuse a
    state they did not read to the end (the cells' positions are compacted ones, meaningless to such a cache)."""
    data, path, state, seq_path = saved
    # the evicting context's V layout (flash attention, its default), so that llama.cpp's loader reads the cells
    plain = make(model_path, heads_file, locret_budget=None, locret_stabilizers=None, locret_local=None, flash_attn=True)
    with captured_log() as lines:
        assert not load_file(plain, path)
    assert "did not read all of the session file data" in errors(lines), errors(lines)
    with pytest.raises(RuntimeError, match="Failed to set llama state data"):
        plain.load_state(state)
    plain.close()


# a cut of 1 or 200 bytes used to load: llama_file read past the end without an error (patch 0015)
@pytest.mark.parametrize("cut", [1, 200, 4096])
@pytest.mark.parametrize("kind", ["context", "sequence"])
def test_a_truncated_session_file_is_refused(kind, cut, saved, model_path, heads_file, prompt_tokens, tmp_path):
    data, path, state, seq_path = saved
    whole = path if kind == "context" else seq_path
    load = load_file if kind == "context" else load_seq_file
    short = tmp_path / "short.bin"
    short.write_bytes(whole.read_bytes()[:-cut])
    llm = make(model_path, heads_file)
    decode(llm, prompt_tokens[:UB], 0, True)
    with captured_log() as lines:
        assert not load(llm, short)
    assert "end of file" in errors(lines), errors(lines)
    assert_empty_and_working(llm, prompt_tokens)

    # the whole file still loads, and continues like the context that saved it
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm._ctx.ctx), True)
    assert load(llm, whole)
    assert llm.locret_stats()["pos_logical"] == N_PROMPT
    llm.close()


def mutated(data: bytes, section: int, rng: np.random.Generator) -> bytes:
    """one to three mutations of a saved state, most of them in its last `section` bytes (the Locret section):
    a truncation, flipped bits, a 4- or 8-byte field set to a boundary value"""
    out = bytearray(data)
    boundary = [0, 1, 2, 0x7F, 0xFF, 0x7FFF, 0xFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0x7FFFFFFFFFFFFFFF,
                0xFFFFFFFFFFFFFFFF]
    for _ in range(int(rng.integers(1, 4))):
        n = len(out)
        at = int(rng.integers(max(0, n - section), n)) if rng.random() < 0.9 else int(rng.integers(0, n))
        kind = rng.integers(0, 3)
        if kind == 0:
            del out[at:]
        elif kind == 1:
            for _ in range(int(rng.integers(1, 9))):
                i = int(rng.integers(max(0, n - section), n))
                out[i] ^= 1 << int(rng.integers(0, 8))
        else:
            width = 4 if rng.random() < 0.5 else 8
            at = max(0, min(at - at % 4, len(out) - width))
            value = boundary[int(rng.integers(0, len(boundary)))] & ((1 << (8 * width)) - 1)
            out[at:at + width] = value.to_bytes(width, "little")
        if not out:
            break
    return bytes(out)


def test_mutated_states_load_or_are_refused(saved, model_path, heads_file, prompt_tokens):
    """A seeded mutation loop over the saved state (LOCRET_FUZZ_INPUTS inputs, 300 by default): each load either
    takes the whole state or is refused (0) with an error message; a refused load leaves the context empty, and the
    context keeps decoding after every input. A crash fails the run."""
    import os
    data, path, state, seq_path = saved
    llm = make(model_path, heads_file)
    n_inputs = int(os.environ.get("LOCRET_FUZZ_INPUTS", "300"))
    rng = np.random.default_rng(11)
    # the Locret section (header, sequence header, positions and scores of every (layer, head): about 70 KB here)
    # and a little before it
    section = 100 * 1024
    mem = llama_cpp.llama_get_memory(llm._ctx.ctx)
    n_loaded = n_refused = 0
    for i in range(n_inputs):
        bad = mutated(data, section, rng)
        with captured_log() as lines:
            got = load_bytes(llm, bad)
        if got == 0:
            n_refused += 1
            assert errors(lines), f"input {i} was refused without a message"
            assert llama_cpp.llama_memory_seq_pos_max(mem, 0) == -1, f"input {i}: a refused load left cells behind"
        else:
            n_loaded += 1
            assert got <= len(bad)
        if i % 25 == 0:  # the context still works (a mutated but accepted state may hold any values)
            llama_cpp.llama_memory_clear(mem, True)
            decode(llm, prompt_tokens[:UB], 0, True)
            assert np.isfinite(last_logits(llm)).all()
    print(f"state fuzz: {n_inputs} inputs, {n_loaded} loaded, {n_refused} refused with a message")
    assert n_refused > n_inputs // 2  # the mutations mostly hit what the loader checks
    llm.close()
