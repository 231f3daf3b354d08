"""Long-context tasks generated offline and seeded: each builds prompts from token pieces and scores
answers. One task per module.

The common interface (every module listed in TASKS)::

    from locret import tasks
    task = tasks.get("niah")                       # ValueError naming the valid tasks for an unknown name
    sample = task.generate(seed, index, tokenize=tok, n_tokens=8192, depth=0.25, chat_format=fmt)
    sample.tokens                                  # prompt token ids (at most n_tokens)
    sample.spans()                                 # [(label, start, end)] of each needle in the prompt
    answer = ...                                   # the model's greedy answer, up to task.MAX_NEW_TOKENS
    sample.score(answer)                           # = task.score(answer, sample.answers), in [0, 1]

- ``generate(seed, index, *, tokenize, n_tokens, depth, chat_format=None, **options) -> haystack.Sample``
  ``tokenize(text, add_bos) -> list[int]`` is the model's tokenizer; ``chat_format(user_message) -> str``
  applies its chat template (None: plain text ending in "Answer:"). ``n_tokens`` is the prompt length
  asked for: the prompt is at most that long and short of it by less than one filler sentence
  (common_words: by a few tokens).
  ``depth`` in [0, 1] places the answer needle(s) in the filler (share of filler tokens before it).
  The same (seed, index, options, tokenizer) always gives the same sample; ``index`` numbers the
  samples of one seed. Task-specific ``options`` are keyword arguments with defaults (see each module).
- ``score(prediction, answers) -> float`` in [0, 1]: how much of the gold answer the prediction has.
- ``NAME``, ``USES_DEPTH`` (False for common_words, whose answer is spread over the whole text: pass no
  depth) and ``MAX_NEW_TOKENS`` (enough tokens for a complete answer).

A ``Sample`` carries ``pieces`` (head / filler / needle / tail, each with its text and tokens; needles
with their label and the depth where they landed), ``question``, ``answers`` (gold), and ``metadata``
(asked and actual length, depth, task options; JSON-serialisable). ``sample.text`` is the prompt as text
for runners that send text; ``sample.context`` the long text alone.

How a runner assembles a prompt: it does not need to. ``sample.tokens`` is already head + filler and
needles + tail, each piece tokenized on its own (so needle positions are exact); feeding those tokens
is the evaluation. haystack.py explains the placement rules.

Filler is our own plain sentences (filler.py; passkey keeps its own), not Python's documentation, which
the head trainer learns from. The needle tasks (all but common_words) take ``haystack=FAMILY`` for another kind of long text (haystacks.FAMILIES: code, legal, logs, recipes, ...;
``"prose"``, the default, is the plain sentences). The real_* tasks take real text instead (realtext.FAMILIES: info,
man, pysource: GNU info manuals, Linux man pages, the Python standard library's source), and only that; a task's
``HAYSTACKS``, where it has one, lists the families it takes.

Tasks: passkey (passkey.py: the original module with its own runner passkey_eval.py; passkey_task.py
puts it in this interface), niah (several keys and values), niah_single (one key, one number, no
distractors: the needle task the default model can do in its window), niah_code, niah_quote and niah_name (the
same with another needle form: a code of capitals and digits, a sentence to quote, a person's name), variable_tracking (chains of assignments),
common_words (most frequent words), long_qa (facts about invented people, F1-scored); over real text (realneedle.py):
real_number (a number shaped like the document's own), real_code (a code of capitals and digits) and real_lookalike
(four alike needles, one asked), whose modules also ``classify`` a wrong answer as a confusion or a miss
(confusion.py).
"""
from __future__ import annotations

import importlib
from types import ModuleType

TASKS = {
    "passkey": "passkey_task",
    "niah": "niah",
    "niah_single": "niah_single",
    "niah_code": "niah_code",
    "niah_quote": "niah_quote",
    "niah_name": "niah_name",
    "variable_tracking": "variable_tracking",
    "common_words": "common_words",
    "long_qa": "long_qa",
    "real_number": "real_number",
    "real_code": "real_code",
    "real_lookalike": "real_lookalike",
}


def get(name: str) -> ModuleType:
    """The module of task `name` (generate, score, NAME, USES_DEPTH, MAX_NEW_TOKENS)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(TASKS)}")
    return importlib.import_module(f"{__name__}.{TASKS[name]}")
