"""The heads' GGUF keys and tensors (convert/HEADS-FORMAT.md, version 1), written two ways.

- standalone: a small GGUF of `general.type` locret_heads holding only the heads;
- merged: a copy of a model GGUF, every key/value and tensor unchanged and in order, with the
  heads' keys and tensors appended. Model tensor data is streamed from the memory-mapped input
  one tensor at a time, so a model of any size is never held in RAM.

Both are written to `<out>.partial` and renamed when complete, so a failure never leaves a
truncated file under the requested name.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, ReaderField
from locret.gguf_header import GGUFHeader
from gguf.quants import quantize
from tqdm import tqdm

from .architectures import Architecture
from .base_model import BaseModel
from .errors import ConversionError, note
from .heads import HeadsLayout, LayerHead

FORMAT_VERSION = 1
HEADS_FILE_TYPE = "locret_heads"
QK_LAYOUT = "llama.cpp"
INPUT_LAYOUT = "q,k,v pre-rope"

WEIGHT_TYPES = {
    "f32": GGMLQuantizationType.F32,
    "f16": GGMLQuantizationType.F16,
    "bf16": GGMLQuantizationType.BF16,  # lossless for the published (bf16) checkpoints
    "q8_0": GGMLQuantizationType.Q8_0,
}
Q8_0_BLOCK = 32  # Q8_0 quantises rows in blocks of 32 values


@dataclass(frozen=True)
class Recommended:
    """locret.recommended.*: the inference settings the heads were made for."""

    budget: int
    chunk: int
    stabilizers: int
    local: int
    pool: int = 0       # the score pooling window the heads were measured with (odd; 0: none, not written)
    query: str = ""     # "auto": Locret-Q heads, the question found at the end of a prompt is pinned ("": not written)
    pool_from: int = 0  # pool only prompts of at least this many budgets (needs pool; 0: every prompt, not written)
    positions: str = ""  # the positions layout they were measured with, as --locret-positions spells it ("": none)


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: str | int | bool
    type: GGUFValueType


@dataclass(frozen=True)
class EncodedTensor:
    name: str
    data: np.ndarray                 # float32/float16 values, or BF16 / Q8_0 rows as uint8
    ggml_type: GGMLQuantizationType


def heads_key_values(base: BaseModel, arch: Architecture, layout: HeadsLayout, qk_permuted: bool,
                     recommended: Recommended, provenance: dict[str, str | int]) -> list[KeyValue]:
    """The locret.* keys (general.* keys differ between standalone and merged files)."""
    u32, string = GGUFValueType.UINT32, GGUFValueType.STRING
    kvs = [
        KeyValue("locret.format_version", FORMAT_VERSION, u32),
        KeyValue("locret.base.architecture", base.architecture, string),
    ]
    if base.name:
        kvs.append(KeyValue("locret.base.name", base.name, string))
    kvs += [
        KeyValue("locret.base.n_layer", base.n_layer, u32),
        KeyValue("locret.base.n_head", base.n_head, u32),
        KeyValue("locret.base.n_head_kv", base.n_head_kv, u32),
        KeyValue("locret.base.head_dim_k", base.head_dim_k, u32),
        KeyValue("locret.base.head_dim_v", base.head_dim_v, u32),
        KeyValue("locret.input_layout", INPUT_LAYOUT, string),
        KeyValue("locret.qk_layout", QK_LAYOUT, string),
        KeyValue("locret.qk_permuted", qk_permuted, GGUFValueType.BOOL),
        KeyValue("locret.hidden_size", layout.d_r, u32),
        KeyValue("locret.activation", arch.activation, string),
        KeyValue("locret.recommended.budget", recommended.budget, u32),
        KeyValue("locret.recommended.chunk", recommended.chunk, u32),
        KeyValue("locret.recommended.stabilizers", recommended.stabilizers, u32),
        KeyValue("locret.recommended.local", recommended.local, u32),
    ]
    if recommended.pool:
        kvs.append(KeyValue("locret.recommended.pool", recommended.pool, u32))
    if recommended.pool_from:
        kvs.append(KeyValue("locret.recommended.pool_from", recommended.pool_from, u32))
    if recommended.positions:
        kvs.append(KeyValue("locret.recommended.positions", recommended.positions, string))
    if recommended.query:
        kvs.append(KeyValue("locret.recommended.query", recommended.query, string))
    for key, value in sorted(provenance.items()):
        kvs.append(KeyValue(key, value, u32 if isinstance(value, int) else string))
    return kvs


def weight_types(requested: str, base: BaseModel, layout: HeadsLayout) -> dict[str, GGMLQuantizationType]:
    """The ggml type of fc1.weight and fc2.weight for `requested` (a WEIGHT_TYPES name); Q8_0 falls
    back to F16 where rows do not split into whole 32-value blocks (ne0 = d_in for fc1, d_R for fc2)."""
    chosen = {}
    for fc, row_length, symbol in (("fc1", base.d_in, "d_in"), ("fc2", layout.d_r, "d_R")):
        chosen[fc] = WEIGHT_TYPES[requested]
        if chosen[fc] == GGMLQuantizationType.Q8_0 and row_length % Q8_0_BLOCK:
            note(f"{fc}.weight is written as F16, not Q8_0: its rows ({symbol} = {row_length}) are not a "
                 f"multiple of {Q8_0_BLOCK}")
            chosen[fc] = GGMLQuantizationType.F16
    return chosen


def encode_layer(layer: int, head: LayerHead, types: dict[str, GGMLQuantizationType]) -> list[EncodedTensor]:
    tensors = []
    for fc, weight, bias in (("fc1", head.fc1_weight, head.fc1_bias), ("fc2", head.fc2_weight, head.fc2_bias)):
        name = f"locret.blk.{layer}.{fc}"
        tensors.append(EncodedTensor(f"{name}.weight", _encode(f"{name}.weight", weight, types[fc]), types[fc]))
        if bias is not None:  # biases stay F32: they are tiny and added after the matmul in full precision
            tensors.append(EncodedTensor(f"{name}.bias", bias.astype(np.float32), GGMLQuantizationType.F32))
    return tensors


def write_standalone(out: Path, base: BaseModel, name: str, kvs: list[KeyValue],
                     tensors: list[EncodedTensor]) -> None:
    with _partial_file(out) as partial:
        writer = GGUFWriter(partial, arch=base.architecture)  # writes general.architecture
        writer.add_type(HEADS_FILE_TYPE)
        writer.add_name(name)
        _add_key_values(writer, kvs)
        for tensor in tensors:
            _add_tensor_info(writer, tensor.name, tensor.data, tensor.ggml_type)
        _write(writer, [t.data for t in tensors], progress=None)
        _check_with_library(partial, out)


def refuse_model_with_heads(model: GGUFHeader, model_path: Path) -> None:
    """A model that already carries locret.* keys or tensors would get two sets of heads."""
    names = [name for name in model.kv if name.startswith("locret.")]
    names += [t.name for t in model.tensors if t.name.startswith("locret.")]
    if names:
        raise ConversionError(f"model {model_path} already has Locret heads ({names[0]}); merge into the "
                              "model without heads")


def write_merged(out: Path, model: GGUFReader, model_path: Path, kvs: list[KeyValue],
                 tensors: list[EncodedTensor]) -> None:
    architecture = model.get_field("general.architecture").contents()
    with _partial_file(out) as partial:
        writer = GGUFWriter(partial, arch=architecture)  # writes general.architecture first
        for field in model.fields.values():
            # GGUF.* are gguf-py's pseudo-fields for the header counts; the writer recomputes them
            if field.name.startswith("GGUF.") or field.name == "general.architecture":
                continue
            _copy_field(writer, field, model_path)
        _add_key_values(writer, kvs)
        for tensor in model.tensors:
            _add_tensor_info(writer, tensor.name, tensor.data, tensor.tensor_type)
        for tensor in tensors:
            _add_tensor_info(writer, tensor.name, tensor.data, tensor.ggml_type)
        data = [t.data for t in model.tensors] + [t.data for t in tensors]
        _write(writer, data, progress="merging tensors")
        _check_with_library(partial, out)


def rewrite_recommended(path: Path, out: Path, pool: int | None, query: str | None,
                        positions: str | None = None, pool_from: int | None = None) -> None:
    """A copy of a heads file (or a model with embedded heads) with locret.recommended.pool / .pool_from / .query /
    .positions set to the given values (None: kept as they are); every other key and tensor unchanged and in order."""
    reader = GGUFReader(path)
    if reader.get_field("locret.format_version") is None:
        raise ConversionError(f"{path} holds no Locret heads (no locret.format_version)")
    replaced = {"locret.recommended.pool": (pool, GGUFValueType.UINT32),
                "locret.recommended.pool_from": (pool_from, GGUFValueType.UINT32),
                "locret.recommended.query": (query, GGUFValueType.STRING),
                "locret.recommended.positions": (positions, GGUFValueType.STRING)}
    architecture = reader.get_field("general.architecture").contents()
    with _partial_file(out) as partial:
        writer = GGUFWriter(partial, arch=architecture)
        for field in reader.fields.values():
            if field.name.startswith("GGUF.") or field.name == "general.architecture" or \
                    (field.name in replaced and replaced[field.name][0] is not None):
                continue
            _copy_field(writer, field, path)
        for key, (value, value_type) in replaced.items():
            if value is not None:
                writer.add_key_value(key, value, value_type)
        for tensor in reader.tensors:
            _add_tensor_info(writer, tensor.name, tensor.data, tensor.tensor_type)
        _write(writer, [t.data for t in reader.tensors], progress=None)
        _check_with_library(partial, out)


def _check_with_library(written: Path, out: Path) -> None:
    """Refuse a file whose recommendations the library's loader would refuse (a pooling threshold without a window,
    ...): the rule is the library's (llama_locret_file_recommended), asked about the file just written, before it
    replaces `out`."""
    from locret.heads import HeadsError, file_recommended

    try:
        file_recommended(written)
    except HeadsError as e:
        raise ConversionError(f"the heads would be refused by their loader: {str(e).replace(str(written), str(out))}"
                              ) from None


def _encode(name: str, values: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    if ggml_type == GGMLQuantizationType.F32:
        return values.astype(np.float32)
    if ggml_type == GGMLQuantizationType.F16:
        half = values.astype(np.float16)
        if not np.isfinite(half).all():
            raise ConversionError(f"{name} has values beyond the F16 range (|x| > 65504); use --type f32")
        return half
    # BF16 (round to nearest even) and Q8_0 come out of gguf-py as raw bytes per row
    return quantize(values.astype(np.float32), ggml_type)


def _add_key_values(writer: GGUFWriter, kvs: list[KeyValue]) -> None:
    for kv in kvs:
        writer.add_key_value(kv.key, kv.value, kv.type)


def _copy_field(writer: GGUFWriter, field: ReaderField, model_path: Path) -> None:
    """Copy one key/value of the model with its exact GGUF type (and array element type)."""
    value_type = field.types[0]
    if value_type == GGUFValueType.ARRAY:
        if len(field.types) != 2 or not field.data:
            raise ConversionError(f"model {model_path}: key {field.name} is a nested or empty array, which "
                                  "gguf-py cannot copy")
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=field.types[1])
    else:
        writer.add_key_value(field.name, field.contents(), value_type)
    if field.name == "general.alignment":
        writer.data_alignment = field.contents()  # tensor data must keep the model's alignment


def _add_tensor_info(writer: GGUFWriter, name: str, data: np.ndarray, ggml_type: GGMLQuantizationType) -> None:
    # For quantised types `data` is uint8 of the byte shape; gguf-py turns it back into elements.
    writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, raw_dtype=ggml_type)


def _write(writer: GGUFWriter, data: list[np.ndarray], progress: str | None) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for array in tqdm(data, desc=progress, unit="tensor", disable=progress is None):
        writer.write_tensor_data(array)  # a memory-mapped model tensor is paged through, not copied
    writer.close()


@contextmanager
def _partial_file(out: Path):
    partial = out.with_name(out.name + ".partial")
    try:
        yield partial
        os.replace(partial, out)
    except OSError as e:  # no such folder, no permission, disk full
        raise ConversionError(f"cannot write {out}: {e.strerror or e}") from None
    finally:
        partial.unlink(missing_ok=True)
