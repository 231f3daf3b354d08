"""The one GGUF header reader of the package: key/values and tensor infos, read with bounds, never the tensor data.

llama.cpp mmaps tensor data at the offsets the header announces, so a truncated download fails deep inside its
loader; gguf-py reads every key (a 49,152-token vocabulary item by item, seconds) and trusts the header's counts (an
array of 2^60 items is read past the end of its map). This reader walks the header with every read checked against
the file size, decodes the scalars, strings and small numeric arrays that describe a model (per-layer head counts),
skips the large arrays (vocabularies) without decoding them, computes where the last tensor's data ends and compares
that with the file size. A partial or corrupt file gets a ModelFileError naming the file and what is wrong with it.

Everything in py/ that needs a model's shape reads it here: the model registry (locret.models), the planner, the
converter and the trainer (locret.convert.base_model). gguf-py is used only where tensor data is read or written.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

GGUF_MAGIC = b"GGUF"
GGUF_DEFAULT_ALIGNMENT = 32

# GGUF value types (gguf-py's GGUFValueType) -> struct format of fixed-size scalars
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
SMALL_ARRAY = 4096  # numeric arrays up to this many items are decoded (per-layer values); longer ones are skipped


class ModelFileError(ValueError):
    """A model (or heads) file is missing, not GGUF, or incomplete."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int      # from the start of the data section
    n_elements: int
    n_bytes: int


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    version: int
    kv: dict            # key -> int, float, bool, str, a list (numeric array of at most SMALL_ARRAY items) or None
    kv_types: dict      # key -> (value type, item type of an array or None)
    tensors: tuple[TensorInfo, ...]
    data_start: int     # byte offset of the data section
    data_end: int       # byte offset just past the last tensor's data
    file_size: int

    @property
    def architecture(self) -> str | None:
        arch = self.kv.get("general.architecture")
        return arch if isinstance(arch, str) else None

    @property
    def n_tensors(self) -> int:
        return len(self.tensors)


class _Truncated(Exception):
    pass


class _Reader:
    """Little-endian reads from the header with bounds checks against the file size."""

    def __init__(self, f, size: int):
        self.f, self.size = f, size

    def skip(self, n: int) -> None:
        if n < 0 or self.f.tell() + n > self.size:
            raise _Truncated(f"header needs {n} bytes at offset {self.f.tell()}")
        self.f.seek(n, os.SEEK_CUR)

    def read(self, n: int) -> bytes:
        if n < 0 or self.f.tell() + n > self.size:
            raise _Truncated(f"header needs {n} bytes at offset {self.f.tell()}")
        return self.f.read(n)

    def scalar(self, fmt: str):
        return struct.unpack("<" + fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.read(self.scalar("Q")).decode("utf-8", errors="replace")

    def value(self, vtype: int):
        """(value, item type): a scalar, a string, a small numeric array as a list; other arrays are skipped (None)."""
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype]), None
        if vtype == STRING:
            return self.string(), None
        if vtype == ARRAY:
            item_type, count = self.scalar("I"), self.scalar("Q")
            if item_type in _SCALARS:
                fmt = _SCALARS[item_type]
                size = count * struct.calcsize(fmt)
                if count <= SMALL_ARRAY:
                    return list(struct.unpack(f"<{count}{fmt}", self.read(size))), item_type
                self.skip(size)
                return None, item_type
            if item_type == STRING:
                for _ in range(count):  # each string's length, then a seek: a vocabulary is never decoded
                    self.skip(self.scalar("Q"))
                return None, item_type
            if item_type == ARRAY:
                # llama.cpp's reader refuses arrays of arrays; walking them here recursed once per level (a fuzzed
                # file of nested array headers ran out of Python's recursion limit)
                raise ValueError(f"array of arrays at offset {self.f.tell()} (llama.cpp reads no nested arrays)")
            raise ValueError(f"unknown GGUF array item type {item_type} at offset {self.f.tell()}")
        raise ValueError(f"unknown GGUF value type {vtype} at offset {self.f.tell()}")


def read_header(path: str | Path) -> GGUFHeader:
    """The header of `path`, validated as a complete GGUF file; ModelFileError with a clear reason if it is not."""
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"{path}: no such file")
    if not path.is_file():
        raise ModelFileError(f"{path}: not a regular file")
    size = path.stat().st_size
    if size == 0:
        raise ModelFileError(f"{path}: empty file (0 bytes)")

    from gguf import GGML_QUANT_SIZES  # (block size, bytes per block) of every ggml type

    with open(path, "rb") as f:
        magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise ModelFileError(f"{path}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
        r = _Reader(f, size)
        try:
            version = r.scalar("I")
            if version not in (2, 3):
                raise ValueError(f"unsupported GGUF version {version}")
            n_tensors, n_kv = r.scalar("Q"), r.scalar("Q")
            kv, kv_types = {}, {}
            for _ in range(n_kv):
                key = r.string()
                vtype = r.scalar("I")
                kv[key], item_type = r.value(vtype)
                kv_types[key] = (vtype, item_type)
            alignment = kv.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
            if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment < 1:
                raise ValueError(f"general.alignment is {alignment!r}")
            tensors = []
            for _ in range(n_tensors):
                name = r.string()
                dims = tuple(r.scalar("Q") for _ in range(r.scalar("I")))
                ggml_type, offset = r.scalar("I"), r.scalar("Q")
                if ggml_type not in GGML_QUANT_SIZES:
                    # names come from the file: quoted, so that a control character cannot break the message's line
                    raise ValueError(f"tensor {name!r} has unknown ggml type {ggml_type}")
                block, type_size = GGML_QUANT_SIZES[ggml_type]
                n_elements = 1
                for d in dims:
                    n_elements *= d
                tensors.append(TensorInfo(name, dims, ggml_type, offset, n_elements, n_elements // block * type_size))
            header_end = f.tell()
        except _Truncated as e:
            raise ModelFileError(f"{path}: truncated GGUF header ({e}; the file has {size} bytes)") from None
        except (ValueError, struct.error, MemoryError, OverflowError) as e:
            raise ModelFileError(f"{path}: corrupt GGUF header ({e})") from None

    data_start = (header_end + alignment - 1) // alignment * alignment
    data_end = data_start + max((t.offset + t.n_bytes for t in tensors), default=0)
    if data_end > size:
        raise ModelFileError(
            f"{path}: truncated GGUF: tensor data ends at byte {data_end} but the file has {size} bytes "
            f"({size * 1000 // data_end / 10:.1f}% present); download or assemble it again")  # integers: data_end may pass a float's range
    return GGUFHeader(path=path, version=version, kv=kv, kv_types=kv_types, tensors=tuple(tensors),
                      data_start=data_start, data_end=data_end, file_size=size)


def check_gguf(path: str | Path) -> GGUFHeader:
    """Validate `path` as a complete GGUF file (read_header, under the name the checks are called by)."""
    return read_header(path)
