"""A RULER sample as an evaluation item: the text a server is sent, the token ids it will read, and where the
question starts.

Two ways to send a sample, both the package's (`--ruler-mode`):

- ``chat`` (the default, as NVIDIA's launcher runs RULER against a chat endpoint): the sample's input, written with
  the package's "base" template (the task's template and its answer prefix), is one user message; the server applies
  the model's chat template;
- ``completion``: the sample is written with the model's chat template around the task's template and the answer
  prefix after it, the assistant's turn already begun (RULER's original layout for instruction-tuned models), and
  sent to the completion endpoint as it is.

Either way the item's tokens are what the server reads: the model's template applied by llama.cpp's own rules and its
tokenizer (the server's /apply-template and /tokenize agree with them; evaluation/server_backend.py checks every
item). kvpress is fed the same ids, split where the question starts: the context is everything before the line that
opens the question (the first word of the task template's part after its context), the question everything after,
answer prefix and the template's end included.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from . import package

MODES = ("chat", "completion")
_MARK = "\u0001"


@dataclass(frozen=True)
class Prompt:
    text: str                # what is sent: the user message (chat) or the whole prompt (completion)
    tokens: tuple[int, ...]  # what the server reads: the template applied, tokenized with BOS as the model wants
    question_at: int         # index in `tokens` of the first token of the question (kvpress's context ends there)
    input_end: int           # index in `tokens` just past the sample's input (the chat template's closing tokens after)
    question: str            # the question and answer prefix, as text


def question_marker(task: str) -> str:
    """The text that opens a task's question: the newlines and first word of the task template after its context."""
    after = package.task_config(task)["template"].split("{context}", 1)[1]
    stripped = after.lstrip("\n")
    return after[:len(after) - len(stripped)] + stripped.split(" ", 1)[0]


def question_start(task: str, text: str) -> int:
    """Character offset in a sample's input where its question starts (the last occurrence of the marker: cwe writes
    an example question before the real one)."""
    at = text.rfind(question_marker(task))
    if at < 0:
        raise package.RulerError(f"{task}: the sample has no question opening with {question_marker(task)!r}")
    return at


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def build(sample: package.Sample, *, mode: str, chat: Callable[[str], str] | None,
          tokenize: Callable[[str, bool], list[int]]) -> Prompt:
    """The prompt of one sample. `chat` applies the model's template to a user message (None: the model has none,
    and the input is sent as it is in both modes). A boundary's token index is how far the prompt's tokens agree
    with the tokens of the text before the boundary (exact where the tokenizer splits there, as it does before the
    newline that opens a RULER question)."""
    if mode not in MODES:
        raise package.RulerError(f"unknown RULER mode {mode!r}; valid: {', '.join(MODES)}")
    q_char = question_start(sample.task, sample.input)
    if mode == "chat" and chat is not None:
        before, after = chat(_MARK).split(_MARK)
        full = before + sample.input + after
    else:
        before, full = "", sample.input
    tokens = tokenize(full, True)
    return Prompt(text=sample.input, tokens=tuple(tokens),
                  question_at=_common_prefix(tokenize(full[:len(before) + q_char], True), tokens),
                  input_end=_common_prefix(tokenize(full[:len(before) + len(sample.input)], True), tokens),
                  question=sample.input[q_char:].strip())


def model_template(chat: Callable[[str], str] | None) -> str:
    """The package's model template for the completion mode: the model's chat template around "{task_template}",
    braces of the template's own text escaped (the package formats it twice)."""
    if chat is None:
        return "{task_template}"
    before, after = chat(_MARK).split(_MARK)
    esc = lambda s: s.replace("{", "{{").replace("}", "}}")  # noqa: E731
    return esc(before) + "{task_template}" + esc(after)


def cached_samples(cache: Path, task: str, *, model_path: str, length: int, samples: int, seed: int,
                   model_template_text: str, random_start: bool, tokenizer: package.GGUFTokenizer) -> list[package.Sample]:
    """The package's samples of (task, length, seed), kept in `cache` (the niah generators take ~15 s each to set up):
    a cached file with at least `samples` samples is read, else the generator runs and the file is rewritten."""
    key = f"{task}-{length}-seed{seed}-{'random' if random_start else 'first'}-{_short_hash(model_template_text)}.jsonl"
    path = cache / key
    if path.is_file():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if len(rows) >= samples:
            return [package.Sample(task=r["task"], index=r["index"], input=r["input"], outputs=tuple(r["outputs"]),
                                   length=r["length"], tokens_to_generate=r["tokens_to_generate"])
                    for r in rows[:samples]]
    out = package.generate(task, model_path=model_path, length=length, samples=samples, seed=seed,
                           model_template=model_template_text, random_start=random_start, tokenizer=tokenizer)
    cache.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(s.__dict__) + "\n" for s in out))
    return out


def _short_hash(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()[:10]
