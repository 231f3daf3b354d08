"""Test-side helpers for tests/py/test_convert.py: small base GGUFs, head checkpoints, GGUF reading.

Written independently of the converter (locret.convert) so that the tests check the converter rather than
repeat it: checkpoints are built here with numpy/torch, and outputs are read back with gguf-py.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize
from safetensors.torch import save_file


@dataclass(frozen=True)
class Dims:
    """The attention shape of a base model, as the tests know it."""

    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int  # key and value head size

    @property
    def d_in(self) -> int:
        return (self.n_head + 2 * self.n_head_kv) * self.head_dim


TINY = Dims(n_layer=3, n_head=4, n_head_kv=2, head_dim=16)


def write_tiny_base(path: Path, arch: str = "llama", dims: Dims = TINY, head_count_kv=None) -> Path:
    """A minimal model GGUF: the attention keys the converter reads and one small tensor.

    `head_count_kv` may be a per-layer list to build a model with varying head counts.
    """
    writer = GGUFWriter(path, arch=arch)
    writer.add_name("tiny test model")
    writer.add_block_count(dims.n_layer)
    writer.add_embedding_length(dims.n_head * dims.head_dim)
    writer.add_head_count(dims.n_head)
    writer.add_head_count_kv(dims.n_head_kv if head_count_kv is None else head_count_kv)
    writer.add_tensor("token_embd.weight", np.arange(64 * 8, dtype=np.float32).reshape(8, 64))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def head_name(layer: int, fc: str, kind: str = "weight") -> str:
    return f"model.layers.{layer}.self_attn.{fc}.{kind}"


def random_heads(dims: Dims, d_r: int, seed: int, biases: bool = False) -> dict[str, np.ndarray]:
    """HF-order float32 heads (fc1 [d_R, d_in], fc2 [n_head_kv, d_R]), optionally with biases."""
    rng = np.random.default_rng(seed)
    heads = {}
    for layer in range(dims.n_layer):
        heads[head_name(layer, "fc1")] = rng.standard_normal((d_r, dims.d_in), dtype=np.float32) * 0.05
        heads[head_name(layer, "fc2")] = rng.standard_normal((dims.n_head_kv, d_r), dtype=np.float32) * 0.05
        if biases:
            heads[head_name(layer, "fc1", "bias")] = rng.standard_normal(d_r, dtype=np.float32)
            heads[head_name(layer, "fc2", "bias")] = rng.standard_normal(dims.n_head_kv, dtype=np.float32)
    return heads


def save_safetensors(heads: dict[str, np.ndarray | torch.Tensor], path: Path, metadata=None) -> Path:
    save_file({k: torch.as_tensor(v).contiguous() for k, v in heads.items()}, path, metadata=metadata)
    return path


def save_bin(heads: dict[str, np.ndarray | torch.Tensor], path: Path) -> Path:
    torch.save({k: torch.as_tensor(v) for k, v in heads.items()}, path)
    return path


def save_sharded_directory(heads: dict[str, torch.Tensor], directory: Path, kind: str = "safetensors") -> Path:
    """A Hugging Face style model directory: two shards (plus non-head tensors) and an index."""
    directory.mkdir()
    names = sorted(heads)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for i, part in enumerate(halves, start=1):
        shard = {k: torch.as_tensor(heads[k]) for k in part}
        shard[f"model.other_weight_{i}"] = torch.zeros(4)  # a tensor that is not a head: ignored
        if kind == "safetensors":
            file_name = f"model-{i:05d}-of-00002.safetensors"
            save_file(shard, directory / file_name)
        else:
            file_name = f"pytorch_model-{i:05d}-of-00002.bin"
            torch.save(shard, directory / file_name)
        weight_map.update({k: file_name for k in shard})
    index = "model.safetensors.index.json" if kind == "safetensors" else "pytorch_model.bin.index.json"
    (directory / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def gguf_kvs(reader: GGUFReader) -> dict[str, tuple[list[GGUFValueType], object]]:
    """key -> (GGUF types, value) for every real key/value (not gguf-py's GGUF.* header fields)."""
    return {name: (list(field.types), field.contents()) for name, field in reader.fields.items()
            if not name.startswith("GGUF.")}


def gguf_tensor(reader: GGUFReader, name: str) -> tuple[np.ndarray, GGMLQuantizationType, list[int]]:
    """(values as float32 in numpy order, ggml type, shape in ggml ne order) of one tensor."""
    matches = [t for t in reader.tensors if t.name == name]
    assert len(matches) == 1, f"{name}: {len(matches)} tensors of that name"
    tensor = matches[0]
    if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        values = np.asarray(tensor.data, dtype=np.float32)
    else:
        values = dequantize(np.asarray(tensor.data), tensor.tensor_type)
    return values, tensor.tensor_type, [int(d) for d in tensor.shape]
