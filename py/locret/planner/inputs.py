"""`locret plan`'s inputs: what the model and heads GGUF headers say (read with locret.gguf_header, the package's one
header reader), the user's context, GPU-layer and slot arguments, and which retaining heads apply."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..gguf_header import read_header


class PlanError(ValueError):
    """An impossible setting or an unusable input; the message says which and what to do."""


# --- inputs --------------------------------------------------------------------------------------

def parse_context(text: str | int) -> int:
    """'128k' -> 131072, '1m' -> 1048576, '131072' -> 131072 (k and m are powers of two, as context
    sizes are usually meant)."""
    m = re.fullmatch(r"\s*([0-9]+)\s*([kKmM]?)\s*", str(text))
    if not m:
        raise PlanError(f"context '{text}' is not a number of tokens like 131072, 128k or 1m")
    value = int(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20}[m.group(2).lower()]
    if value < 1:
        raise PlanError(f"context must be at least 1 token (got '{text}')")
    if value > 0xFFFFFFFF:
        raise PlanError(f"context '{text}' does not fit llama.cpp's 32-bit n_ctx")
    return value


def parse_gpu_layers(text: str | int | None) -> int | None:
    """'all' -> -1 (llama.cpp's 'every layer'), a number >= 0 as is, None stays None."""
    if text is None:
        return None
    if str(text).strip().lower() == "all":
        return -1
    try:
        value = int(str(text))
    except ValueError:
        raise PlanError(f"GPU layers must be 'all' or a number >= 0 (got '{text}')") from None
    if value < 0:
        raise PlanError(f"GPU layers must be 'all' or a number >= 0 (got {value})")
    return value


def parse_slots(text: str | int | None) -> int | str:
    """--slots: a count, or 'max' (the most that fit the device's memory)."""
    if text is None:
        return 1
    if str(text).strip().lower() == "max":
        return "max"
    try:
        return int(text)
    except ValueError:
        raise PlanError(f"slots must be a whole number or 'max', got '{text}'") from None


# --- what the GGUF header says --------------------------------------------------------------------

def _type_sizes():
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # (block size, bytes per block) per ggml type

    return GGML_QUANT_SIZES, GGMLQuantizationType


def row_size(type_name: str, n: int) -> int:
    """Bytes of n elements of a ggml type, as ggml_row_size (n must be a whole number of blocks)."""
    sizes, types = _type_sizes()
    block, type_size = sizes[types[type_name.upper()]]
    return n // block * type_size


_LAYER = re.compile(r"^(?:locret\.)?blk\.(\d+)\.")


@dataclass(frozen=True)
class ModelFacts:
    """What the planner needs from a model GGUF (and a heads GGUF)."""

    path: Path
    arch: str
    name: str
    n_layer: int
    n_ctx_train: int
    n_embd_k_gqa: tuple[int, ...]   # per layer: n_head_kv(il) * head_dim_k
    n_embd_v_gqa: tuple[int, ...]
    n_params: int                   # model tensors only (merged heads excluded)
    tensors: tuple[tuple[str, int], ...]       # (name, bytes) of the model's own tensors
    head_tensors: tuple[tuple[str, int], ...]  # (name, bytes) of locret.* tensors embedded in the file

    @property
    def weight_bytes(self) -> int:
        return sum(b for _, b in self.tensors)

    @property
    def tied_output(self) -> bool:
        """No output.weight: llama.cpp reuses token_embd as the output matrix (one more copy on a GPU)."""
        return not any(n == "output.weight" for n, _ in self.tensors)


def read_model(path: Path) -> ModelFacts:
    header = read_header(path)
    kv = header.kv
    arch = kv.get("general.architecture")
    if not isinstance(arch, str):
        raise PlanError(f"{path}: no general.architecture: not a model GGUF")
    if kv.get("general.type") == "locret_heads":
        raise PlanError(f"{path} is a retaining heads file, not a model: give it with --heads")

    def hp(key: str, default=None):
        value = kv.get(f"{arch}.{key}", default)
        if value is None:
            raise PlanError(f"{path}: the header has no {arch}.{key}; cannot size the KV cache")
        return value

    n_layer = int(hp("block_count"))

    def per_layer(value, what: str) -> list[int]:
        values = list(value) if isinstance(value, list) else [int(value)] * n_layer
        if len(values) != n_layer:
            raise PlanError(f"{path}: {arch}.{what} has {len(values)} entries for {n_layer} layers")
        return [int(v) for v in values]

    n_embd = int(hp("embedding_length"))
    n_head = per_layer(hp("attention.head_count"), "attention.head_count")
    n_head_kv = per_layer(hp("attention.head_count_kv", n_head), "attention.head_count_kv")
    # llama.cpp's defaults: head size n_embd / n_head unless the file states key/value lengths
    dim_k = int(hp("attention.key_length", n_embd // max(n_head[0], 1)))
    dim_v = int(hp("attention.value_length", n_embd // max(n_head[0], 1)))
    own = [(t.name, t.n_bytes, t.n_elements) for t in header.tensors if not t.name.startswith("locret.")]
    heads = [(t.name, t.n_bytes) for t in header.tensors if t.name.startswith("locret.")]
    return ModelFacts(path=path, arch=arch, name=str(kv.get("general.name") or path.stem), n_layer=n_layer,
                      n_ctx_train=int(hp("context_length", 0)),
                      n_embd_k_gqa=tuple(h * dim_k for h in n_head_kv),
                      n_embd_v_gqa=tuple(h * dim_v for h in n_head_kv),
                      n_params=sum(ne for _, _, ne in own),
                      tensors=tuple((n, b) for n, b, _ in own), head_tensors=tuple(heads))


def read_heads(path: Path) -> tuple[tuple[str, int], ...]:
    """(name, bytes) of a standalone heads file's tensors."""
    header = read_header(path)
    kind = header.kv.get("general.type")
    if kind != "locret_heads":
        raise PlanError(f"{path} is not a retaining heads file (general.type is {kind!r})")
    return tuple((t.name, t.n_bytes) for t in header.tensors)


def resolve_heads(model_arg: str, model_path: Path, facts: ModelFacts, heads: str | None, *,
                  query: bool = False) -> tuple[Path | None, str]:
    """The heads file to score with (None: the model embeds heads) and where it came from. `query`: for
    Locret-Q, the shipped heads trained with the question in front where the model has them, else the plain."""
    from .. import models

    if heads is not None:
        return Path(heads), "given"
    if facts.head_tensors:
        return None, "embedded in the model"
    # the repository's trained heads, for a registered model given by name or by its file
    name = models.registered_name(model_arg)
    shipped = models.shipped_heads(name) if name is not None else None
    if shipped is not None:
        query_heads = models.shipped_heads(name, query=True) if query else None
        if query_heads is not None:
            return query_heads, "shipped Locret-Q heads for this model (heads/)"
        return shipped, "shipped for this model (heads/)"
    raise PlanError(f"no retaining heads for {model_path.name}: give --heads H.gguf (Locret scores the KV cache "
                    "with them; `locret convert` makes them)")
