#!/usr/bin/env python3
"""Coverage-guided fuzz target (atheris, libFuzzer for Python) for the converter's GGUF header walk: every input is a
model file that `locret.convert.base_model.read_base_model` reads (the package's bounded header reader, then the
attention shape). It must give a BaseModel or a ConversionError with a one-line message; any other exception, a hang
or a crash is a finding.

    .venv/bin/python scripts/fuzz_gguf_header.py CORPUS_DIR [libFuzzer flags, e.g. -max_total_time=3600]
    .venv/bin/python scripts/fuzz_gguf_header.py --write-seeds DIR     writes the seeds (two small valid models)

scripts/fuzz.sh runs it beside the C++ targets; tests/py/test_fuzz_regressions.py replays tests/fuzz-corpus/gguf-header.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "py"))

# scripts/fuzz.sh names a scratch folder it removes afterwards: libFuzzer ends the process without returning, so the
# `finally` in main() does not run at the end of a timed run
_SCRATCH = os.environ.get("LOCRET_FUZZ_SCRATCH") or ("/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir())
_INPUT = Path(_SCRATCH) / f"fuzz-gguf-{os.getpid()}.gguf"


def check_one(data: bytes, path: Path = _INPUT) -> None:
    """One input: read as a base model; a refusal must be a ConversionError with a one-line message."""
    from locret.convert.base_model import read_base_model
    from locret.convert.errors import ConversionError

    path.write_bytes(data)
    try:
        read_base_model(path)
    except ConversionError as e:
        if not str(e).strip() or "\n" in str(e).strip():
            raise AssertionError(f"a refusal without a one-line message: {e!r}") from None


def write_seeds(folder: Path) -> list[Path]:
    """Two small models that the reader accepts: one with scalar keys, one with the shapes of real files (a token
    list, per-layer head counts as an array, key/value lengths, several tensors)."""
    import numpy as np

    sys.path.insert(0, str(REPO / "third_party" / "llama.cpp" / "gguf-py"))
    import gguf

    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for name, per_layer in (("seed-scalars.gguf", False), ("seed-arrays.gguf", True)):
        path = folder / name
        w = gguf.GGUFWriter(path, "llama")
        w.add_name("fuzz seed")
        w.add_block_count(2)
        w.add_embedding_length(64)
        w.add_head_count(4)
        if per_layer:
            w.add_head_count_kv([2, 2])
            w.add_key_length(16)
            w.add_value_length(16)
            w.add_token_list([f"t{i}" for i in range(16)])
            w.add_token_scores([0.0] * 16)
        else:
            w.add_head_count_kv(2)
        w.add_tensor("blk.0.attn_q.weight", np.zeros((64, 64), dtype=np.float16))
        if per_layer:
            w.add_tensor("blk.0.attn_k.weight", np.zeros((32, 64), dtype=np.float16))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        out.append(path)
    return out


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--write-seeds":
        for p in write_seeds(Path(sys.argv[2])):
            print(p)
        return 0
    import atheris

    with atheris.instrument_imports():
        import locret.convert.base_model  # noqa: F401
        import locret.gguf_header  # noqa: F401
    try:
        atheris.Setup(sys.argv, check_one)
        atheris.Fuzz()
    finally:
        _INPUT.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
