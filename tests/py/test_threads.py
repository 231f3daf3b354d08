"""The thread count of a run that names none: LLAMA_ARG_THREADS, read by the library as llama.cpp's tools read it."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from locret.llama import Llama
from locret.threads import THREADS_ENV, default_threads, threads_from_env, threads_or_default

from conftest import REPO


@pytest.mark.parametrize("value, want", [("", None), ("3", 3), (" 1 ", 1), ("0", os.cpu_count()),
                                         ("-1", os.cpu_count())])
def test_the_variable_reads_as_llama_cpp_reads_it(monkeypatch, value, want):
    monkeypatch.setenv(THREADS_ENV, value)
    assert threads_from_env() == want
    assert default_threads(5) == (want or 5)


def test_an_unset_variable_leaves_the_fallback_or_every_core(monkeypatch):
    monkeypatch.delenv(THREADS_ENV, raising=False)
    assert threads_from_env() is None
    assert default_threads(2) == 2
    assert default_threads() == os.cpu_count()


@pytest.mark.parametrize("value", ["abc", "2.5", "two"])
def test_a_bad_value_is_refused_with_the_variables_name(monkeypatch, value):
    monkeypatch.setenv(THREADS_ENV, value)
    with pytest.raises(ValueError, match=f"LLAMA_ARG_THREADS='{value}' is not a number of threads"):
        threads_from_env()


def test_the_library_takes_the_variable_where_a_run_names_no_count(monkeypatch, model_path):
    monkeypatch.setenv(THREADS_ENV, "1")
    llm = Llama(str(model_path), n_ctx=256, verbose=False)
    assert (llm.context_params.n_threads, llm.context_params.n_threads_batch) == (1, 1)
    llm.close()
    # a count the caller names wins; the other one still follows the variable
    llm = Llama(str(model_path), n_ctx=256, n_threads=2, verbose=False)
    assert (llm.context_params.n_threads, llm.context_params.n_threads_batch) == (2, 1)
    llm.close()


def test_a_count_named_wins_even_when_it_is_refused_later(monkeypatch):
    monkeypatch.setenv(THREADS_ENV, "3")
    assert threads_or_default(None, 2) == 3 and threads_or_default(1, 2) == 1 and threads_or_default(0, 2) == 0


def test_a_bad_value_stops_locret_eval_before_it_runs(tmp_path):
    env = dict(os.environ, **{THREADS_ENV: "many"})
    proc = subprocess.run([sys.executable, "-m", "locret", "eval", "--tasks", "passkey", "--lengths", "640",
                           "--methods", "full", "-o", str(tmp_path / "out")], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "LLAMA_ARG_THREADS='many' is not a number of threads" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out" / "samples.jsonl").exists()
