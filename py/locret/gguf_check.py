"""Check that a file is a complete GGUF before llama.cpp reads it.

llama.cpp mmaps tensor data at the offsets the header announces; a truncated download then fails
deep inside the loader. This module walks the GGUF header itself (magic, version, key/values,
tensor infos), computes where the last tensor's data ends, and compares that with the file size,
so that a partial or corrupt file gets a message naming the file and what is wrong with it.
It reads only the header, never the tensor data, so it is cheap for large models.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

GGUF_MAGIC = b"GGUF"
GGUF_DEFAULT_ALIGNMENT = 32

# GGUF value types (gguf-py's GGUFValueType) -> struct format of fixed-size scalars
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class ModelFileError(ValueError):
    """A model (or heads) file is missing, not GGUF, or incomplete."""


@dataclass(frozen=True)
class GGUFSummary:
    path: Path
    version: int
    architecture: str | None
    n_tensors: int
    data_end: int  # byte offset just past the last tensor's data
    file_size: int


class _Truncated(Exception):
    pass


class _HeaderReader:
    """Little-endian reads from the header with bounds checks against the file size."""

    def __init__(self, f, size: int):
        self.f, self.size = f, size

    def read(self, n: int) -> bytes:
        if n < 0 or self.f.tell() + n > self.size:
            raise _Truncated(f"header needs {n} bytes at offset {self.f.tell()}")
        return self.f.read(n)

    def scalar(self, fmt: str):
        return struct.unpack("<" + fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.read(self.scalar("Q")).decode("utf-8", errors="replace")

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type, count = self.scalar("I"), self.scalar("Q")
            if item_type in _SCALARS:  # skip fixed-size arrays without decoding them
                self.read(count * struct.calcsize(_SCALARS[item_type]))
                return None
            for _ in range(count):
                self.value(item_type)
            return None
        raise ValueError(f"unknown GGUF value type {vtype} at offset {self.f.tell()}")


def check_gguf(path: str | Path) -> GGUFSummary:
    """Validate `path` as a complete GGUF file; raise ModelFileError with a clear reason if not."""
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
        r = _HeaderReader(f, size)
        try:
            version = r.scalar("I")
            if version not in (2, 3):
                raise ValueError(f"unsupported GGUF version {version}")
            n_tensors, n_kv = r.scalar("Q"), r.scalar("Q")
            arch, alignment = None, GGUF_DEFAULT_ALIGNMENT
            for _ in range(n_kv):
                key = r.string()
                value = r.value(r.scalar("I"))
                if key == "general.architecture":
                    arch = value
                elif key == "general.alignment":
                    alignment = int(value)
            tensor_ends = []
            for _ in range(n_tensors):
                name = r.string()
                dims = [r.scalar("Q") for _ in range(r.scalar("I"))]
                ggml_type, offset = r.scalar("I"), r.scalar("Q")
                if ggml_type not in GGML_QUANT_SIZES:
                    raise ValueError(f"tensor {name} has unknown ggml type {ggml_type}")
                block, type_size = GGML_QUANT_SIZES[ggml_type]
                n_elements = 1
                for d in dims:
                    n_elements *= d
                tensor_ends.append(offset + n_elements // block * type_size)
            header_end = f.tell()
        except _Truncated as e:
            raise ModelFileError(f"{path}: truncated GGUF header ({e}; the file has {size} bytes)") from None
        except (ValueError, struct.error, MemoryError) as e:
            raise ModelFileError(f"{path}: corrupt GGUF header ({e})") from None

    data_start = (header_end + alignment - 1) // alignment * alignment
    data_end = data_start + max(tensor_ends, default=0)
    if data_end > size:
        raise ModelFileError(
            f"{path}: truncated GGUF: tensor data ends at byte {data_end} but the file has {size} bytes "
            f"({100.0 * size / data_end:.1f}% present); download or assemble it again")
    return GGUFSummary(path=path, version=version, architecture=arch, n_tensors=n_tensors,
                       data_end=data_end, file_size=size)
