"""The converter's checkpoint readers under mutated input (scripts/fuzz_checkpoints.py): every input loads or is
refused with a ConversionError. A short seeded run here; the long run's figures are in the README."""
from __future__ import annotations

import pytest
import fuzz_checkpoints  # scripts/, on sys.path through conftest


def test_mutated_checkpoints_load_or_are_refused_with_a_conversion_error():
    stats = fuzz_checkpoints.run(3000, seed=7, kinds=list(fuzz_checkpoints.KINDS), timeout=20.0, progress=False)
    assert stats["inputs"] == 3000
    assert not stats["failures"], stats["failures"][:5]
    # the mutations reach both outcomes: some inputs still read, most are refused (all four kinds, the heads GGUF included)
    assert stats["loaded"] >= 30 and stats["refused"] >= 1000, stats


def test_the_harness_reports_what_is_not_a_conversion_error(monkeypatch):
    import locret.convert.checkpoint as checkpoint

    real = checkpoint.read_checkpoint
    calls = []

    def flaky(path):
        # a reader that crashes on the mutated inputs it would have accepted (the seed, read first, still reads)
        calls.append(path)
        result = real(path)
        if len(calls) > 1:
            raise KeyError("boom")
        return result

    monkeypatch.setattr(checkpoint, "read_checkpoint", flaky)
    stats = fuzz_checkpoints.run(200, seed=7, kinds=["safetensors"], timeout=20.0, progress=False)
    assert stats["failures"] and all("KeyError" in f[3] for f in stats["failures"])


def test_the_seeds_read_cleanly(tmp_path):
    seeds = fuzz_checkpoints.make_seeds(tmp_path)
    for kind, (path, _) in seeds.items():
        assert fuzz_checkpoints.read_all(path.parent if kind == "index" else path) == 6


def test_bad_arguments_are_refused(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["fuzz_checkpoints.py", "--kinds", "pickle"])
    assert fuzz_checkpoints.main() == 2
    assert "--kinds must name some of" in capsys.readouterr().err


def test_tensors_saved_with_requires_grad_are_read(tmp_path):
    # found by the fuzzer (a flipped bit in the pickle set requires_grad): parameters saved as such must convert too
    import torch

    tensors = {name: torch.nn.Parameter(t.float()) for name, t in fuzz_checkpoints.seed_tensors().items()}
    path = tmp_path / "params.pt"
    torch.save(tensors, path)
    assert fuzz_checkpoints.read_all(path) == 6


def test_a_gguf_count_beyond_the_file_is_refused_at_once(tmp_path):
    # found by the fuzzer (seed 1, input 1180: 4 bytes removed inside a key): gguf-py then reads a count of
    # about 2^60 items one by one past the end of its map, which never ends; the header walk against the file
    # size refuses the count before gguf-py sees the file
    import random
    import signal

    from locret.convert.checkpoint import read_checkpoint
    from locret.convert.errors import ConversionError

    path = fuzz_checkpoints.write_gguf_seed(fuzz_checkpoints.seed_tensors(), tmp_path / "heads.gguf")
    data, how = fuzz_checkpoints.mutate(path.read_bytes(), "gguf", random.Random("1:1180"))
    assert how == ["remove@862"]
    path.write_bytes(data)

    class TookTooLong(Exception):  # not an OSError: the reader turns those into refusals
        pass

    def too_long(signum, frame):
        raise TookTooLong("read_checkpoint took more than 10 s")

    previous = signal.signal(signal.SIGALRM, too_long)
    signal.alarm(10)
    try:
        with pytest.raises(ConversionError, match="corrupt or truncated GGUF file"):
            read_checkpoint(path)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
