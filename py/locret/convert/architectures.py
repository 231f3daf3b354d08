"""Supported base-model architectures: Q/K permutation and head activation.

A retaining head reads the layer's pre-RoPE Q and K. Heads are trained on Hugging Face models,
whose Q/K rows are in "rotate-half" order; llama.cpp's graph produces Q/K in whatever row order
its HF-to-GGUF converter wrote Wq/Wk in. For architectures whose llama.cpp rope is the "normal"
one (rotating adjacent pairs), the converter permutes the rows of Wq/Wk so that each HF pair
(j, j + d/2) becomes adjacent; W1's Q/K columns must then be permuted the same way. For
architectures with NEOX rope the converter keeps the HF row order and W1 is used as is.

Each entry below names where the fact comes from in the pinned llama.cpp tree
(third_party/llama.cpp): the conversion module and class that writes that GGUF architecture, and
the graph builder in src/models/ whose FFN activation the heads use (Locret's heads apply the base
model's hidden activation: silu for SwiGLU models, tanh-approximated gelu for Gemma's GeGLU).
An architecture missing here is refused rather than guessed.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import ConversionError


@dataclass(frozen=True)
class Architecture:
    name: str          # general.architecture of the model GGUF
    permutes_qk: bool  # llama.cpp's converter permutes Wq/Wk rows relative to HF order
    activation: str    # locret.activation: silu, gelu or relu


ARCHITECTURES: dict[str, Architecture] = {arch.name: arch for arch in [
    # conversion/llama.py LlamaModel (undo_permute = True), registered for LlamaForCausalLM,
    # MistralForCausalLM and MixtralForCausalLM, all written as `llama`. Mistral's own consolidated
    # format (conversion/mistral.py MistralModel, undo_permute = False) is already in llama.cpp
    # order, so relative to HF order the permutation holds for every `llama` file. The LlamaModel
    # subclasses that turn it off write other architectures (Llama4Model: llama4, ApertusModel:
    # apertus) and are not supported here.
    # Activation: src/models/llama.cpp, LLM_FFN_SILU.
    Architecture("llama", permutes_qk=True, activation="silu"),
    # conversion/mistral3.py Mistral3Model.Ministral3Model(LlamaModel), inherits undo_permute = True.
    # Activation: src/models/mistral3.cpp, LLM_FFN_SILU.
    Architecture("mistral3", permutes_qk=True, activation="silu"),
    # conversion/llama.py SmolLM3Model(LlamaModel), inherits undo_permute = True.
    # Activation: src/models/smollm3.cpp, LLM_FFN_SILU.
    Architecture("smollm3", permutes_qk=True, activation="silu"),
    # conversion/granite.py GraniteModel(LlamaModel), inherits undo_permute = True.
    # Activation: src/models/granite.cpp, LLM_FFN_SILU.
    Architecture("granite", permutes_qk=True, activation="silu"),
    # conversion/qwen.py Qwen2Model(TextModel): no Q/K permutation (NEOX rope).
    # Activation: src/models/qwen2.cpp, LLM_FFN_SILU.
    Architecture("qwen2", permutes_qk=False, activation="silu"),
    # conversion/qwen.py Qwen3Model(Qwen2Model): no Q/K permutation (NEOX rope).
    # Activation: src/models/qwen3.cpp, LLM_FFN_SILU.
    Architecture("qwen3", permutes_qk=False, activation="silu"),
    # conversion/phi.py Phi3MiniModel(TextModel): no Q/K permutation (NEOX rope).
    # Activation: src/models/phi3.cpp, LLM_FFN_SWIGLU (silu-gated).
    Architecture("phi3", permutes_qk=False, activation="silu"),
    # conversion/stablelm.py StableLMModel(TextModel): no Q/K permutation (NEOX rope, on the first
    # partial_rotary_factor of each head).
    # Activation: src/models/stablelm.cpp, LLM_FFN_SILU.
    Architecture("stablelm", permutes_qk=False, activation="silu"),
    # conversion/gemma.py GemmaModel(TextModel): no Q/K permutation (NEOX rope).
    # Activation: src/models/gemma.cpp, LLM_FFN_GELU.
    Architecture("gemma", permutes_qk=False, activation="gelu"),
    # conversion/gemma.py Gemma2Model(TextModel): no Q/K permutation (NEOX rope).
    # Activation: src/models/gemma2.cpp, LLM_FFN_GELU.
    Architecture("gemma2", permutes_qk=False, activation="gelu"),
    # conversion/gemma.py Gemma3Model(TextModel): no Q/K permutation (NEOX rope).
    # Activation: src/models/gemma3.cpp, LLM_FFN_GELU.
    Architecture("gemma3", permutes_qk=False, activation="gelu"),
]}


def architecture(name: str) -> Architecture:
    """The table entry for `name`, or a refusal listing the supported architectures."""
    if name not in ARCHITECTURES:
        raise ConversionError(f"unsupported architecture {name}; supported: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[name]
