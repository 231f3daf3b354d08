"""Training examples: a user's local SFT data (JSONL or a JSON array) or the built-in generator,
turned into token sequences whose prompt/answer split the labels need.

Accepted records (one per line in .jsonl, or the elements of a .json array):

- sharegpt:        {"conversations": [{"from": "human"|"user"|"system"|"gpt"|"assistant", "value": "..."}, ...]}
- chat messages:   {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}  (LongAlign)
- prompt / answer: {"prompt"|"instruction"|"question": "...", optional "input"|"context": "...",
                    "answer"|"output"|"response"|"completion": "..."}  (LongAlpaca, Alpaca)

The last assistant turn is the answer; everything before it is the prompt, rendered with the
model's chat template when it has one. Every refusal names the file and line (or array index).

With --query-tokens (Locret-Q, paper sec. 5.4) an example is rewritten before tokenization: its
first user turn starts with the query, as inference will place it (locret/query.py), so the heads
learn to score the context of a prompt that states what will be asked.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from ..convert.errors import ConversionError
from ..query import place_query

_ROLES = {"human": "user", "user": "user", "system": "system", "gpt": "assistant", "assistant": "assistant",
          "model": "assistant", "bot": "assistant"}
_PROMPT_KEYS = ("prompt", "instruction", "question")
_INPUT_KEYS = ("input", "context")
_ANSWER_KEYS = ("answer", "output", "response", "completion")


@dataclass(frozen=True)
class Example:
    messages: tuple[tuple[str, str], ...]  # (role, text) of the prompt, ending with a user turn
    answer: str
    where: str                             # "file:line" or "built-in #index", for messages


@dataclass(frozen=True)
class TokenizedExample:
    token_ids: list[int]
    n_prompt: int
    where: str


def read_examples(path: Path) -> list[Example]:
    """Every record of a local data file, checked for structure (not yet tokenized)."""
    if not path.is_file():
        raise ConversionError(f"training data {path}: no such file")
    text = path.read_text(encoding="utf-8", errors="strict") if path.stat().st_size else ""
    if not text.strip():
        raise ConversionError(f"training data {path}: the file is empty")
    records: list[tuple[str, object]] = []
    if text.lstrip().startswith("["):
        try:
            array = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConversionError(f"training data {path}: not valid JSON ({e.msg} at line {e.lineno})") from None
        records = [(f"{path}[{i}]", r) for i, r in enumerate(array)]
    else:
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                records.append((f"{path}:{number}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise ConversionError(f"training data {path}:{number}: not a JSON object ({e.msg})") from None
    if not records:
        raise ConversionError(f"training data {path}: no records")
    return [_example(where, record) for where, record in records]


def _example(where: str, record: object) -> Example:
    if not isinstance(record, dict):
        raise ConversionError(f"training data {where}: expected a JSON object, got {type(record).__name__}")
    if "conversations" in record or "messages" in record:
        turns = record.get("conversations", record.get("messages"))
        if not isinstance(turns, list) or not turns:
            raise ConversionError(f"training data {where}: 'conversations'/'messages' must be a non-empty list")
        messages = []
        for turn in turns:
            if not isinstance(turn, dict):
                raise ConversionError(f"training data {where}: each turn must be an object")
            role = _ROLES.get(str(turn.get("from", turn.get("role", ""))).lower())
            content = turn.get("value", turn.get("content"))
            if role is None or not isinstance(content, str):
                raise ConversionError(f"training data {where}: a turn needs a known role ('from'/'role': "
                                      f"{', '.join(sorted(_ROLES))}) and text ('value'/'content')")
            messages.append((role, content))
        last_answer = max((i for i, (role, _) in enumerate(messages) if role == "assistant"), default=-1)
        if last_answer < 1 or not any(role == "user" for role, _ in messages[:last_answer]):
            raise ConversionError(f"training data {where}: needs a user turn followed by an assistant answer")
        prompt, answer = tuple(messages[:last_answer]), messages[last_answer][1]
    else:
        prompt_key = next((k for k in _PROMPT_KEYS if isinstance(record.get(k), str)), None)
        answer_key = next((k for k in _ANSWER_KEYS if isinstance(record.get(k), str)), None)
        if prompt_key is None or answer_key is None:
            raise ConversionError(f"training data {where}: not a known record form (sharegpt 'conversations', "
                                  f"'messages', or a prompt key {_PROMPT_KEYS} with an answer key {_ANSWER_KEYS})")
        text = record[prompt_key]
        extra = next((record[k] for k in _INPUT_KEYS if isinstance(record.get(k), str) and record[k].strip()), None)
        if extra:
            text = f"{text}\n\n{extra}"
        prompt, answer = (("user", text),), record[answer_key]
    if not answer.strip():
        raise ConversionError(f"training data {where}: the answer is empty")
    if not any(text.strip() for _, text in prompt):
        raise ConversionError(f"training data {where}: the prompt is empty")
    return Example(messages=prompt, answer=answer, where=where)


def with_query(tokenizer, example: Example, query_tokens: int, question: str | None = None) -> Example:
    """The example in Locret-Q's layout: the query, then a blank line, then the first user turn's text.

    The query is `question` when the example has one (the built-in generator's), else the last user
    turn's text, where a record's question usually is; either way at most its last `query_tokens` tokens."""
    users = [i for i, (role, _) in enumerate(example.messages) if role == "user"]
    text = (question if question is not None else example.messages[users[-1]][1]).strip()
    ids = tokenizer.encode(text, add_special_tokens=False)
    # a query that fits is kept as written: decoding its tokens again could change its spelling
    query = text if len(ids) <= query_tokens else tokenizer.decode(ids[-query_tokens:]).strip()
    if not query:
        raise ConversionError(f"training data {example.where}: the last user turn is empty, so there is no "
                              f"Locret-Q query to place")
    messages = list(example.messages)
    role, first = messages[users[0]]
    messages[users[0]] = (role, place_query(query, first))
    return replace(example, messages=tuple(messages))


def render_prompt(tokenizer, messages: tuple[tuple[str, str], ...]) -> list[int]:
    """The prompt's token ids as the model reads them before its answer: the chat template with the generation
    prompt when the model has one, else the turns' text joined by blank lines."""
    if getattr(tokenizer, "chat_template", None):
        turns = [{"role": role, "content": text} for role, text in messages]
        return list(tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True, return_dict=False))
    return tokenizer.encode("\n\n".join(text for _, text in messages) + "\n", add_special_tokens=True)


def tokenize(tokenizer, example: Example, max_tokens: int) -> TokenizedExample:
    """Prompt (chat template if the model has one) then answer and end-of-turn token.

    A prompt longer than `max_tokens` allows loses its middle (head and tail kept, as long-context
    benchmarks truncate). A prompt shorter than its answer is refused: the labels are about which
    prompt tokens the answer needs, and such a record is almost always a broken one."""
    prompt_ids = render_prompt(tokenizer, example.messages)
    answer_ids = tokenizer.encode(example.answer, add_special_tokens=False)
    if tokenizer.eos_token_id is not None:
        answer_ids.append(tokenizer.eos_token_id)
    if len(prompt_ids) < len(answer_ids):
        raise ConversionError(f"training data {example.where}: the prompt ({len(prompt_ids)} tokens) is shorter "
                              f"than the answer ({len(answer_ids)} tokens)")
    if len(answer_ids) >= max_tokens // 2:
        raise ConversionError(f"training data {example.where}: the answer ({len(answer_ids)} tokens) leaves no "
                              f"room for the prompt within --max-tokens {max_tokens}")
    room = max_tokens - len(answer_ids)
    if len(prompt_ids) > room:
        head = room // 2
        prompt_ids = prompt_ids[:head] + prompt_ids[len(prompt_ids) - (room - head):]
    return TokenizedExample(token_ids=prompt_ids + answer_ids, n_prompt=len(prompt_ids), where=example.where)
