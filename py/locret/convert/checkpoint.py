"""Find the retaining-head tensors in a checkpoint and read them lazily.

Accepted inputs (published Locret checkpoints and this project's trainer output):

- a ``.safetensors`` file (read through ``safe_open``: only the head tensors are ever loaded);
- a ``.bin``/``.pt``/``.pth`` file (``torch.load(weights_only=True)``, memory-mapped when the file
  is in PyTorch's zip format, so a full model shard is not read into RAM);
- a Hugging Face model directory: ``model.safetensors.index.json`` or ``pytorch_model.bin.index.json``
  (only the shards that hold heads are opened), else every ``*.safetensors`` file, else every
  ``*.bin`` file in it;
- a ``.gguf`` file with heads (this converter's output, standalone or merged into a model): read back
  into the checkpoint layout, W1's Q/K columns returned to Hugging Face order when the file records
  that they were permuted, values dequantized to float32. This is how trained heads that exist only as
  GGUF (the shipped ones) are fine-tuned (``locret train --init-heads heads.gguf``) or re-typed.

Only tensors named ``model.layers.{i}.self_attn.{fc1,fc2}.{weight,bias}`` are taken.

Provenance (``locret.training.*``):

- a ``.safetensors`` whose ``__metadata__`` holds ``locret.training.*`` entries (the trainer's
  output) has them copied; ``source`` defaults to the file name and ``source_sha256`` to the
  file's sha256 when the metadata does not set them;
- any other file: ``source`` is the file name, ``source_sha256`` its sha256;
- a directory: ``source`` is ``<directory name>/<file>`` and ``source_sha256`` the sha256 of the
  index file when there is one (it names every shard), else of the single file that holds the
  heads; when unindexed heads are spread over several files, ``source`` is the directory name
  and ``source_sha256`` the sha256 of the ``sha256sum``-style listing ("<sha256>  <file name>\\n"
  per file, sorted by name) of those files.
"""
from __future__ import annotations

import hashlib
import json
import re
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from locret.files import sha256_file
from safetensors import safe_open

from .errors import ConversionError, first_line, note

HEAD_TENSOR = re.compile(r"model\.layers\.(\d+)\.self_attn\.(fc1|fc2)\.(weight|bias)")
TORCH_SUFFIXES = (".bin", ".pt", ".pth")
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_INDEX = "pytorch_model.bin.index.json"

# __metadata__ entries of the trainer's output, and the GGUF value kind of each
TRAINING_STRING_KEYS = ("locret.training.source", "locret.training.source_sha256", "locret.training.notes")
TRAINING_UINT32_KEYS = ("locret.training.seed", "locret.training.steps")


@dataclass
class Checkpoint:
    """The head tensors of one checkpoint: their shapes now, their data on demand."""

    path: Path
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # head tensor name -> torch shape
    provenance: dict[str, str | int] = field(default_factory=dict)    # locret.training.* -> value
    _loaders: dict[str, Callable[[], torch.Tensor]] = field(default_factory=dict)
    _files: dict[str, Path] = field(default_factory=dict)             # head tensor name -> file holding it

    def add(self, name: str, shape: tuple[int, ...], loader: Callable[[], torch.Tensor], file: Path) -> None:
        if name in self._files:
            raise ConversionError(f"checkpoint {self.path}: tensor {name} appears in both "
                                  f"{self._files[name].name} and {file.name}")
        self.shapes[name] = shape
        self._loaders[name] = loader
        self._files[name] = file

    def files(self) -> list[Path]:
        """The files that hold head tensors, sorted by name."""
        return sorted(set(self._files.values()))

    def load(self, name: str) -> np.ndarray:
        """The tensor as float32 (exact for bf16/f16/f32 sources)."""
        try:
            tensor = self._loaders[name]()
        except Exception as e:  # safetensors, torch and zip errors on data that the header promised
            raise ConversionError(f"checkpoint {self._files[name]}: cannot read tensor {name} "
                                  f"({type(e).__name__}: {first_line(e)})") from None
        if not tensor.is_floating_point():
            raise ConversionError(f"checkpoint {self._files[name]}: tensor {name} has non-float type {tensor.dtype}")
        # detached: a tensor saved with requires_grad (parameters saved as such) cannot become numpy otherwise
        return tensor.detach().to(torch.float32).numpy()


def is_heads_gguf(path: Path | str) -> bool:
    """Whether read_checkpoint reads this path as a heads GGUF (by its suffix, as it does): the one rule the trainer's
    carried recommendations follow too."""
    return Path(path).suffix == ".gguf"


def read_checkpoint(path: Path) -> Checkpoint:
    if not path.exists():
        raise ConversionError(f"checkpoint {path}: no such file or directory")
    checkpoint = Checkpoint(path=path)
    if path.is_dir():
        _read_directory(checkpoint, path)
    elif path.suffix == ".safetensors":
        metadata = _read_safetensors(checkpoint, path)
        checkpoint.provenance = _trainer_provenance(path, metadata)
    elif path.suffix in TORCH_SUFFIXES:
        _read_torch(checkpoint, path)
        checkpoint.provenance = _file_provenance(path)
    elif is_heads_gguf(path):
        from .gguf_heads import read_gguf_heads  # gguf-py is needed only here
        checkpoint.provenance = read_gguf_heads(checkpoint, path)
    else:
        raise ConversionError(f"checkpoint {path}: unknown file type (expected .safetensors, "
                              f"{', '.join(TORCH_SUFFIXES)}, .gguf or a model directory)")
    if not any(HEAD_TENSOR.fullmatch(name) for name in checkpoint.shapes):
        raise ConversionError(f"checkpoint {path} has no retaining-head tensors "
                              "(model.layers.{i}.self_attn.fc1.weight, .fc2.weight)")
    return checkpoint


def _read_safetensors(checkpoint: Checkpoint, file: Path, wanted: set[str] | None = None) -> dict[str, str]:
    """Register the head tensors of one safetensors file; return its __metadata__."""
    try:
        handle = safe_open(file, framework="pt")  # kept open: it maps the file, loads nothing yet
        names = [n for n in handle.keys() if HEAD_TENSOR.fullmatch(n) and (wanted is None or n in wanted)]
        for name in names:
            shape = tuple(handle.get_slice(name).get_shape())
            checkpoint.add(name, shape, lambda name=name: handle.get_tensor(name), file)
        return handle.metadata() or {}
    except ConversionError:
        raise
    except Exception as e:  # safetensors raises its own error type for corrupt or truncated files
        raise ConversionError(f"checkpoint {file}: not a readable safetensors file "
                              f"({type(e).__name__}: {first_line(e)})") from None


def _read_torch(checkpoint: Checkpoint, file: Path, wanted: set[str] | None = None) -> None:
    """Register the head tensors of one torch.save file."""
    try:
        # mmap needs the zip format (every torch.save since 1.6); older pickles are read whole.
        # torch warns about odd pickles before failing on them; the refusal below says enough.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(file))
    except Exception as e:  # unpickling, zip and format errors
        raise ConversionError(f"checkpoint {file}: not a readable PyTorch checkpoint "
                              f"({type(e).__name__}: {first_line(e)})") from None
    if not isinstance(state, dict):
        raise ConversionError(f"checkpoint {file}: holds a {type(state).__name__}, not a dict of tensors")
    for name, tensor in state.items():
        if isinstance(name, str) and HEAD_TENSOR.fullmatch(name) and (wanted is None or name in wanted):
            if not isinstance(tensor, torch.Tensor):
                raise ConversionError(f"checkpoint {file}: {name} is a {type(tensor).__name__}, not a tensor")
            checkpoint.add(name, tuple(tensor.shape), lambda tensor=tensor: tensor, file)


def _read_directory(checkpoint: Checkpoint, directory: Path) -> None:
    for index_name, read_file in ((SAFETENSORS_INDEX, _read_safetensors), (TORCH_INDEX, _read_torch)):
        index = directory / index_name
        if index.is_file():
            shards = _shards_with_heads(index)
            for shard, names in sorted(shards.items()):
                if not (directory / shard).is_file():
                    raise ConversionError(f"checkpoint {directory}: {index_name} names shard {shard}, "
                                          "which is missing")
                read_file(checkpoint, directory / shard, names)
            checkpoint.provenance = {"locret.training.source": f"{directory.name}/{index_name}",
                                     "locret.training.source_sha256": sha256_file(index)}
            return

    files = sorted(directory.glob("*.safetensors"))
    read_file = _read_safetensors
    if not files:
        files = sorted(p for p in directory.iterdir() if p.suffix in TORCH_SUFFIXES)
        read_file = _read_torch
    if not files:
        raise ConversionError(f"checkpoint {directory}: directory has no *.safetensors or *.bin files")
    for file in files:
        read_file(checkpoint, file)

    holders = checkpoint.files()
    if len(holders) == 1:
        checkpoint.provenance = {"locret.training.source": f"{directory.name}/{holders[0].name}",
                                 "locret.training.source_sha256": sha256_file(holders[0])}
    elif holders:
        listing = "".join(f"{sha256_file(f)}  {f.name}\n" for f in holders)
        checkpoint.provenance = {"locret.training.source": directory.name,
                                 "locret.training.source_sha256": hashlib.sha256(listing.encode()).hexdigest()}


def _shards_with_heads(index: Path) -> dict[str, set[str]]:
    """shard file name -> the head tensors it holds, from a Hugging Face index file."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConversionError(f"checkpoint {index}: not a readable index file "
                              f"({type(e).__name__}: {first_line(e)})") from None
    shards: dict[str, set[str]] = {}
    for name, shard in weight_map.items():
        if HEAD_TENSOR.fullmatch(name):
            shards.setdefault(shard, set()).add(name)
    return shards


def _file_provenance(file: Path) -> dict[str, str | int]:
    return {"locret.training.source": file.name, "locret.training.source_sha256": sha256_file(file)}


def _trainer_provenance(file: Path, metadata: dict[str, str]) -> dict[str, str | int]:
    """locret.training.* entries from a safetensors __metadata__, completed with the file's own."""
    provenance: dict[str, str | int] = _file_provenance(file)
    for key, value in metadata.items():
        if not key.startswith("locret.training."):
            continue
        if key in TRAINING_STRING_KEYS:
            provenance[key] = value
        elif key in TRAINING_UINT32_KEYS:
            if not value.isdecimal() or int(value) >= 2**32:
                raise ConversionError(f"checkpoint {file}: __metadata__ {key} = {value!r} is not an unsigned "
                                      "32-bit integer")
            provenance[key] = int(value)
        else:
            note(f"checkpoint {file}: ignoring unknown __metadata__ entry {key}")
    return provenance
