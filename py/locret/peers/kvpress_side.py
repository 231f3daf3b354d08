"""kvpress's presses on the evaluation's own prompts: the peer's side of `locret eval --presses ...`.

Runs in kvpress's environment (.venv-kvpress; see this package's docstring) as a process of its own:

    .venv-kvpress/bin/python -m locret.peers.kvpress_side SPEC.json ITEMS.jsonl

SPEC names the model (its GGUF: transformers loads and dequantizes the same weights llama.cpp reads), the presses,
the compression ratios and the question settings; each line of ITEMS is one prompt as token ids with where its
question starts (`question_at`) and where the user's input ends (`input_end`). For every item it prints one JSON line
to stdout: the answers of every (press, ratio, setting), greedy, by kvpress's own `generate_answer`.

Three settings, the first two as kvpress reports them:

- ``outside`` (kvpress's default): the context (tokens before `question_at`) is compressed, the question, the chat
  template's end and the answer come after, uncompressed;
- ``compressed`` (query-aware): the context and the question (tokens before `input_end`) are compressed together,
  only the template's closing tokens come after;
- ``copied``: the prompt Locret-Q auto reads (`copied_tokens`: the question the auto rule finds copied to the start
  of the user turn), its first `copied_pinned` tokens (BOS and the template's opening through the copy) pinned as
  Locret-Q pins them (kept whatever their score, counted in what the press keeps), the rest of the context compressed
  and the question at the end (from `copied_question_at`) after, uncompressed. It gives a press the very layout our
  Locret-Q auto gets, so that the two differ only in what they evict.

Every press keeps the same KV memory as our engine at that ratio: the item's `budgets` give, for each ratio, the
units our engine may hold (round((1 - ratio) x the RULER length), every layer and KV head), and the press is made with
the ratio that keeps that many units of the item's context (`press_ratio`, per item). A RULER prompt is shorter than
its length (4K prompts hold 2,200-3,900 tokens), so kvpress's own ratio of the context would keep fewer units than
our budget (0.75: ~770 of a 3,100-token context against 1,024); until 2026-12-07 it did.

One prefill serves every press. A kvpress prefill press compresses each attention layer after the layer has run over
the full, uncompressed context (its forward hook rewrites the layer's cache; the layer's output, which the next layer
reads, is untouched), so the states every press sees are the same whatever the press. The prefill runs once over the
tokens before `input_end`, with a hook that keeps each layer's inputs; each press then gets, layer by layer, exactly
the call its own hook would have had (`press.forward_hook` with the layer's inputs cut to the setting's context, by
causality what a prefill of that context alone computes), inside `with press(model)` as the pipeline runs it. Presses
that run the model themselves (KVzip) cannot be replayed and go through kvpress's pipeline as they are.
tests/py/test_kvpress_side.py checks the replay against the pipeline.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field

# the presses by the names the evaluation gives them; ratio-free settings are kvpress's defaults
PRESSES = {
    "snapkv": ("SnapKVPress", {}),
    "expected": ("ExpectedAttentionPress", {}),
    "tova": ("TOVAPress", {}),
    "streaming": ("StreamingLLMPress", {}),
    "knorm": ("KnormPress", {}),
    "pyramidkv": ("PyramidKVPress", {}),
    "adakv-snapkv": ("AdaKVPress", {"inner": "SnapKVPress"}),
    "adakv-expected": ("AdaKVPress", {"inner": "ExpectedAttentionPress"}),
    "kvzip": ("KVzipPress", {}),
    "locret": ("LocretPress", {}),
}
SETTINGS = ("outside", "compressed", "copied")
NOT_REPLAYABLE = ("kvzip",)  # runs the model itself inside its context manager


@dataclass
class Spec:
    model_path: str
    presses: list[str]
    ratios: list[float]
    settings: list[str] = field(default_factory=lambda: ["outside"])
    heads: str | None = None        # LocretPress's heads file
    threads: int = 2
    replay: bool = True             # False: every press through kvpress's pipeline (slow; the check of the replay)


def check_spec(spec: Spec) -> None:
    unknown = [p for p in spec.presses if p not in PRESSES]
    if unknown:
        raise ValueError(f"unknown kvpress press {', '.join(unknown)}; known: {', '.join(PRESSES)}")
    bad = [s for s in spec.settings if s not in SETTINGS]
    if bad or not spec.settings:
        raise ValueError(f"unknown question setting {', '.join(bad) or '(none)'}; known: {', '.join(SETTINGS)}")
    if "copied" in spec.settings and any(p in NOT_REPLAYABLE for p in spec.presses):
        raise ValueError(f"the 'copied' setting pins the copied question through a press's scores, which "
                         f"{', '.join(p for p in spec.presses if p in NOT_REPLAYABLE)} (run by kvpress's pipeline, "
                         "the model inside the press) does not take: drop it or the setting")
    if not spec.ratios or any(not 0 < r < 1 for r in spec.ratios):
        raise ValueError(f"compression ratios must be in (0, 1), got {spec.ratios}")


def matched_ratio(budget: int, context: int) -> float:
    """The compression ratio at which a press keeps `budget` of `context` units (kvpress keeps int(context x (1 -
    ratio)), so the half unit keeps float rounding from losing one); 0 (nothing compressed) when the context fits."""
    if budget >= context:
        return 0.0
    return 1.0 - (budget + 0.5) / context


def make_press(name: str, ratio: float, heads: str | None):
    import kvpress

    cls_name, options = PRESSES[name]
    if name == "locret":
        from .locret_press import LocretPress

        return LocretPress(compression_ratio=ratio, **({"heads": heads} if heads else {}))
    if "inner" in options:
        return getattr(kvpress, cls_name)(getattr(kvpress, options["inner"])(compression_ratio=ratio))
    return getattr(kvpress, cls_name)(compression_ratio=ratio)


def pin_leading(press, n: int):
    """`press` with its first `n` positions kept in every layer and KV head whatever their score (Locret-Q's pin):
    its scorer's scores there become the largest float, so every selection that ranks by them (ScorerPress's top-k,
    PyramidKV's per-layer top-k, AdaKV's cross-head bottom-k) keeps them, within the same count of kept units."""
    if n <= 0:
        return press
    import torch
    from kvpress import AdaKVPress, ScorerPress

    scorer = press.press if isinstance(press, AdaKVPress) else press
    if not isinstance(scorer, ScorerPress):
        raise ValueError(f"{type(scorer).__name__} does not rank by scores: it cannot pin")
    own = scorer.score

    def score(module, hidden_states, keys, values, attentions, kwargs):
        scores = own(module, hidden_states, keys, values, attentions, kwargs).clone()  # [batch, n_head_kv, seq]
        scores[..., :n] = torch.finfo(scores.dtype).max
        return scores

    scorer.score = score  # on this instance only: the press's own compress calls it
    return press


ATTENTION = "sdpa_bottom_right"


def _register_attention() -> None:
    """PyTorch's SDPA with the causal mask cut to each layer's own key count from the right. A press that keeps
    different counts per layer (PyramidKV) leaves layers of different lengths; transformers 5.2 builds one mask from
    layer 0's length, which SDPA refuses for the other layers (its eager path cuts the mask from the left, which lets
    the question's tokens see each other's future). With no padding every cached key is visible to every new token,
    so the mask's last columns, the new tokens' causal block among them, are the right ones for any key count.
    Identical to SDPA (masks included) when all layers keep the same count. kvpress's head-wise masking patch (AdaKV) is applied to it
    as kvpress applies it to transformers' own attention functions."""
    from kvpress.attention_patch import attention_patch
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def sdpa_bottom_right(module, query, key, value, attention_mask, *args, **kwargs):
        if attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[-1] != key.shape[-2]:
            attention_mask = attention_mask[..., -key.shape[-2]:]
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)

    AttentionInterface.register(ATTENTION, attention_patch(sdpa_bottom_right))
    # SDPA's own masks: an implementation without a registered mask function gets none at all, and SDPA then aligns
    # its causal flag to the top left, so new tokens after a cache would see only the cache's first keys
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def load(model_path: str, threads: int):
    """transformers' model and tokenizer from the GGUF (dequantized to float32, once per file: hf_gguf), and kvpress's
    pipeline on them."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from kvpress import KVPressTextGenerationPipeline
    from transformers.utils import logging as hf_logging

    from .. import hf_gguf

    hf_logging.disable_progress_bar()
    torch.set_num_threads(threads)
    _register_attention()
    model = hf_gguf.load_model(model_path, dtype=torch.float32, attn_implementation=ATTENTION)
    model.eval()
    tokenizer = hf_gguf.load_tokenizer(model_path)
    return model, tokenizer, KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)


def _attention_layers(model):
    language = model.model.language_model if hasattr(model.model, "language_model") else model.model
    return [layer.self_attn for layer in language.layers]


class Capture:
    """The inputs and outputs of every attention layer in one prefill, as their forward hooks see them."""

    def __init__(self, model):
        self.calls: dict[int, tuple[dict, tuple]] = {}
        self._handles = [m.register_forward_hook(self._hook, with_kwargs=True) for m in _attention_layers(model)]

    def _hook(self, module, args, kwargs, output):
        self.calls[module.layer_idx] = (dict(kwargs), tuple(output))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def prefill(model, tokens: list[int]):
    """One forward over `tokens` (no LM head), capturing each attention layer's call; (capture, cache)."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    capture = Capture(model)
    try:
        with torch.no_grad():
            model.model(input_ids=torch.tensor([tokens]), past_key_values=cache)
    finally:
        capture.remove()
    return capture, cache


def _cut(value, n: int, length: int):
    """A captured hook argument cut to the first `n` of `length` positions (tensors whose sequence axis is 1, or the
    last two axes of a square mask); anything else as it is."""
    import torch

    if isinstance(value, tuple):
        return tuple(_cut(v, n, length) for v in value)
    if not isinstance(value, torch.Tensor):
        return value
    if value.dim() == 1 and value.shape[0] == length:        # cache_position
        return value[:n]
    if value.dim() == 4 and value.shape[-1] == length and value.shape[-2] == length:  # a causal mask
        return value[..., :n, :n]
    if value.dim() >= 2 and value.shape[1] == length:          # hidden states, position ids and embeddings
        return value[:, :n]
    return value


def replay(press, model, capture: Capture, full_cache, n: int):
    """The cache `press` leaves after a prefill of the first `n` captured tokens: each layer's own hook call, cut to
    `n`, on a cache holding that layer's keys and values of those tokens."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    layers = _attention_layers(model)
    length = full_cache.layers[0].keys.shape[2]
    with torch.no_grad(), press(model):
        for module in layers:
            module.masked_key_indices = None  # what the attention patch does at a prefill (AdaKV's head-wise masks)
            i = module.layer_idx
            keys, values = full_cache.layers[i].keys[:, :, :n], full_cache.layers[i].values[:, :, :n]
            cache.update(keys.clone(), values.clone(), i)
            kwargs, output = capture.calls[i]
            kw = {k: _cut(v, n, length) for k, v in kwargs.items()}
            kw["past_key_values"] = cache
            out = tuple(_cut(o, n, length) for o in output)
            press.forward_hook(module, (), kw, out)
    return cache


def answer_after(pipe, cache, question_ids: list[int], context_length: int, max_new_tokens: int) -> str:
    import torch

    with torch.no_grad():
        return pipe.generate_answer(question_ids=torch.tensor([question_ids]), cache=cache,
                                    context_length=context_length, max_new_tokens=max_new_tokens)


def pipeline_answer(pipe, press, context_ids: list[int], question_ids: list[int], max_new_tokens: int) -> tuple[str, int]:
    """kvpress's own pipeline on ids (its `_forward`, after its text preprocessing): (answer, cache length)."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        answers = pipe._forward({"context_ids": torch.tensor([context_ids]), "questions_ids": [torch.tensor([question_ids])]},
                                max_new_tokens=max_new_tokens, press=press, cache=cache)
    return answers[0], cache.get_seq_length()


def kept_units(cache) -> int:
    """KV units the compressed context holds, summed over layers and KV heads (AdaKV masks instead of removing:
    its masked units are not counted)."""
    total = 0
    for layer in cache.layers:
        b, h, n, _ = layer.keys.shape
        total += b * h * n
    return total


def run_item(spec: Spec, model, pipe, item: dict) -> dict:
    """Every (press, ratio, setting) on one item. A prompt is prefilled once for all its settings: the plain one for
    outside and compressed (cut at `question_at`, `input_end`), Locret-Q auto's for copied."""
    plain, q_at, end = item["tokens"], item["question_at"], item["input_end"]
    # setting -> (prompt, context length, pinned leading tokens)
    cuts = {"outside": (plain, q_at, 0), "compressed": (plain, end, 0)}
    if "copied" in spec.settings:
        cuts["copied"] = (item["copied_tokens"], item["copied_question_at"], item["copied_pinned"])
    records = []
    prefills = {}
    for name in spec.presses:
        for ratio in spec.ratios:
            for setting in spec.settings:
                tokens, n, pinned = cuts[setting]
                key = "copied" if setting == "copied" else "plain"
                if spec.replay and key not in prefills:
                    # the plain prompt's prefill runs through input_end, enough for both of its cuts
                    prefills[key] = prefill(model, tokens[:end] if key == "plain" else tokens[:n])
                capture, full_cache = prefills.get(key, (None, None))
                press_ratio = matched_ratio(item["budgets"][str(ratio)], n)
                press = pin_leading(make_press(name, press_ratio, spec.heads), pinned)
                t0 = time.perf_counter()
                if spec.replay and name not in NOT_REPLAYABLE:
                    cache = replay(press, model, capture, full_cache, n)
                    units = kept_units(cache)
                    masked = _masked_units(model)
                    answer = answer_after(pipe, cache, tokens[n:], n, item["max_new_tokens"])
                else:
                    answer, _ = pipeline_answer(pipe, press, tokens[:n], tokens[n:], item["max_new_tokens"])
                    units, masked = None, None
                records.append({"press": name, "ratio": ratio, "press_ratio": round(press_ratio, 6),
                                "setting": setting, "answer": answer,
                                "context_tokens": n, "kept_units": units, "masked_units": masked,
                                "seconds": round(time.perf_counter() - t0, 3)})
    return {"item": item["id"], "records": records}


def _masked_units(model) -> int | None:
    """Units AdaKV masked (head-wise budgets by masking, kvpress's way: memory is not saved), None if none."""
    total = 0
    for module in _attention_layers(model):
        idx = getattr(module, "masked_key_indices", None)
        if idx is not None:
            total += int(idx[0].numel())
    return total or None


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m locret.peers.kvpress_side SPEC.json ITEMS.jsonl", file=sys.stderr)
        return 2
    spec = Spec(**json.loads(open(argv[0]).read()))
    try:
        check_spec(spec)
    except ValueError as e:
        print(f"kvpress_side: {e}", file=sys.stderr)
        return 1
    from tqdm import tqdm

    items = [json.loads(line) for line in open(argv[1]) if line.strip()]
    model, _, pipe = load(spec.model_path, spec.threads)
    for item in tqdm(items, desc="kvpress", unit="prompt", file=sys.stderr):
        print(json.dumps(run_item(spec, model, pipe, item)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
