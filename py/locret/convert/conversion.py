"""The two jobs of the command line, start to end: convert a checkpoint, make random heads.

Order of work: refuse what can be refused from the arguments, read the base model's shape, check
the checkpoint's names and shapes against it, then read, check and encode one layer at a time,
and only then write the output (so no refusal leaves a file behind).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from .architectures import architecture
from .base_model import open_gguf, read_base_model, read_gguf_header
from .checkpoint import read_checkpoint
from .errors import ConversionError, note
from .gguf_output import (Recommended, encode_layer, heads_key_values, refuse_model_with_heads, weight_types,
                          write_merged, write_standalone)
from .heads import check_layout, load_layer
from .permutation import llama_cpp_input_order
from .random_heads import random_heads, save_checkpoint


@dataclass(frozen=True)
class ConversionRequest:
    heads: Path                 # checkpoint file or directory
    out: Path
    base: Path | None           # standalone output: the model the heads are for
    merge_into: Path | None     # merged output: the model to copy with the heads added
    weight_type: str            # a gguf_output.WEIGHT_TYPES name
    recommended: Recommended
    name: str | None            # general.name of a standalone file
    skip_qk_permutation: bool   # testing only: writes wrong heads for permuting architectures


def convert(request: ConversionRequest) -> None:
    model_path = request.merge_into or request.base
    if model_path is None:
        raise ConversionError("give the base model with --base (standalone heads) or --merge-into (merged model)")
    refuse_bad_output(request.out, [model_path, request.heads])
    if request.merge_into is not None and request.name is not None:
        raise ConversionError("--name sets general.name of a standalone heads file; a merged model keeps its own")

    role = "model" if request.merge_into else "base model"
    base = read_base_model(model_path, role)
    arch = architecture(base.architecture)
    if request.merge_into is not None:
        refuse_model_with_heads(read_gguf_header(model_path, role), model_path)
    checkpoint = read_checkpoint(request.heads)
    layout = check_layout(checkpoint, base)
    types = weight_types(request.weight_type, base, layout)

    permute = arch.permutes_qk and not request.skip_qk_permutation
    if arch.permutes_qk and request.skip_qk_permutation:
        note(f"--skip-qk-permutation: W1's Q/K columns are left in Hugging Face order; these heads are WRONG "
             f"for {arch.name} (testing only)")
    column_order = (llama_cpp_input_order(base.n_head, base.n_head_kv, base.head_dim_k, base.head_dim_v)
                    if permute else None)

    tensors = []
    for layer in tqdm(range(base.n_layer), desc="converting layers", unit="layer"):
        tensors += encode_layer(layer, load_layer(checkpoint, layout, layer, column_order), types)

    # With --skip-qk-permutation the keys still describe a correctly made file: only the numbers differ.
    kvs = heads_key_values(base, arch, layout, qk_permuted=arch.permutes_qk, recommended=request.recommended,
                           provenance=checkpoint.provenance)
    if request.merge_into is not None:
        write_merged(request.out, open_gguf(model_path, role), model_path, kvs, tensors)
    else:
        name = request.name or (f"Locret heads for {base.name}" if base.name else "Locret heads")
        write_standalone(request.out, base, name, kvs, tensors)


def make_random(base_path: Path, out: Path, d_r: int, seed: int, dtype: str) -> None:
    refuse_bad_output(out, [base_path])
    if d_r <= 0:
        raise ConversionError(f"--d-r must be positive, got {d_r}")
    base = read_base_model(base_path)
    tensors = random_heads(base, d_r, seed, dtype)
    metadata = {
        "locret.training.source": "random",
        "locret.training.seed": str(seed),
        "locret.training.notes": f"make-random: nn.Linear-style uniform init, d_R {d_r}, {dtype}, "
                                 f"for {base.name or base.architecture}",
    }
    save_checkpoint(tensors, out, metadata)


def refuse_bad_output(out: Path, inputs: list[Path]) -> None:
    """Refuse, before any work, an output that cannot be created or would overwrite an input."""
    if not out.parent.is_dir():
        raise ConversionError(f"cannot write {out}: folder {out.parent} does not exist")
    for path in inputs:
        same = out.resolve() == path.resolve() or (out.exists() and path.exists() and os.path.samefile(out, path))
        if same:
            raise ConversionError(f"output {out} is the same file as input {path}; choose another output path")
