"""Read retaining heads back out of a GGUF (this converter's output) into the checkpoint layout.

A heads GGUF stores W1 with its Q and K columns in llama.cpp's order (convert/HEADS-FORMAT.md,
`locret.qk_permuted`); the checkpoint layout, which the trainer and the converter start from, has them in
Hugging Face order. Reading undoes the permutation, so converting the result again gives the same file
(up to the weight type's rounding) and a trainer fine-tunes the same function the GGUF computes.

Refused with a message: a GGUF without heads, another format version or Q/K layout, base sizes that do not
describe the tensors, a tensor whose type cannot be dequantized, a truncated file.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from locret.files import sha256_file

from .base_model import open_gguf
from .checkpoint import TRAINING_STRING_KEYS, TRAINING_UINT32_KEYS, Checkpoint
from .errors import ConversionError
from .gguf_output import FORMAT_VERSION, QK_LAYOUT
from .heads import tensor_name
from .permutation import llama_cpp_input_order

GGUF_HEAD_TENSOR = re.compile(r"locret\.blk\.(\d+)\.(fc1|fc2)\.(weight|bias)")
READABLE_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
                  GGMLQuantizationType.Q8_0)


def _field(reader: GGUFReader, path: Path, key: str, required: bool = True):
    field = reader.fields.get(key)
    if field is None:
        if required:
            raise ConversionError(f"checkpoint {path}: GGUF heads file lacks the key {key}")
        return None
    try:
        return field.contents()
    except Exception as e:  # a key whose stored type does not decode
        raise ConversionError(f"checkpoint {path}: key {key} cannot be read ({type(e).__name__})") from None


def read_gguf_heads(checkpoint: Checkpoint, path: Path) -> dict[str, str | int]:
    """Register the heads of a GGUF in `checkpoint` under their checkpoint names; return the provenance."""
    reader = open_gguf(path, "checkpoint")
    tensors = [t for t in reader.tensors if GGUF_HEAD_TENSOR.fullmatch(t.name)]
    if not tensors:
        raise ConversionError(f"checkpoint {path}: a GGUF without retaining heads (no locret.blk.* tensors)")
    version = _field(reader, path, "locret.format_version")
    if version != FORMAT_VERSION:
        raise ConversionError(f"checkpoint {path}: heads format version {version}, this converter reads "
                              f"{FORMAT_VERSION}")
    layout = _field(reader, path, "locret.qk_layout")
    if layout != QK_LAYOUT:
        raise ConversionError(f"checkpoint {path}: locret.qk_layout is {layout!r}, expected {QK_LAYOUT!r}")
    sizes = {k: _field(reader, path, f"locret.base.{k}") for k in ("n_head", "n_head_kv", "head_dim_k", "head_dim_v")}
    if not all(isinstance(v, int) and v > 0 for v in sizes.values()):
        raise ConversionError(f"checkpoint {path}: locret.base sizes {sizes} are not positive integers")
    d_in = (sizes["n_head"] + sizes["n_head_kv"]) * sizes["head_dim_k"] + sizes["n_head_kv"] * sizes["head_dim_v"]
    permuted = bool(_field(reader, path, "locret.qk_permuted"))

    shapes = {}
    for tensor in tensors:
        _, fc, kind = GGUF_HEAD_TENSOR.fullmatch(tensor.name).groups()
        if tensor.tensor_type not in READABLE_TYPES:
            raise ConversionError(f"checkpoint {path}: tensor {tensor.name} has type {tensor.tensor_type.name}; "
                                  f"readable: {', '.join(t.name for t in READABLE_TYPES)}")
        ne = [int(d) for d in tensor.shape]           # ggml order: ne[0] is the row length
        shapes[tensor.name] = tuple(reversed(ne))    # torch order: [out, in]
        # checked before the permutation is built: the tensor's real width bounds the sizes the keys claim
        if fc == "fc1" and kind == "weight" and (len(shapes[tensor.name]) != 2 or shapes[tensor.name][1] != d_in):
            raise ConversionError(f"checkpoint {path}: {tensor.name} has shape {list(shapes[tensor.name])}, but "
                                  f"the locret.base sizes give an input width of {d_in}")
    # gguf column c of W1 holds Hugging Face column order[c]; the inverse puts every column back
    order = (llama_cpp_input_order(sizes["n_head"], sizes["n_head_kv"], sizes["head_dim_k"], sizes["head_dim_v"])
             if permuted and any(n.endswith("fc1.weight") for n in shapes) else None)

    for tensor in tensors:
        layer, fc, kind = GGUF_HEAD_TENSOR.fullmatch(tensor.name).groups()
        shape = shapes[tensor.name]

        def load(tensor=tensor, shape=shape, unpermute=(order if fc == "fc1" and kind == "weight" else None)):
            raw = np.asarray(tensor.data)
            if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                values = raw.astype(np.float32)
            else:
                values = dequantize(raw, tensor.tensor_type).astype(np.float32)
            values = values.reshape(shape)
            if unpermute is not None:
                hf = np.empty_like(values)
                hf[:, unpermute] = values
                values = hf
            return torch.from_numpy(np.ascontiguousarray(values))

        checkpoint.add(tensor_name(int(layer), fc, kind), shape, load, path)

    provenance: dict[str, str | int] = {"locret.training.source": path.name,
                                        "locret.training.source_sha256": sha256_file(path)}
    for key in TRAINING_STRING_KEYS + TRAINING_UINT32_KEYS:  # what the heads' maker recorded carries over
        value = _field(reader, path, key, required=False)
        if value is not None and not (key.endswith("source") or key.endswith("source_sha256")):
            provenance[key] = value
    return provenance
