"""The base model's attention shape, read from its GGUF header.

The heads must match the model llama.cpp will load: the same architecture, layer count, head
counts and head sizes. These come from the model GGUF's key/values, with the defaults llama.cpp
itself applies (src/llama-model.cpp: key_length and value_length default to n_embd / n_head).
The key/values come from the package's own header reader (locret.gguf_header), which skips the
vocabulary; gguf-py's reader (open_gguf) is opened only where tensor data is read or copied.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gguf import GGUFReader
from locret.gguf_header import ARRAY, STRING, GGUFHeader, ModelFileError, read_header

from .errors import ConversionError, first_line

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class BaseModel:
    path: Path
    architecture: str
    name: str | None
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int

    @property
    def d_in(self) -> int:
        """Width of a head's input concat(Q, K, V)."""
        return (self.n_head + self.n_head_kv) * self.head_dim_k + self.n_head_kv * self.head_dim_v

    def d_in_formula(self) -> str:
        return (f"({self.n_head} + {self.n_head_kv}) * {self.head_dim_k} + "
                f"{self.n_head_kv} * {self.head_dim_v}")


def read_gguf_header(path: Path, role: str) -> GGUFHeader:
    """The header of `path`, or a one-line refusal saying why the file cannot be read.

    `role` ("base model", "model") names the file in messages.
    """
    if not path.exists():
        raise ConversionError(f"{role} {path}: no such file")
    if not path.is_file():
        raise ConversionError(f"{role} {path}: not a regular file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ConversionError(f"{role} {path}: not a GGUF file (starts with {magic!r})")
    # walked with bounds against the file size: a corrupt count is refused at once, and a tensor whose data would end
    # past the file is a truncated file
    try:
        return read_header(path)
    except ModelFileError as e:
        reason = str(e).removeprefix(f"{path}: ")
        raise ConversionError(f"{role} {path}: corrupt or truncated GGUF file ({reason})") from None


def open_gguf(path: Path, role: str) -> GGUFReader:
    """gguf-py's reader for `path` (its tensor data), after the header was read with bounds (read_gguf_header); a
    one-line refusal saying why the file cannot be read."""
    read_gguf_header(path, role)
    try:
        return GGUFReader(path, "r")
    except (ValueError, IndexError, OSError) as e:
        # gguf-py fails with low-level errors (short reads, impossible reshapes) on cut-off files
        raise ConversionError(f"{role} {path}: corrupt or truncated GGUF file "
                              f"({type(e).__name__}: {first_line(e)})") from None


def read_base_model(path: Path, role: str = "base model") -> BaseModel:
    header = read_gguf_header(path, role)
    arch = _string(header, path, "general.architecture", required=True)
    if not arch or not arch.isprintable() or any(c.isspace() for c in arch):
        # it names keys in every message below: one from a damaged file could carry line breaks into them
        raise ConversionError(f"base model {path}: general.architecture is not a name ({arch!r})")
    n_layer = _uint(header, path, f"{arch}.block_count", required=True)
    n_head = _uint(header, path, f"{arch}.attention.head_count", required=True)
    n_head_kv = _uint(header, path, f"{arch}.attention.head_count_kv")
    if n_head_kv is None:
        n_head_kv = n_head  # llama.cpp's default: no GQA
    if n_head == 0 or n_head_kv == 0:
        raise ConversionError(f"base model {path}: {arch} has no attention heads (head_count {n_head}, "
                              f"head_count_kv {n_head_kv})")

    head_dim_k = _uint(header, path, f"{arch}.attention.key_length")
    head_dim_v = _uint(header, path, f"{arch}.attention.value_length")
    if head_dim_k is None or head_dim_v is None:
        n_embd = _uint(header, path, f"{arch}.embedding_length", required=True)
        head_dim_k = n_embd // n_head if head_dim_k is None else head_dim_k
        head_dim_v = n_embd // n_head if head_dim_v is None else head_dim_v

    # Sliding-window layers may declare their own head sizes; a single size per model is required.
    for kind, full in (("key", head_dim_k), ("value", head_dim_v)):
        swa = _uint(header, path, f"{arch}.attention.{kind}_length_swa")
        if swa is not None and swa != full:
            raise ConversionError(f"base model {path}: {arch}.attention.{kind}_length_swa ({swa}) differs from "
                                  f"{arch}.attention.{kind}_length ({full}); per-layer head sizes are not supported")

    return BaseModel(path=path, architecture=arch, name=_string(header, path, "general.name"), n_layer=n_layer,
                     n_head=n_head, n_head_kv=n_head_kv, head_dim_k=head_dim_k, head_dim_v=head_dim_v)


def _string(header: GGUFHeader, path: Path, key: str, required: bool = False) -> str | None:
    if key not in header.kv:
        if required:
            raise ConversionError(f"base model {path}: no {key} key")
        return None
    if header.kv_types[key][0] != STRING:
        raise ConversionError(f"base model {path}: {key} is not a string")
    return header.kv[key]


def _uint(header: GGUFHeader, path: Path, key: str, required: bool = False) -> int | None:
    """An integer key; a per-layer array is accepted only when all its entries are equal."""
    if key not in header.kv:
        if required:
            raise ConversionError(f"base model {path}: no {key} key")
        return None
    value = header.kv[key]
    if header.kv_types[key][0] == ARRAY:
        if not isinstance(value, list) or not value:
            raise ConversionError(f"base model {path}: {key} is not a per-layer list of integers")
        if len(set(value)) != 1:
            shown = value if len(value) <= 16 else value[:16] + ["..."]
            raise ConversionError(f"base model {path}: {key} varies per layer ({shown}); "
                                  "models with per-layer attention shapes are not supported")
        value = value[0]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConversionError(f"base model {path}: {key} is not a non-negative integer ({value!r})")
    return value
