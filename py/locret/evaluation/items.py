"""What an evaluation asks: prompt token lists with their gold answers and scorer, built once in the parent
process from the model's tokenizer, so that every method answers exactly the same prompts."""
from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from .. import benchmarks, tasks
from ..tasks import haystacks as haystack_families
from ..tasks import realtext
from . import decoding

BENCHMARK_MAX_NEW_TOKENS = 64
RULER_PREFIX = "ruler/"  # an item's source for a RULER task: "ruler/niah_single_1"  # default answer length for benchmark records (--max-new-tokens overrides)


@dataclass(frozen=True)
class Item:
    id: str                  # unique in a run, e.g. "niah/16384/d0.25/3" or "longbench/hotpotqa/<record id>"
    source: str              # task name, or "benchmark/task"
    length: int              # asked prompt tokens (tasks); the prompt's own token count (benchmarks)
    depth: float | None      # asked needle depth; None where the task has none
    tokens: tuple[int, ...]
    max_new_tokens: int
    answers: tuple
    extra: dict = field(default_factory=dict)  # JSON-serialisable details for the per-sample record
    # Locret-Q: the task's question, and the prompt with it placed at the start of the user turn (query.place_query);
    # empty for benchmark records
    query: str = ""
    query_tokens: tuple[int, ...] = ()
    # Locret-Q auto: the question the library's rule finds in the user message ("" when none), and the prompt with it
    # placed at the start (empty when none)
    auto_query: str = ""
    auto_query_tokens: tuple[int, ...] = ()
    # the sample's metadata, for tasks that judge an answer beyond its score (the real-text needle tasks' confusions:
    # `outcome`); kept out of the per-sample records (a haystack's numbers can run to hundreds)
    metadata: dict = field(default_factory=dict)


class ItemError(ValueError):
    """Settings that cannot produce the items asked for (unknown task, depth out of range, ...)."""


class VocabOnly:
    """The model's tokenizer and metadata without its weights or a context (the parts of llama_cpp.Llama
    that decoding.tokenizer and decoding.chat_format use)."""

    def __init__(self, model_path: str):
        import llama_cpp
        from llama_cpp import _internals

        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self.model_path = model_path
        self._model = _internals.LlamaModel(path_model=model_path, params=params, verbose=False)
        self.metadata = self._model.metadata()

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        return self._model.tokenize(text, add_bos, special)

    def detokenize(self, tokens: list[int]) -> bytes:
        return self._model.detokenize(tokens)

    def token_eos(self) -> int:
        return self._model.token_eos()

    def token_bos(self) -> int:
        return self._model.token_bos()

    def close(self) -> None:
        self._model.close()


def vocab_model(model_path: str) -> VocabOnly:
    return VocabOnly(model_path)


@dataclass(frozen=True)
class TaskSample:
    """One generated prompt of a task, before it becomes an Item (or a chat, scripts/openai_chats.py)."""
    task: object             # the task's module (tasks.get)
    source: str              # task name, "task@family" for a family other than prose
    length: int
    depth: float | None
    index: int               # the sample index of the seed
    sample: object           # what task.generate made

    @property
    def id(self) -> str:
        return f"{self.source}/{self.length}/{'all' if self.depth is None else f'd{self.depth:.2f}'}/{self.index}"


def task_samples(llm, names: Sequence[str], lengths: Sequence[int], depths: Sequence[float], samples: int, seed: int,
                 haystacks: Sequence[str] = ("prose",)) -> Iterator[TaskSample]:
    """`samples` prompts per (task, haystack family, length, depth); a task without depths gets `samples` per
    length. Index k of depth j is sample j * samples + k of the seed, so every prompt has its own keys. A family
    other than prose names the source "task@family" (its own rows in the summary) and the ids. ItemError for
    settings that cannot produce them, before any is generated."""
    for d in depths:
        if not 0.0 <= d <= 1.0:
            raise ItemError(f"depth {d} is outside [0, 1] (a share of the filler before the needle)")
    known = haystack_families.FAMILIES + realtext.NEEDLE_FAMILIES
    unknown = [h for h in haystacks if h not in known]
    if unknown or not haystacks:
        raise ItemError(f"unknown haystack family {', '.join(unknown) or '(none given)'}; valid: {', '.join(known)}")
    modules = []
    for name in names:
        try:
            modules.append(tasks.get(name))
        except ValueError as e:
            raise ItemError(str(e)) from None
        if any(h != "prose" for h in haystacks) and "haystack" not in inspect.signature(modules[-1].generate).parameters:
            raise ItemError(f"task {name} has no haystack (only prose applies): run it without --haystacks")
        takes = families_of(modules[-1])
        if wrong := [h for h in haystacks if h not in takes]:
            raise ItemError(f"task {name} does not take the haystack famil{'y' if len(wrong) == 1 else 'ies'} "
                            f"{', '.join(wrong)}: {_takes_what(name, takes)}")
    return _generate(llm, modules, lengths, depths, samples, seed, haystacks)


def families_of(task) -> tuple[str, ...]:
    """The haystack families a task module takes: its HAYSTACKS (the real-text needle tasks: only real text), else
    prose and the generated families (whose tasks rely on a haystack without digits: every number a needle's)."""
    return tuple(getattr(task, "HAYSTACKS", ("prose",) + tuple(f for f in haystack_families.FAMILIES if f != "prose")))


def _takes_what(name: str, takes: Sequence[str]) -> str:
    if set(takes) <= set(realtext.NEEDLE_FAMILIES):
        return f"it hides its needles in real text, give --haystacks {','.join(takes)}"
    return (f"its needles rely on generated text without digits ({', '.join(takes)}); the real-text families take "
            f"{', '.join(n for n in tasks.TASKS if set(families_of(tasks.get(n))) <= set(realtext.NEEDLE_FAMILIES))}")


def _generate(llm, modules, lengths, depths, samples, seed, haystacks) -> Iterator[TaskSample]:
    tokenize, chat = decoding.tokenizer(llm), decoding.chat_format(llm)
    for task, family, length in itertools.product(modules, haystacks, lengths):
        source = task.NAME if family == "prose" else f"{task.NAME}@{family}"
        options = {} if family == "prose" else {"haystack": family}
        points = list(enumerate(depths)) if task.USES_DEPTH else [(0, None)]
        for j, depth in points:
            for k in range(samples):
                index = j * samples + k
                kwargs = {} if depth is None else {"depth": depth}
                sample = task.generate(seed, index, tokenize=tokenize, n_tokens=length, chat_format=chat, **kwargs,
                                       **options)
                yield TaskSample(task, source, length, depth, index, sample)


def task_items(llm, names: Sequence[str], lengths: Sequence[int], depths: Sequence[float], samples: int,
               seed: int, max_new_tokens: int | None = None, progress=None,
               haystacks: Sequence[str] = ("prose",)) -> list[Item]:
    """The Items of task_samples' prompts, with their Locret-Q layouts (the task's question and the one auto finds)."""
    tokenize, chat = decoding.tokenizer(llm), decoding.chat_format(llm)
    out: list[Item] = []
    for ts in task_samples(llm, names, lengths, depths, samples, seed, haystacks):
        sample = ts.sample
        spans = [(label, a, b) for label, a, b in sample.spans()]
        found = auto_question(sample, chat)
        out.append(Item(id=ts.id, source=ts.source, length=ts.length, depth=ts.depth, tokens=tuple(sample.tokens),
                        max_new_tokens=max_new_tokens or ts.task.MAX_NEW_TOKENS, answers=tuple(sample.answers),
                        extra={"seed": seed, "index": ts.index, "needles": spans, **sources_of(sample)},
                        query=sample.question,
                        query_tokens=query_prompt(sample, tokenize, chat), auto_query=found,
                        auto_query_tokens=query_prompt(sample, tokenize, chat, found) if found else (),
                        metadata=sample.metadata if hasattr(ts.task, "judge") else {}))
        if progress is not None:
            progress.update(1)
    return out


def sources_of(sample) -> dict:
    """What a sample's record names of the real text it was cut from: the corpus, and each document's name and
    sha256 ({} for generated text)."""
    return {k: sample.metadata[k] for k in ("corpus", "documents") if k in sample.metadata}


_MARK = "\u0001"  # stands for the document in a user turn, to find the text the template puts around it


def _around_mark(chat, user: str = _MARK) -> tuple[str, str]:
    """The prompt's text before and after _MARK in the user turn `user` (the template's own text around the turn,
    with what `user` adds before or after the mark; without a template only that)."""
    before, after = (chat(user) if chat else user).split(_MARK)
    return before, after


def user_message(sample: tasks.haystack.Sample, chat) -> str:
    """The text of a task sample's user turn: the prompt without the chat template around it (the whole prompt
    without a template)."""
    text = sample.text
    before, after = _around_mark(chat)
    if not (text.startswith(before) and text.endswith(after)):
        raise ItemError(f"{sample.task}: the prompt is not one user turn of the model's chat template")
    return text[len(before):len(text) - len(after)]


def auto_question(sample: tasks.haystack.Sample, chat) -> str:
    """Locret-Q auto on a task sample: the question the library's rule finds at the end of the user message, as
    `--locret-query auto` and locret.Llama(locret_query="auto") find it ("" when there is none)."""
    from ..query import find_question

    return find_question(user_message(sample, chat))


def query_prompt(sample: tasks.haystack.Sample, tokenize, chat, question: str | None = None) -> tuple[int, ...]:
    """Locret-Q's prompt of a task sample: the head piece rewritten so that the user turn opens with the question
    (the task's own, or `question`) and a blank line (the layout the tools and the trainer use); filler, needles and
    tail keep their tokens, so the needles move by the head's growth only."""
    from ..query import place_query

    head = sample.pieces[0]
    if head.kind != "head":
        raise ItemError(f"{sample.task}: a sample must start with its head piece")
    question = sample.question if question is None else question
    before, before_q = _around_mark(chat)[0], _around_mark(chat, place_query(question, _MARK))[0]
    if not head.text.startswith(before):
        raise ItemError(f"{sample.task}: the chat template's text before the user turn is not the prompt's head")
    text = before_q + head.text[len(before):]
    return tuple(tokenize(text, True)) + tuple(sample.tokens[len(head.tokens):])


def benchmark_items(llm, benchmark: str, paths: Sequence[str | Path], task: str | None, limit: int | None,
                    max_new_tokens: int | None) -> tuple[list[Item], dict]:
    """Items of benchmark JSONL files (the user's), in file order, at most `limit` per file. The prompt is
    the model's chat template around context and question, untruncated: Locret's point is to read it all
    (full attention skips what does not fit its window). Returns the items and their records by item id."""
    try:
        module = benchmarks.get(benchmark)
    except ValueError as e:
        raise ItemError(str(e)) from None
    tokenize, chat = decoding.tokenizer(llm), decoding.chat_format(llm)
    items, records = [], {}
    for path in paths:
        recs = module.load(path, task=task)
        for r in recs[:limit] if limit else recs:
            body = f"{r.context}\n\n{r.question}".strip()
            text = chat(body) if chat else body + "\nAnswer:"
            tokens = tuple(tokenize(text, True))
            item_id = f"{r.benchmark}/{r.task}/{r.id}"
            if item_id in records:
                raise ItemError(f"{r.where}: record id {r.id!r} of {r.task} appears twice")
            items.append(Item(id=item_id, source=f"{r.benchmark}/{r.task}", length=len(tokens), depth=None,
                              tokens=tokens, max_new_tokens=max_new_tokens or BENCHMARK_MAX_NEW_TOKENS,
                              answers=tuple(r.answers), extra={"where": r.where, "metric": r.metric}))
            records[item_id] = r
    if not items:
        raise ItemError("the dataset files hold no records")
    return items, records


def outcome(item: Item, prediction: str) -> dict:
    """For tasks that tell a confusion from a miss (a `judge` of their own: the real-text needle tasks), the record's
    fields: {"outcome": "right" | "confusion" | "miss", "confused_with": the other needle's value or the document's
    number the answer gave (None unless a confusion), "confused_source": "needle" | "document" | None}; {} for every
    other task and for benchmark records."""
    if not item.metadata or "/" in item.source:
        return {}
    task = tasks.get(item.source.split("@")[0])
    if not hasattr(task, "judge"):
        return {}
    judged = task.judge(prediction, item)
    return {"outcome": judged.outcome, "confused_with": judged.confused_with, "confused_source": judged.source}


def score(item: Item, prediction: str, records: dict) -> float:
    """The task's or the benchmark's own score of a prediction, in [0, 1]."""
    if item.id in records:
        return float(benchmarks.score(records[item.id], prediction))
    if item.source.startswith(RULER_PREFIX):
        from ..ruler import package

        return package.score(item.source[len(RULER_PREFIX):], prediction, item.answers)
    return float(tasks.get(item.source.split("@")[0]).score(prediction, item.answers))


def _ruler_auto_query(text: str, mode: str, chat, tokenize) -> tuple[str, tuple[int, ...]]:
    """Locret-Q auto on a RULER prompt as the server finds it (the library's rule on the user message in a chat, on
    the whole prompt in a completion): the question, and the prompt with it placed at the start ("", () if none)."""
    from ..query import find_question, place_query

    found = find_question(text)
    if not found:
        return "", ()
    if mode == "chat" and chat is not None:
        return found, tuple(tokenize(chat(place_query(found, text)), True))
    return found, tuple(tokenize(place_query(found, text), True))


def _copied_question_split(llm, prompt, found: str, found_tokens: Sequence[int]) -> dict:
    """Where kvpress's "copied" setting cuts Locret-Q auto's prompt (the question copied to the start): the tokens it
    pins, by the C library's rule the tools use (BOS and the template's opening through the copy's end), and where
    the question at the end starts, the same tail of ids as the plain prompt's from `question_at`. No question found:
    the plain prompt, nothing pinned (Locret-Q auto is then plain Locret). copied_question_at is None, which the
    kvpress side refuses, when the two prompts' tails differ (a tokenizer that merges across the boundary) or the
    library cannot pin the copy (a completion prompt in a chat template: the question found runs into the template's
    special tokens, whose text the pin rule does not read; the engine refuses such a prompt too)."""
    if not found:
        return {"copied_question_at": prompt.question_at, "copied_pinned": 0}
    from .. import eviction
    from ..heads import HeadsError

    tail = len(prompt.tokens) - prompt.question_at
    at = len(found_tokens) - tail
    same_tail = tuple(found_tokens[at:]) == tuple(prompt.tokens[prompt.question_at:])
    try:
        pinned = eviction.model_query_tokens(llm, list(found_tokens), found, len(found_tokens))
    except HeadsError:
        return {"copied_question_at": None, "copied_pinned": 0}
    return {"copied_question_at": at if same_tail and pinned <= at else None, "copied_pinned": pinned}


def ruler_items(llm, tasks: Sequence[str], lengths: Sequence[int], samples: int, seed: int, *, mode: str,
                random_start: bool, cache: Path, progress=None) -> list[Item]:
    """RULER's samples, written by the package's own generators with the model's tokenizer (ruler.package), as
    items: the text the server is sent, the ids it reads (ruler.prompts), where the question starts (kvpress's
    split). The samples of a (task, length, seed) are kept in `cache`, so a resumed or extended run reuses them."""
    from ..ruler import RulerError, TASKS, package, prompts

    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise ItemError(f"unknown RULER task {', '.join(unknown) or '(none given)'}; the package's tasks: {', '.join(TASKS)}")
    tokenize, chat = decoding.tokenizer(llm), decoding.chat_format(llm)
    if mode == "chat" and chat is None:
        # llama-server would wrap the message in its ChatML fallback, which a base model never saw: every answer
        # (full attention's too) is then template noise, a table of zeros that says nothing about eviction
        raise ItemError(f"{Path(llm.model_path).name} has no chat template, so RULER's chat mode would score the "
                        "server's ChatML fallback; use --ruler-mode completion (the prompt as the package writes it)")
    template = prompts.model_template(chat) if mode == "completion" else "{task_template}"
    model_path = llm.model_path
    tokenizer = package.GGUFTokenizer(model_path)
    out: list[Item] = []
    try:
        for task in tasks:
            for length in lengths:
                try:
                    drawn = prompts.cached_samples(cache, task, model_path=model_path, length=length, samples=samples,
                                                   seed=seed, model_template_text=template, random_start=random_start,
                                                   tokenizer=tokenizer)
                    for s in drawn:
                        p = prompts.build(s, mode=mode, chat=chat, tokenize=tokenize)
                        found, found_tokens = _ruler_auto_query(p.text, mode, chat, tokenize)
                        copied = _copied_question_split(llm, p, found, found_tokens)
                        out.append(Item(id=f"{RULER_PREFIX}{task}/{length}/{s.index}", source=RULER_PREFIX + task, length=length,
                                        depth=None, tokens=p.tokens, max_new_tokens=s.tokens_to_generate,
                                        answers=s.outputs, query=p.question, auto_query=found,
                                        auto_query_tokens=found_tokens,
                                        extra={"mode": mode, "prompt_text": p.text, "question_at": p.question_at,
                                               "input_end": p.input_end, "ruler_length": s.length, "seed": seed,
                                               "index": s.index, **copied}))
                except RulerError as e:
                    raise ItemError(str(e)) from None
                if progress is not None:
                    progress.update(1)
    finally:
        tokenizer.close()
    return out
