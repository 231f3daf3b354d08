"""The frozen base model the heads are trained on, and what training reads out of it.

The backbone is a Hugging Face transformers model, loaded either from a GGUF file (transformers
dequantizes every tensor and undoes llama.cpp's Q/K row permutation, so Q and K come out in
Hugging Face order, the order of the published Locret checkpoints) or from a Hugging Face model
directory. One forward pass gives, per layer:

- the heads' input: concat(Q, K, V), the raw outputs of q_proj / k_proj / v_proj (after bias,
  before any q/k norm and before RoPE), captured with forward hooks;
- the training labels: computed inside attention from the Q and K the model really attends with
  (normed and RoPE'd), through a registered transformers attention function that then hands over
  to the stock SDPA kernel, so the forward pass itself is unchanged.

Only architectures whose transformers implementation has separate q_proj/k_proj/v_proj modules and
calls the attention interface are accepted; each maps to the llama.cpp architecture its GGUF
carries, which the converter must support too.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import hf_gguf
from ..convert.architectures import architecture
from ..convert.errors import ConversionError, first_line
from .labels import attention_labels

# transformers model_type -> llama.cpp general.architecture of the same model's GGUF.
TRAINABLE_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
}

ATTENTION_NAME = "locret_labels"


@dataclass
class Features:
    """What one forward pass gives the trainer for one sequence."""

    inputs: list[torch.Tensor]  # per layer: concat(Q, K, V) of the prompt tokens, float32 [n_prompt, d_in]
    labels: torch.Tensor        # float32 [n_layer, n_head_kv, n_prompt]


class _Capture:
    """Per-forward scratch space shared by the hooks and the attention function."""

    def __init__(self) -> None:
        self.n_prompt = 0
        self.projections: dict[tuple[int, str], torch.Tensor] = {}
        self.labels: dict[int, torch.Tensor] = {}
        self.active = False


_CAPTURES: dict[int, _Capture] = {}  # id(attention module) -> capture; the attention function finds its own here


def _labels_then_sdpa(module, query, key, value, attention_mask, **kwargs):
    """Attention function: record the layer's labels, then run transformers' SDPA unchanged.

    query [batch, n_head, n, d] and key [batch, n_head_kv, n, d] arrive normed and RoPE'd."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    capture = _CAPTURES.get(id(module))
    if capture is not None and capture.active:
        scaling = kwargs.get("scaling")
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        keep = None
        if isinstance(attention_mask, torch.Tensor):  # sliding-window layers: only what attention may see
            mask = attention_mask[0, 0]
            keep = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
        capture.labels[module.layer_idx] = attention_labels(query[0], key[0], capture.n_prompt, float(scaling),
                                                            keep=keep)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


class Backbone:
    """A frozen transformers causal LM with the taps training needs."""

    def __init__(self, model, tokenizer, gguf_architecture: str, source: Path, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.tokenizer = tokenizer
        self.gguf_architecture = gguf_architecture
        self.activation = architecture(gguf_architecture).activation
        self.source = source
        config = model.config
        self.n_layer = config.num_hidden_layers
        self.n_head = config.num_attention_heads
        self.n_head_kv = getattr(config, "num_key_value_heads", None) or self.n_head
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_head
        self.d_in = (self.n_head + 2 * self.n_head_kv) * self.head_dim
        self._capture = _Capture()
        for i, layer in enumerate(self._layers()):
            attn = layer.self_attn
            _CAPTURES[id(attn)] = self._capture
            for name in ("q_proj", "k_proj", "v_proj"):
                getattr(attn, name).register_forward_hook(self._hook(i, name))

    def _layers(self):
        return self.model.model.layers

    def _hook(self, layer: int, name: str):
        def hook(_module, _inputs, output):
            if self._capture.active:
                self._capture.projections[(layer, name)] = output.detach()[0, : self._capture.n_prompt].float()
        return hook

    @torch.no_grad()
    def features(self, token_ids: list[int], n_prompt: int) -> Features:
        """Heads' inputs and labels for a sequence whose first `n_prompt` tokens are the prompt and the
        rest the answer."""
        if not 0 < n_prompt < len(token_ids):
            raise ConversionError(f"a training sequence needs a prompt and an answer (got {n_prompt} prompt tokens "
                                  f"of {len(token_ids)})")
        capture = self._capture
        capture.n_prompt = n_prompt
        capture.projections.clear()
        capture.labels.clear()
        capture.active = True
        try:
            # the decoder stack only: the LM head's logits are not needed and cost a fifth of a small model's work
            self.model.model(torch.tensor([token_ids], dtype=torch.long, device=self.device), use_cache=False)
        finally:
            capture.active = False
        inputs = [torch.cat([capture.projections[(i, "q_proj")], capture.projections[(i, "k_proj")],
                             capture.projections[(i, "v_proj")]], dim=-1) for i in range(self.n_layer)]
        labels = torch.stack([capture.labels[i] for i in range(self.n_layer)])
        capture.projections.clear()
        capture.labels.clear()
        return Features(inputs=inputs, labels=labels)


    @torch.no_grad()
    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        """The model's own answer to a prompt: its greedy continuation with full attention over the whole prompt (a
        KV cache, one token at a time), at most `max_new_tokens` tokens, ending before its end-of-sequence token.
        The teacher of the tasks that have no reference answer (synthetic.TEACHER_TASKS)."""
        if not prompt_ids or max_new_tokens <= 0:
            raise ConversionError(f"a greedy answer needs a prompt and room for it (got {len(prompt_ids)} prompt "
                                  f"tokens, {max_new_tokens} new)")
        eos = self.tokenizer.eos_token_id
        step = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        past, out = None, []
        while len(out) < max_new_tokens:
            result = self.model(step, past_key_values=past, use_cache=True, logits_to_keep=1)
            past = result.past_key_values
            token = int(result.logits[0, -1].argmax())
            if token == eos:
                break
            out.append(token)
            step = torch.tensor([[token]], dtype=torch.long, device=self.device)
        return out


def load_backbone(source: Path, threads: int | None = None, device: str = "cpu") -> Backbone:
    """A frozen float32 backbone on `device` (cpu, cuda, cuda:N) from a GGUF file or a Hugging Face model
    directory, with its tokenizer."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a model hub
    from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if threads:
        torch.set_num_threads(threads)
    source = Path(source)
    if not source.exists():
        raise ConversionError(f"base model {source}: no such file or directory")
    if not source.is_dir() and source.suffix != ".gguf":
        raise ConversionError(f"base model {source}: expected a .gguf file or a Hugging Face model directory")

    where, kwargs = str(source), {}
    if not source.is_dir():
        try:  # a GGUF is read through transformers once per file and kept as a Hugging Face folder (hf_gguf)
            where, kwargs = hf_gguf.source(source)
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            raise ConversionError(f"base model {source}: cannot load it with transformers ({first_line(e)})") from None
    try:
        config = AutoConfig.from_pretrained(where, **kwargs)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise ConversionError(f"base model {source}: cannot read its configuration ({first_line(e)})") from None
    model_type = getattr(config, "model_type", None)
    if model_type == "gemma3" and hasattr(config, "text_config"):
        model_type = config.text_config.model_type
    if model_type not in TRAINABLE_MODEL_TYPES:
        raise ConversionError(f"base model {source}: the trainer does not support model type '{model_type}'; "
                              f"supported: {', '.join(TRAINABLE_MODEL_TYPES)}")

    AttentionInterface.register(ATTENTION_NAME, _labels_then_sdpa)
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(where, config=config, dtype=torch.float32, **kwargs)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise ConversionError(f"base model {source}: cannot load it with transformers ({first_line(e)})") from None
    try:
        target = torch.device(device)
        model.to(target)
    except (RuntimeError, AssertionError) as e:  # no such device, or a torch built without CUDA
        raise ConversionError(f"device {device}: {first_line(e)}") from None
    model.eval()
    model.requires_grad_(False)
    model.set_attn_implementation(ATTENTION_NAME)
    return Backbone(model, tokenizer, TRAINABLE_MODEL_TYPES[model_type], source, target)
