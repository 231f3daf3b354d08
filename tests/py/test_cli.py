"""The `locret` command line: subcommands reach the right code and pass exit statuses through."""
from __future__ import annotations

import sys

from conftest import run


def locret(*args, timeout=300):
    return run([sys.executable, "-m", "locret", *args], timeout=timeout)


def test_version_reports_our_library():
    proc = locret("version")
    assert proc.returncode == 0, proc.stderr
    assert "libllama" in proc.stdout and "patch series" in proc.stdout


def test_convert_is_the_heads_converter(model_path, tmp_path):
    out = tmp_path / "random.safetensors"
    proc = locret("convert", "make-random", "--base", model_path, "--d-r", "32", "--seed", "3", "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert out.stat().st_size > 0
    bad = locret("convert", "--base", tmp_path / "missing.gguf", "--heads", out, "-o", tmp_path / "x.gguf")
    assert bad.returncode == 1 and "heads_to_gguf: error:" in bad.stderr, bad.stderr


def test_unknown_subcommand_is_a_usage_error():
    proc = locret("frobnicate")
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_train_is_the_head_trainer(tmp_path):
    proc = locret("train", "--help")
    assert proc.returncode == 0 and "--max-minutes" in proc.stdout, proc.stderr
    bad = locret("train", "--base", tmp_path / "missing.gguf", "-o", tmp_path / "h.gguf")
    assert bad.returncode == 1 and "train_heads: error:" in bad.stderr and "no such file" in bad.stderr, bad.stderr
