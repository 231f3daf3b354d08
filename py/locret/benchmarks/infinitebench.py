"""InfiniteBench JSONL files: records and scores as InfiniteBench defines them.

Record layout (the released data files, one per task, named after it: passkey.jsonl, kv_retrieval.jsonl,
...): ``id``, ``context`` (the long text; some files call it ``content``), ``input`` (the question),
``answer`` (a string, a number, or a list of them), ``options`` (the choices of multiple-choice tasks).
The task comes from the file name unless given.

Scoring follows InfiniteBench's src/compute_scores.py (``get_score_one_*``), one rule per task
(TASK_METRIC); a task's result is the mean score (reported as a percentage). The choice tasks
(longbook_choice_eng, code_debug) are scored against [option text, option letter], the label
src/eval_utils.py's ``get_answer`` builds from the answer and the options. Where that script assumes a
shape the released files do not always have, we take the evident meaning and say so at the rule:
a list of labels where it expects one, numbers written as strings.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

from .. import metrics
from .records import DatasetError, Fields, Record, check_pairs, mean, read_jsonl

NAME = "infinitebench"
LAYOUT = ("id", "context", "input", "answer", "options")
LETTERS = "ABCD"

TASK_METRIC = {
    "passkey": "first_integer", "number_string": "first_integer", "kv_retrieval": "word_match",
    "longbook_sum_eng": "rouge_lsum", "longbook_choice_eng": "choice", "longbook_qa_eng": "qa_f1",
    "longbook_qa_chn": "qa_f1_zh", "longdialogue_qa_eng": "name_match", "math_find": "math_find",
    "math_calc": "math_calc", "code_run": "code_run", "code_debug": "code_debug",
}
CHOICE_TASKS = frozenset({"longbook_choice_eng", "code_debug"})


def _choice_label(f: Fields, answer, options: list[str]) -> tuple[str, str]:
    """[option text, letter] from the answer, as eval_utils.get_answer."""
    if isinstance(answer, list) and len(answer) == 2 and answer[1] in LETTERS:
        return answer[0], answer[1]
    if isinstance(answer, list) and len(answer) == 1:
        answer = answer[0]
    if not isinstance(answer, str) or answer not in options[:len(LETTERS)]:
        raise f.fail(f"the answer {answer!r} is not one of the first {len(LETTERS)} options")
    return answer, LETTERS[options.index(answer)]


def load(path: str | Path, task: str | None = None) -> list[Record]:
    """Records of an InfiniteBench JSONL file; `task` defaults to the file name without .jsonl."""
    path = Path(path)
    name = task or path.stem
    if name not in TASK_METRIC:
        raise DatasetError(f"{path}: cannot tell the InfiniteBench task: {name!r} is not one of "
                           f"{', '.join(TASK_METRIC)} (name the file after its task, or pass the task)")
    out = []
    for where, rec in read_jsonl(path):
        f = Fields(rec, where, "InfiniteBench", LAYOUT)
        context = f.text("context") if "context" in rec or "content" not in rec else f.text("content")
        question = f.text("input")
        answer = f.raw("answer")
        if answer is None or isinstance(answer, (dict, bool)) or answer == [] or answer == "":
            raise f.fail("field 'answer' should be a string, a number or a non-empty list of them")
        options = f.texts("options", required=name in CHOICE_TASKS) or []
        if name in CHOICE_TASKS:
            answers: tuple = _choice_label(f, answer, options)
            question = question + "".join(f"\n{l}. {o}" for l, o in zip(LETTERS, options))
        else:
            answers = tuple(answer) if isinstance(answer, list) else (answer,)
        _check_answers(f, name, answers)
        out.append(Record(NAME, name, f.identifier("id", where), context, question, answers, TASK_METRIC[name],
                          where, {"options": options}))
    return out


def _check_answers(f: Fields, task: str, answers: tuple) -> None:
    def number(v) -> bool:
        if isinstance(v, str):
            return _parse_number(v) is not None
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if task == "math_calc":
        flat = answers[0] if isinstance(answers[0], list) else answers
        ok = all(isinstance(v, int) and not isinstance(v, bool) for v in flat)
        what = "a list of integers"
    elif task in ("math_find", "code_run"):
        ok, what = all(number(v) for v in answers), "a number"
    else:
        ok = all(isinstance(v, str) for v in answers)
        what = "a string or a list of strings"
    if not ok:
        raise f.fail(f"field 'answer' should be {what} for {task}")


def _parse_number(text: str) -> int | float | None:
    for kind in (int, float):
        try:
            return kind(text.strip())
        except ValueError:
            pass
    return None


def _words(prediction: str, separators: str) -> list[str]:
    for c in separators:
        prediction = prediction.replace(c, " ")
    return prediction.split()


def first_integer(prediction: str, label) -> float:
    """passkey, number_string: the first run of digits in the prediction equals the label."""
    digits = next((d for d in re.split(r"[^0-9]", prediction) if d), "")
    return float(digits == str(label))


def word_match(prediction: str, labels: Sequence[str]) -> float:
    """kv_retrieval: the label is one of the prediction's words, words being split at whitespace and at
    newline : \" ' . , ? ! { }. (compute_scores.py tests ``label in words`` with the label as stored;
    with a list of labels we accept any of them.)"""
    words = _words(prediction, "\n:\"'.,?!{}")
    return float(any(l in words for l in labels))


def name_match(prediction: str, label: str) -> float:
    """longdialogue_qa_eng: the label (an upper-case character name) is one of the prediction's words,
    upper-cased, split as in word_match."""
    return float(label in [w.upper() for w in _words(prediction.strip(), "\n:\"'.,?!{}")])


def code_run(prediction: str, label) -> float:
    """code_run: the prediction's last word (split at whitespace and newline . ` ' \" :) is the label as an
    integer."""
    words = _words(prediction.strip(), "\n.`'\":")
    if not words:
        return 0.0
    try:
        return float(int(words[-1]) == int(str(label)))
    except ValueError:
        return 0.0


def _blank_out(text: str, pieces: Sequence[str]) -> str:
    """Each of `pieces` replaced by a space, in order, then runs of spaces collapsed to one."""
    for piece in pieces:
        text = text.replace(piece, " ")
    while "  " in text:
        text = text.replace("  ", " ")
    return text


def code_debug(prediction: str, function: str, letter: str) -> float:
    """code_debug: the prediction starts with "X." or "X:" for the right option letter X, or after one of
    the prefixes "answer is:", "is:", "answer:", "correct option is:" (the first found) names the
    option's letter or function first."""
    prediction = prediction.strip()
    if prediction[:2] in (f"{letter}.", f"{letter}:"):
        return 1.0
    prediction = _blank_out(prediction, ("\n", "`", "'", '"', "-", "*", "Option", "option"))
    for prefix in ("answer is:", "is:", "answer:", "correct option is:"):
        at = prediction.find(prefix)
        if at == -1:
            continue
        rest = prediction[at + len(prefix) + 1:]
        return float(len(prediction) >= at + len(prefix) + 1 and (rest.startswith(letter) or rest.startswith(function)))
    return 0.0


def choice(prediction: str, label: Sequence[str]) -> float:
    """longbook_choice_eng, against label = [option text, letter]: a prediction starting with A-D is that
    letter; a prediction equal to the option text or the letter counts; else the text after "answer is:",
    "answer:", "answer is" or "option is" (the first found) must start with the text or the letter; else
    the first word that is a substring of "ABCD" decides."""
    prediction = prediction.strip()
    if not prediction:
        return 0.0
    if prediction[0] in LETTERS:
        return float(prediction[0] in label)
    if prediction in label:
        return 1.0
    prediction = _blank_out(prediction, ("\n", '"', "'", ".", ",", "?", "!", "{", "}"))
    for prefix in ("answer is:", "answer:", "answer is", "option is"):
        at = prediction.find(prefix)
        if at == -1:
            continue
        if len(prediction) < at + len(prefix) + 1:
            return 0.0
        rest = prediction[at + len(prefix) + 1:]
        return float(any(rest.startswith(s) for s in label))
    for word in prediction.split():
        if word in LETTERS:
            return float(word in label)
    return 0.0


def math_find(prediction: str, label) -> float:
    """math_find: the first number in the prediction (digits, optionally with a decimal part) equals the
    label, compared as an integer when the label is one, else as a float. (A label given as a string is
    read as a number; a decimal prediction for an integer label, on which compute_scores.py stops with an
    error, scores 0.)"""
    if isinstance(label, str):
        label = _parse_number(label)
    found = re.search(r"\d+\.\d+|\d+", prediction)
    if found is None:
        return 0.0
    if isinstance(label, int):
        try:
            return float(int(found.group(0)) == label)
        except ValueError:
            return 0.0
    return float(float(found.group(0)) == label)


def math_calc(prediction: str, labels: Sequence[int]) -> float:
    """math_calc: the share of the expected intermediate results the prediction gets right from the start,
    its numbers being the runs of digits (signs are not read, as in compute_scores.py)."""
    numbers = [int(d) for d in re.split(r"[^0-9]", prediction) if d]
    right = 0
    for want, got in zip(labels, numbers):
        if want != got:
            break
        right += 1
    return right / len(labels)


def score(record: Record, prediction: str) -> float:
    """InfiniteBench's score of one prediction, in [0, 1]."""
    a = record.answers
    m = record.metric
    if m == "first_integer":
        return first_integer(prediction, a[0])
    if m == "word_match":
        return word_match(prediction, a)
    if m == "name_match":
        return name_match(prediction, a[0])
    if m == "code_run":
        return code_run(prediction, a[0])
    if m == "code_debug":
        return code_debug(prediction, a[0], a[1])
    if m == "choice":
        return choice(prediction, a)
    if m == "math_find":
        return math_find(prediction, a[0])
    if m == "math_calc":
        return math_calc(prediction, a[0] if isinstance(a[0], list) else a)
    if m == "qa_f1":
        return metrics.best_over(metrics.qa_f1, prediction, a)
    if m == "qa_f1_zh":
        return metrics.best_over(metrics.qa_f1_zh_chars, prediction, a)
    if m == "rouge_lsum":
        return metrics.best_over(metrics.rouge_lsum, prediction, a)
    raise ValueError(f"unknown InfiniteBench metric {m!r}")


def summarize(records: Sequence[Record], predictions: Sequence[str]) -> dict[str, float]:
    """Per task, 100 x the mean score (compute_scores.py's ``get_score``, as a percentage)."""
    check_pairs(records, predictions)
    by_task: dict[str, list[float]] = {}
    for r, p in zip(records, predictions):
        by_task.setdefault(r.task, []).append(score(r, p))
    return {t: 100 * mean(s) for t, s in by_task.items()}
