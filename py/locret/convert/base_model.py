"""The base model's attention shape, read from its GGUF with gguf-py.

The heads must match the model llama.cpp will load: the same architecture, layer count, head
counts and head sizes. These come from the model GGUF's key/values, with the defaults llama.cpp
itself applies (src/llama-model.cpp: key_length and value_length default to n_embd / n_head).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gguf import GGUFReader, GGUFValueType
from locret.gguf_check import ModelFileError, check_gguf

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


def open_gguf(path: Path, role: str) -> GGUFReader:
    """A GGUFReader for `path`, or a one-line refusal saying why the file cannot be read.

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
    # gguf-py trusts the header's counts (an array of 2^60 items is read item by item past the end of the map),
    # so the header is first walked with bounds against the file size: a corrupt count is refused at once
    try:
        check_gguf(path)
    except ModelFileError as e:
        reason = str(e).removeprefix(f"{path}: ")
        raise ConversionError(f"{role} {path}: corrupt or truncated GGUF file ({reason})") from None
    try:
        reader = GGUFReader(path, "r")
    except (ValueError, IndexError, OSError) as e:
        # gguf-py fails with low-level errors (short reads, impossible reshapes) on cut-off files
        raise ConversionError(f"{role} {path}: corrupt or truncated GGUF file "
                              f"({type(e).__name__}: {first_line(e)})") from None
    size = path.stat().st_size
    data_end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if data_end > size:
        raise ConversionError(f"{role} {path}: truncated GGUF file: tensor data ends at byte {data_end} "
                              f"but the file has {size} bytes")
    return reader


def read_base_model(reader: GGUFReader, path: Path) -> BaseModel:
    arch = _string(reader, path, "general.architecture", required=True)
    n_layer = _uint(reader, path, f"{arch}.block_count", required=True)
    n_head = _uint(reader, path, f"{arch}.attention.head_count", required=True)
    n_head_kv = _uint(reader, path, f"{arch}.attention.head_count_kv")
    if n_head_kv is None:
        n_head_kv = n_head  # llama.cpp's default: no GQA
    if n_head == 0 or n_head_kv == 0:
        raise ConversionError(f"base model {path}: {arch} has no attention heads (head_count {n_head}, "
                              f"head_count_kv {n_head_kv})")

    head_dim_k = _uint(reader, path, f"{arch}.attention.key_length")
    head_dim_v = _uint(reader, path, f"{arch}.attention.value_length")
    if head_dim_k is None or head_dim_v is None:
        n_embd = _uint(reader, path, f"{arch}.embedding_length", required=True)
        head_dim_k = n_embd // n_head if head_dim_k is None else head_dim_k
        head_dim_v = n_embd // n_head if head_dim_v is None else head_dim_v

    # Sliding-window layers may declare their own head sizes; a single size per model is required.
    for kind, full in (("key", head_dim_k), ("value", head_dim_v)):
        swa = _uint(reader, path, f"{arch}.attention.{kind}_length_swa")
        if swa is not None and swa != full:
            raise ConversionError(f"base model {path}: {arch}.attention.{kind}_length_swa ({swa}) differs from "
                                  f"{arch}.attention.{kind}_length ({full}); per-layer head sizes are not supported")

    return BaseModel(path=path, architecture=arch, name=_string(reader, path, "general.name"), n_layer=n_layer,
                     n_head=n_head, n_head_kv=n_head_kv, head_dim_k=head_dim_k, head_dim_v=head_dim_v)


def _string(reader: GGUFReader, path: Path, key: str, required: bool = False) -> str | None:
    field = reader.get_field(key)
    if field is None:
        if required:
            raise ConversionError(f"base model {path}: no {key} key")
        return None
    if field.types != [GGUFValueType.STRING]:
        raise ConversionError(f"base model {path}: {key} is not a string")
    return field.contents()


def _uint(reader: GGUFReader, path: Path, key: str, required: bool = False) -> int | None:
    """An integer key; a per-layer array is accepted only when all its entries are equal."""
    field = reader.get_field(key)
    if field is None:
        if required:
            raise ConversionError(f"base model {path}: no {key} key")
        return None
    value = field.contents()
    if field.types[0] == GGUFValueType.ARRAY:
        if len(set(value)) != 1:
            shown = value if len(value) <= 16 else value[:16] + ["..."]
            raise ConversionError(f"base model {path}: {key} varies per layer ({shown}); "
                                  "models with per-layer attention shapes are not supported")
        value = value[0]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConversionError(f"base model {path}: {key} is not a non-negative integer ({value!r})")
    return value

