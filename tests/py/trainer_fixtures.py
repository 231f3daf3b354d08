"""Test-side helpers for the head trainer: a tiny random Llama in Hugging Face form with a word-level
tokenizer, a GGUF that carries the same attention shape, and small data files.

Built with transformers/tokenizers directly, not with the trainer's code.
"""
from __future__ import annotations

import json
from pathlib import Path

from convert_fixtures import Dims, write_tiny_base

TINY_LLAMA = Dims(n_layer=2, n_head=4, n_head_kv=2, head_dim=16)
WORDS = ("the a of to and in is was code key value record crate holds what which how many together "
         "section python number list string function return class module import vault answer question "
         "read document remember it for later note important open use").split()


def write_tiny_llama(directory: Path, seed: int = 0) -> Path:
    """A randomly initialised LlamaForCausalLM and its tokenizer in `directory` (save_pretrained layout)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>"] + WORDS + [str(d) for d in range(10)]
                                        + [".", ",", "?", ":", "-"])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Digits(True)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.save_pretrained(directory)

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=TINY_LLAMA.n_head * TINY_LLAMA.head_dim,
                         intermediate_size=128, num_hidden_layers=TINY_LLAMA.n_layer,
                         num_attention_heads=TINY_LLAMA.n_head, num_key_value_heads=TINY_LLAMA.n_head_kv,
                         max_position_embeddings=4096, rope_theta=10000.0, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config)
    # larger Q/K weights than the init gives, so attention scores vary a lot between tokens
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    model.save_pretrained(directory)
    return directory


def write_tiny_llama_gguf(path: Path) -> Path:
    return write_tiny_base(path, arch="llama", dims=TINY_LLAMA)


def sentence(i: int) -> str:
    return f"note {i % 10} : the record {i % 7} holds code {i % 5} {i % 3} and the crate is open ."


def write_jsonl(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
