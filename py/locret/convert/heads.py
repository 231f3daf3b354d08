"""Check a checkpoint's heads against the base model and prepare each layer's weights.

Everything that can be checked from names and shapes alone (layers present, biases consistent,
shapes) is checked before any tensor data is read, so a wrong checkpoint is refused at once;
values (NaN/Inf) are checked as each layer is loaded.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .base_model import BaseModel
from .checkpoint import HEAD_TENSOR, Checkpoint
from .errors import ConversionError


def tensor_name(layer: int, fc: str, kind: str) -> str:
    """The checkpoint name of a head tensor, e.g. model.layers.0.self_attn.fc1.weight."""
    return f"model.layers.{layer}.self_attn.{fc}.{kind}"


@dataclass(frozen=True)
class HeadsLayout:
    d_r: int             # hidden width of every head
    has_fc1_bias: bool
    has_fc2_bias: bool


@dataclass
class LayerHead:
    """One layer's head as float32 arrays, W1's columns already in llama.cpp order."""

    fc1_weight: np.ndarray            # [d_R, d_in]
    fc2_weight: np.ndarray            # [n_head_kv, d_R]
    fc1_bias: np.ndarray | None       # [d_R]
    fc2_bias: np.ndarray | None       # [n_head_kv]


def check_layout(checkpoint: Checkpoint, base: BaseModel) -> HeadsLayout:
    present: dict[tuple[str, str], set[int]] = {}  # (fc1|fc2, weight|bias) -> layers that have it
    for name in checkpoint.shapes:
        match = HEAD_TENSOR.fullmatch(name)
        if match:
            layer, fc, kind = int(match[1]), match[2], match[3]
            present.setdefault((fc, kind), set()).add(layer)

    all_layers = set(range(base.n_layer))
    found = set().union(*present.values())
    if extra := sorted(found - all_layers):
        raise ConversionError(f"checkpoint {checkpoint.path} has heads for layers {_list(extra)} but the base "
                              f"model has {base.n_layer} layers (0..{base.n_layer - 1})")
    for fc in ("fc1", "fc2"):
        if missing := sorted(all_layers - present.get((fc, "weight"), set())):
            raise ConversionError(f"checkpoint {checkpoint.path} is missing {fc}.weight for layers {_list(missing)} "
                                  f"(the base model has {base.n_layer} layers)")

    has_bias = {}
    for fc in ("fc1", "fc2"):
        with_bias = present.get((fc, "bias"), set())
        if with_bias and with_bias != all_layers:
            raise ConversionError(f"checkpoint {checkpoint.path} has inconsistent biases: {fc}.bias is present for "
                                  f"layers {_list(sorted(with_bias))} but missing for layers "
                                  f"{_list(sorted(all_layers - with_bias))} (all layers or none)")
        has_bias[fc] = bool(with_bias)

    first_fc1 = checkpoint.shapes[tensor_name(0, "fc1", "weight")]
    d_r = first_fc1[0] if len(first_fc1) == 2 else -1
    if d_r <= 0:
        raise ConversionError(f"layer 0: {tensor_name(0, 'fc1', 'weight')} has shape {list(first_fc1)}, "
                              f"expected [d_R, {base.d_in}] (d_in = {base.d_in_formula()} for the base model)")
    expected = {
        ("fc1", "weight"): ((d_r, base.d_in), f"[d_R, d_in] with d_R = {d_r} (layer 0) and "
                                             f"d_in = {base.d_in_formula()} for the base model"),
        ("fc2", "weight"): ((base.n_head_kv, d_r), f"[n_head_kv, d_R] with n_head_kv = {base.n_head_kv} and "
                                                   f"d_R = {d_r} (layer 0)"),
        ("fc1", "bias"): ((d_r,), f"[d_R] with d_R = {d_r} (layer 0)"),
        ("fc2", "bias"): ((base.n_head_kv,), f"[n_head_kv] with n_head_kv = {base.n_head_kv}"),
    }
    for layer in range(base.n_layer):
        for (fc, kind), (shape, meaning) in expected.items():
            name = tensor_name(layer, fc, kind)
            got = checkpoint.shapes.get(name)
            if got is not None and got != shape:
                raise ConversionError(f"layer {layer}: {name} has shape {list(got)}, expected {list(shape)} "
                                      f"({meaning})")
    return HeadsLayout(d_r=d_r, has_fc1_bias=has_bias["fc1"], has_fc2_bias=has_bias["fc2"])


def load_layer(checkpoint: Checkpoint, layout: HeadsLayout, layer: int,
               fc1_column_order: np.ndarray | None) -> LayerHead:
    """Read one layer's tensors, refuse non-finite values, and reorder W1's columns if asked."""
    def finite(fc: str, kind: str) -> np.ndarray:
        name = tensor_name(layer, fc, kind)
        values = checkpoint.load(name)
        if bad := int(np.count_nonzero(~np.isfinite(values))):
            raise ConversionError(f"layer {layer}: {name} has {bad} NaN/Inf values")
        return values

    fc1_weight = finite("fc1", "weight")
    if fc1_column_order is not None:
        fc1_weight = fc1_weight[:, fc1_column_order]
    return LayerHead(
        fc1_weight=np.ascontiguousarray(fc1_weight),
        fc2_weight=finite("fc2", "weight"),
        fc1_bias=finite("fc1", "bias") if layout.has_fc1_bias else None,
        fc2_bias=finite("fc2", "bias") if layout.has_fc2_bias else None,
    )


def _list(layers: list[int]) -> str:
    """Layer numbers for a message, shortened when there are many."""
    shown = ", ".join(str(i) for i in layers[:20])
    return shown if len(layers) <= 20 else f"{shown}, ... ({len(layers)} in all)"
