"""transformers' reading of a GGUF, done once per file and kept.

transformers reads a GGUF by dequantizing every tensor and rebuilding the tokenizer from the file's vocabulary, and
it does so on every load: 20-30 s for the default model's weights and 4-10 s for its tokenizer on this project's
2-core machine, paid by every trainer run, every kvpress comparison and every PyTorch reference in the tests. Its
result is a plain Hugging Face model, so it is saved once, as transformers wrote it (config, float32 weights,
tokenizer, generation config), in ``$LOCRET_CACHE_DIR/transformers/<stem>-<key>``, and loaded from there in well
under a second.

The key is the GGUF's sha256 with transformers' version and this module's BUILDER_VERSION: a changed file or another
transformers (the kvpress environment has its own) converts anew. The saved weights are the dequantized tensors
themselves, so a model loaded from the folder computes what one loaded from the GGUF does, bit for bit
(tests/py/test_hf_gguf.py checks weights, logits and token ids). transformers refuses ``save_pretrained`` on a model
it read from a GGUF, so the weights go through safetensors directly; tied tensors (the embedding and the output
projection) are saved once and tied again on load. A model whose float32 copy would pass KEEP_LIMIT_BYTES is not
kept: it is read from the GGUF each time, as before.
"""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

from . import cachelock, models
from .files import sha256_file
from .gguf_header import read_header

# bump when what the folder holds changes (cached folders are then converted again)
BUILDER_VERSION = 1

# Models whose float32 weights would pass this are read from the GGUF on every load, as transformers does, and not
# kept: a copy of an 8B model would be 32 GB of disk for a 30 s gain on a load that takes minutes anyway.
KEEP_LIMIT_BYTES = 4 << 30


def cache_folder() -> Path:
    return models.cache_dir() / "transformers"


def _file_key(gguf: Path) -> tuple[str, int, int]:
    """The file's path, size and time: what the memos below are keyed by, so a file rewritten in place is read again.
    FileNotFoundError for a missing file."""
    st = gguf.stat()
    return str(gguf.resolve()), st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=16)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    return sha256_file(path)


@functools.lru_cache(maxsize=16)
def _float32_bytes(path: str, size: int, mtime_ns: int) -> int:
    return 4 * sum(t.n_elements for t in read_header(path).tensors)


def source(gguf: str | os.PathLike) -> tuple[str, dict]:
    """Where transformers reads `gguf` from: (the kept folder, {}), or (the file's folder, {"gguf_file": name}) for a
    model too large to keep (KEEP_LIMIT_BYTES). Raises ModelFileError (a ValueError) for a file that is not GGUF."""
    gguf = Path(gguf)
    if float32_bytes(gguf) > KEEP_LIMIT_BYTES:
        return str(gguf.parent), {"gguf_file": gguf.name}
    return str(folder(gguf)), {}


def float32_bytes(gguf: str | os.PathLike) -> int:
    """The size of `gguf`'s tensors dequantized to float32, from its header (read once a process: a model and its
    tokenizer ask for it in turn). ModelFileError for a missing file or one that is not GGUF."""
    gguf = Path(gguf)
    if not gguf.is_file():
        read_header(gguf)  # its error says what the path is instead (missing, a folder)
    return _float32_bytes(*_file_key(gguf))


def folder(gguf: str | os.PathLike) -> Path:
    """The Hugging Face folder that holds transformers' reading of `gguf`, converted into the cache the first time.

    Raises what transformers raises for a file it cannot read (OSError, ValueError, ...), as loading the GGUF
    directly would."""
    import transformers

    gguf = Path(gguf)
    sha = _sha256(*_file_key(gguf))  # FileNotFoundError for a missing file, before anything is hashed
    key = f"{sha[:16]}-t{transformers.__version__}-b{BUILDER_VERSION}"
    target = cache_folder() / f"{gguf.stem}-{key}"
    cachelock.build_folder_once(target, (target / "done").is_file, lambda staging: _convert(gguf, staging))
    return target


def load_model(gguf: str | os.PathLike, **kwargs):
    """AutoModelForCausalLM from `gguf`'s cached folder, float32 unless `dtype` says otherwise; other keyword
    arguments (attn_implementation, config, ...) go to from_pretrained as they are."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM

    kwargs.setdefault("dtype", torch.float32)
    where, gguf_file = source(gguf)
    return AutoModelForCausalLM.from_pretrained(where, **gguf_file, **kwargs)


def load_tokenizer(gguf: str | os.PathLike):
    """AutoTokenizer from `gguf`'s cached folder."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    where, gguf_file = source(gguf)
    return AutoTokenizer.from_pretrained(where, **gguf_file)


def _convert(gguf: Path, staging: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import safetensors.torch
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"locret.hf_gguf: transformers reads {gguf.name} once (dequantizing it); kept in {staging.parent}",
          file=sys.stderr, flush=True)
    where, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    model.config.save_pretrained(staging)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(staging)
    safetensors.torch.save_model(model, str(staging / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(staging)
    (staging / "done").write_text(f"{gguf.name}\n")
