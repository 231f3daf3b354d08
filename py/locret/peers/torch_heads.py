"""A heads GGUF as PyTorch weights in Hugging Face's Q/K order, and the causal importance scores they give.

The engine reads W1 with its Q and K input columns in llama.cpp's row order of Q and K; a Hugging Face model
computes Q and K in its own order, which for the architectures llama.cpp's converter permutes (`llama` and its
kin) differs within every head. Scoring an HF model's projections with the file's W1 as stored would pair each
weight with the wrong input. So the columns are put back in HF order here, with the converter's own rule: its
table says which architectures are permuted (locret.convert.architectures), its reader undoes the permutation
(locret.convert.checkpoint / gguf_heads, driven by the file's `locret.qk_permuted`), and the two must agree.

Nothing here needs kvpress; torch is imported with this module.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from locret.convert.architectures import architecture
from locret.convert.checkpoint import read_checkpoint
from locret.convert.errors import ConversionError
from locret.convert.heads import tensor_name
from locret.convert.permutation import llama_cpp_input_order
from locret.gguf_header import ModelFileError, read_header

# the heads' activation as locret.activation names it; gelu is ggml's tanh approximation
ACTIVATIONS = {
    "silu": torch.nn.functional.silu,
    "gelu": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "relu": torch.nn.functional.relu,
}


@dataclass(frozen=True)
class AttentionShape:
    """What a heads file and a model must agree on: layers, KV heads and the widths of Q, K and V."""
    n_layer: int
    n_head_kv: int
    q_width: int
    k_width: int
    v_width: int

    @property
    def d_in(self) -> int:
        return self.q_width + self.k_width + self.v_width

    def describe(self) -> str:
        return (f"{self.n_layer} layers, {self.n_head_kv} KV heads, d_in {self.d_in} "
                f"(Q {self.q_width} + K {self.k_width} + V {self.v_width})")


@dataclass
class TorchHeads:
    """One retaining head per layer, float32 on the CPU, W1's columns in Hugging Face order (unless asked not to)."""
    path: Path
    architecture: str
    shape: AttentionShape
    activation: str
    fc1: list[torch.Tensor]               # [d_R, d_in]
    fc1_bias: list[torch.Tensor | None]   # [d_R]
    fc2: list[torch.Tensor]               # [n_head_kv, d_R]
    fc2_bias: list[torch.Tensor | None]   # [n_head_kv]
    _on_device: dict = field(default_factory=dict, repr=False)

    def check_fits(self, model_shape: AttentionShape) -> None:
        """Refuse heads made for another shape of model: their scores would be read from the wrong inputs."""
        if model_shape != self.shape:
            raise ValueError(f"heads {self.path} do not fit the model: the heads are for {self.shape.describe()}, "
                             f"the model has {model_shape.describe()}")

    def layer_weights(self, layer: int, device: torch.device) -> tuple:
        """(fc1, fc1_bias, fc2, fc2_bias) of a layer on `device`, copied there once."""
        key = (layer, str(device))
        if key not in self._on_device:
            self._on_device[key] = tuple(None if t is None else t.to(device) for t in
                                         (self.fc1[layer], self.fc1_bias[layer], self.fc2[layer],
                                          self.fc2_bias[layer]))
        return self._on_device[key]

    def scores(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """CIS [..., n_head_kv] of tokens from their pre-RoPE projections q, k, v [..., width], in float32 as the
        engine computes them."""
        fc1, b1, fc2, b2 = self.layer_weights(layer, q.device)
        x = torch.cat([q, k, v], dim=-1).float()
        hidden = x @ fc1.T
        if b1 is not None:
            hidden = hidden + b1
        out = ACTIVATIONS[self.activation](hidden) @ fc2.T
        return out + b2 if b2 is not None else out


def load_torch_heads(path: str | os.PathLike, *, hf_order: bool = True) -> TorchHeads:
    """Read a heads GGUF (standalone or merged into a model). `hf_order=False` leaves W1's Q/K columns in the
    file's llama.cpp order: wrong for an HF model of a permuted architecture, which is what the tests use it to
    show. Every refusal is a ValueError naming the file and the reason."""
    path = Path(path)
    try:
        keys = read_header(path).kv
        if "locret.format_version" not in keys:
            raise ValueError(f"heads {path}: a GGUF without retaining heads (no locret.* keys)")
        checkpoint = read_checkpoint(path)  # the converter's reader: checks the format, undoes the permutation
    except ConversionError as e:  # its message names the file already
        raise ValueError(str(e)) from None
    except (ModelFileError, OSError) as e:
        raise ValueError(f"heads {path}: {e}") from None

    base_arch = keys.get("locret.base.architecture")
    try:
        permuted_by_converter = architecture(base_arch).permutes_qk
    except ConversionError as e:
        raise ValueError(f"heads {path}: {e}") from None
    if bool(keys.get("locret.qk_permuted")) != permuted_by_converter:
        raise ValueError(f"heads {path}: locret.qk_permuted is {keys.get('locret.qk_permuted')}, but the converter "
                         f"{'permutes' if permuted_by_converter else 'does not permute'} Q/K for {base_arch}")
    activation = keys.get("locret.activation")
    if activation not in ACTIVATIONS:
        raise ValueError(f"heads {path}: activation {activation!r}; known: {', '.join(ACTIVATIONS)}")

    sizes = {k: keys.get(f"locret.base.{k}") for k in ("n_layer", "n_head", "n_head_kv", "head_dim_k", "head_dim_v")}
    if not all(isinstance(v, int) and v > 0 for v in sizes.values()):
        raise ValueError(f"heads {path}: locret.base sizes {sizes} are not positive integers")
    n_head, n_head_kv, head_dim_k, head_dim_v = (sizes[k] for k in ("n_head", "n_head_kv", "head_dim_k", "head_dim_v"))
    shape = AttentionShape(n_layer=sizes["n_layer"], n_head_kv=n_head_kv, q_width=n_head * head_dim_k,
                           k_width=n_head_kv * head_dim_k, v_width=n_head_kv * head_dim_v)
    # the reader gives Hugging Face order; the file's own order is that with the converter's permutation applied
    file_order = (llama_cpp_input_order(n_head, n_head_kv, head_dim_k, head_dim_v)
                  if permuted_by_converter and not hf_order else None)

    def tensor(layer: int, fc: str, kind: str) -> torch.Tensor | None:
        name = tensor_name(layer, fc, kind)
        if name not in checkpoint.shapes:
            if kind == "bias":
                return None
            raise ValueError(f"heads {path}: layer {layer} has no {fc}.{kind}")
        try:
            values = checkpoint.load(name)
        except ConversionError as e:
            raise ValueError(str(e)) from None
        if file_order is not None and fc == "fc1" and kind == "weight":
            values = values[:, file_order]
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))

    layers = range(shape.n_layer)
    heads = TorchHeads(path=path, architecture=base_arch, shape=shape, activation=activation,
                       fc1=[tensor(i, "fc1", "weight") for i in layers],
                       fc1_bias=[tensor(i, "fc1", "bias") for i in layers],
                       fc2=[tensor(i, "fc2", "weight") for i in layers],
                       fc2_bias=[tensor(i, "fc2", "bias") for i in layers])
    for i in layers:
        d_r = heads.fc1[i].shape[0]
        if tuple(heads.fc1[i].shape) != (d_r, shape.d_in) or tuple(heads.fc2[i].shape) != (n_head_kv, d_r):
            raise ValueError(f"heads {path}: layer {i} has fc1 {list(heads.fc1[i].shape)} and fc2 "
                             f"{list(heads.fc2[i].shape)}, which do not fit {shape.describe()}")
    return heads
