"""Randomly initialised heads in the published Locret checkpoint format.

Useful before any trained heads exist: to exercise the converter, the runtime and the parity
tests. The checkpoint is what a Locret training run starts from: per layer
``model.layers.{i}.self_attn.fc1.weight`` [d_R, d_in] and ``.fc2.weight`` [n_head_kv, d_R], no
biases, in Hugging Face Q/K order, initialised like ``torch.nn.Linear`` (uniform in
±1/sqrt(fan_in)) so that the scores have a healthy, input-dependent spread.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from .base_model import BaseModel
from .errors import ConversionError, first_line
from .heads import tensor_name

CHECKPOINT_DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}


def random_heads(base: BaseModel, d_r: int, seed: int, dtype: str) -> dict[str, torch.Tensor]:
    """Layer by layer, fc1 then fc2, from one seeded generator: the same seed gives the same heads."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(base.n_layer):
        for fc, shape in (("fc1", (d_r, base.d_in)), ("fc2", (base.n_head_kv, d_r))):
            bound = 1.0 / math.sqrt(shape[1])  # nn.Linear's default: kaiming_uniform(a=sqrt(5))
            weight = (torch.rand(shape, generator=generator) * 2.0 - 1.0) * bound
            tensors[tensor_name(layer, fc, "weight")] = weight.to(CHECKPOINT_DTYPES[dtype])
    return tensors


def save_checkpoint(tensors: dict[str, torch.Tensor], out: Path, metadata: dict[str, str]) -> None:
    """Write .safetensors (with `metadata` as __metadata__) or .bin (torch.save; no metadata)."""
    try:
        if out.suffix == ".safetensors":
            save_file(tensors, out, metadata=metadata)
        elif out.suffix == ".bin":
            torch.save(tensors, out)
        else:
            raise ConversionError(f"output {out}: unknown checkpoint type (use .safetensors or .bin)")
    except (OSError, RuntimeError) as e:  # torch.save reports unwritable paths as RuntimeError
        raise ConversionError(f"cannot write {out}: {first_line(e)}") from None
