"""The coverage-guided fuzzers' regression inputs, replayed in every test run (ctest replays the C++ targets' corpora:
replay-locret-heads, replay-locret-state). Each file in tests/fuzz-corpus/gguf-header made the converter's GGUF header
walk fail once (a refusal whose message spanned lines, an uncaught exception); it must now be refused with a one-line
ConversionError."""
from __future__ import annotations

import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
import fuzz_gguf_header  # noqa: E402

CORPUS = REPO / "tests" / "fuzz-corpus" / "gguf-header"
INPUTS = sorted(p for p in CORPUS.iterdir() if p.is_file() and not p.name.startswith("."))


def test_the_regression_corpus_is_there():
    assert len(INPUTS) >= 2, "the findings of the first campaign are kept as regression inputs"


@pytest.mark.parametrize("path", INPUTS, ids=[p.name for p in INPUTS])
def test_a_fuzzing_finding_is_refused_on_one_line(path, tmp_path):
    from locret.convert.errors import ConversionError

    fuzz_gguf_header.check_one(path.read_bytes(), tmp_path / "input.gguf")  # raises on a finding
    with pytest.raises(ConversionError) as refused:
        from locret.convert.base_model import read_base_model

        read_base_model(tmp_path / "input.gguf")
    assert "\n" not in str(refused.value).strip()


def test_the_seeds_are_accepted(tmp_path):
    # the fuzzer starts from inputs the reader accepts, so that it explores past the first refusal
    from locret.convert.base_model import read_base_model

    for seed in fuzz_gguf_header.write_seeds(tmp_path):
        model = read_base_model(seed)
        assert model.architecture == "llama" and model.n_layer == 2 and model.n_head_kv == 2
