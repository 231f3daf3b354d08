"""L-Eval JSONL files: records and scores as L-Eval defines them.

Record layout (L-Eval README; files LEval-data/<group>/<task>.jsonl): ``input`` (the long document),
``instructions`` (the questions about it), ``outputs`` (one reference per instruction), ``source``,
``evaluation`` (how the task is scored: "exam", "f1", "rouge", or "human"/"LLM" for a judge). One line
holds several questions, so a line becomes one Record per instruction. The task comes from the file
name unless given; records that L-Eval scores with a human or LLM judge are left out unless asked for
(their Records then have metric "judge", which ``score`` refuses).

Scoring follows L-Eval's Evaluation/auto_eval.py and em.py / f1.py / rouge.py (their newest versions,
which changed over time: e.g. a blank prediction to an option question became "None"):

- exam: em.py's ``exact_match_score``. A reference made only of the letters A-D (after dropping
  punctuation and the articles a/an/the, case kept) is an option answer: 1 when the prediction says the
  same letters, 0.25 when its letters are a subset (coursera's multi-answer questions), else 0. Any
  other reference scores 1 when the prediction equals it as a number, or else when the reference,
  lowercased and without spaces, occurs in the prediction (lowercased, without spaces).
  Before that, auto_eval.py rewrites predictions and references per task: the option tasks (coursera,
  quality, tpo) keep only option letters, gsm100 keeps the number after "The answer is", codeU the last
  words of the output, and sci_fi splits "True [fact: False]" into two judgements, each scored.
- f1: SQuAD token F1 (f1.py; locret.metrics.qa_f1), best over references.
- rouge: ROUGE-1, ROUGE-2 and ROUGE-L F of ``rouge_score`` without stemming (rouge.py); L-Eval reports
  the geometric mean of the three averages. ``score`` gives one record's geometric mean;
  ``summarize`` the benchmark's figure.
"""
from __future__ import annotations

import re
import string
from pathlib import Path
from typing import Sequence

from .. import metrics
from .records import DatasetError, Fields, Record, check_pairs, mean, read_jsonl

NAME = "leval"
LAYOUT = ("input", "instructions", "outputs", "source", "evaluation")
EVALUATIONS = ("exam", "f1", "rouge", "human", "LLM")
OPTION_TASKS = ("coursera", "quality", "tpo")      # auto_eval.py's with_option_tasks


def _exam_metric(task: str) -> str:
    # auto_eval.py picks the rewriting by substrings of the prediction file's path; we use the task name
    if any(t in task for t in OPTION_TASKS):
        return "exam_choice"
    if "gsm" in task:
        return "exam_math"
    if "codeU" in task:
        return "exam_code"
    if "sci_fi" in task:
        return "exam_judge"
    return "exam"


def load(path: str | Path, task: str | None = None, keep_judged: bool = False) -> list[Record]:
    """Records of an L-Eval JSONL file, one per instruction; `task` defaults to the file name."""
    path = Path(path)
    name = task or path.stem
    out = []
    for where, rec in read_jsonl(path):
        f = Fields(rec, where, "L-Eval", LAYOUT)
        document, instructions, outputs = f.text("input"), f.texts("instructions"), f.texts("outputs")
        evaluation = f.text("evaluation")
        source = f.text("source", required=False, nullable=True)
        if len(instructions) != len(outputs):
            raise f.fail(f"{len(instructions)} instructions but {len(outputs)} outputs; they go in pairs")
        if not instructions:
            raise f.fail("no instructions")
        if evaluation not in EVALUATIONS:
            raise f.fail(f"unknown evaluation {evaluation!r}; L-Eval uses {', '.join(EVALUATIONS)}")
        if evaluation in ("human", "LLM"):
            if not keep_judged:
                continue
            metric = "judge"
        elif evaluation == "exam":
            metric = _exam_metric(name)
        else:
            metric = evaluation
        if metric == "exam_judge" and not all("[fact:" in o.lower() for o in outputs):
            raise f.fail("sci_fi references look like 'True [fact: False]'; one lacks the '[fact: ...]' part")
        for k, (instruction, output) in enumerate(zip(instructions, outputs)):
            out.append(Record(NAME, name, f"{name}:{where.rsplit(':', 1)[1]}:{k}", document, instruction,
                              (output,), metric, where, {"evaluation": evaluation, "source": source}))
    if not out:
        raise DatasetError(f"{path}: no automatically scored records (all are for a human or LLM judge); "
                           "load with keep_judged=True to get them")
    return out


# ------------------------------------------------------------------ em.py

def _normalize(text: str) -> str:
    """em.py's normalisation: no lowercasing; ASCII punctuation and lowercase articles dropped."""
    text = "".join(ch for ch in text if ch not in string.punctuation)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def exam_match(prediction: str, reference: str) -> float:
    """em.py ``exact_match_score``: 1, 0.25 (a subset of the right options) or 0."""
    ref = _normalize(reference)
    if all(ch in "ABCD" for ch in ref):
        pred = _normalize(prediction)
        if pred == ref:
            return 1.0
        return 0.25 if set(pred) <= set(ref) else 0.0
    try:
        return float(float(prediction) == float(reference))
    except ValueError:
        return float(reference.lower().replace(" ", "") in prediction.lower().replace(" ", ""))


# ------------------------------------------------------------------ auto_eval.py's per-task rewriting

def choice_reference(reference: str) -> str:
    """``process_gt_mc``: the option letters of the reference's first word ("A" when there are none)."""
    first = reference.split()[0] if reference.split() else ""
    return re.sub(r"[^A-D]", "", first) or "A"


def choice_prediction(response: str, multiple: bool) -> str:
    """``process_output_mc``: the option letters a prediction gives. "None" for a blank prediction.
    Single-answer tasks take the first A-D in the text; coursera (`multiple`) takes a leading run of
    letters, or else the letters standing alone before any "Question", or else the first run of A-D
    characters there; "A" when nothing is found (L-Eval's random guess)."""
    if not response.strip():
        return "None"
    if response in "ABCD":
        return response
    if not multiple:
        for ch in response:
            if ch in "ABCD":
                return ch
    lead = ""
    for ch in response:
        if ch not in "ABCD":
            break
        lead += ch
    if len(lead) > 1:
        return "".join(sorted(set(lead)))
    rest = response[len(lead):].split("Question")[0]
    letters = re.sub(r"[^A-D]", "", lead + " ".join(re.findall(r"\s*[A-Z](?=[\s.)])", rest)).strip())
    letters = "".join(sorted(set(letters)))
    if not letters:
        run = re.search(r"[A-D]+", rest)
        letters = run.group(0) if run else ""
    return letters or "A"


def math_answer(response: str) -> str:
    """``process_math``: the number after "The answer is", else the last word with a digit in the first
    paragraph; its digits up to the first '.'."""
    found = re.search(r"The answer is (\S+)", response)
    if found:
        word = found.group(1)
    else:
        word = next((w for w in reversed(response.split("\n\n")[0].split(" ")) if any(c.isdigit() for c in w)), "")
    digits = ""
    for c in word:
        if c.isdigit():
            digits += c
        if c == ".":
            break
    return digits


def code_reference(text: str) -> str:
    """``process_gt_code``: whitespace collapsed; commas, quotes, backslashes and ".0" removed; brackets
    closed up."""
    text = re.sub(r"\s+", " ", text)
    for old, new in ((",", ""), ("'", ""), ("\\", ""), (".0", ""), ("] [", "]["), ("[ [", "[["), ("] ]", "]]")):
        text = text.replace(old, new)
    return text


def code_prediction(response: str, reference: str) -> str:
    """``process_output_code``: the prediction rewritten like a reference, filler phrases removed, then the
    words after "the final output" (as many as the reference has, plus three), or else the last ones."""
    n = len(reference.split()) + 3
    text = code_reference(response)
    for phrase in ("will be", "of the code", "is", "would be", "the value of", "the result of", "printed"):
        text = text.replace(phrase, "")
    if "the final output" in text:
        return " ".join(re.split(r"\s+", text.split("the final output")[-1])[:n])
    return " ".join(re.split(r"\s+", text)[-n:])


def judgements(text: str, prediction: bool) -> list[str]:
    """``process_gt_judge`` / ``process_output_judge`` for sci_fi: "True [fact: False]" -> loyalty and fact.
    A prediction's parts become "true", "false" or "<error>" (the first word containing "true" or "false").
    (A prediction without "[fact:" makes auto_eval.py stop with an error; we score its fact as "<error>".)"""
    pieces = text.lower().split("[fact:")
    parts = [pieces[0].strip(), pieces[1][:-1].strip() if len(pieces) > 1 else ""]
    if not prediction:
        return parts
    out = []
    for part in parts:
        word = next((w for w in part.split() if "true" in w or "false" in w), None)
        out.append("<error>" if word is None else "true" if "true" in word else "false")
    return out


# ------------------------------------------------------------------ scores

def _rouge_parts(prediction: str, reference: str) -> tuple[float, float, float]:
    return (metrics.rouge_n(prediction, reference, 1), metrics.rouge_n(prediction, reference, 2),
            metrics.rouge_l(prediction, reference))


def score(record: Record, prediction: str) -> float:
    """L-Eval's score of one prediction, in [0, 1] (for rouge: the geometric mean of this record's
    ROUGE-1, -2 and -L; L-Eval's figure averages each first, see summarize)."""
    reference = record.answers[0]
    m = record.metric
    if m == "exam_choice":
        return exam_match(choice_prediction(prediction, "coursera" in record.task), choice_reference(reference))
    if m == "exam_math":
        return exam_match(math_answer(prediction), math_answer(reference))
    if m == "exam_code":
        return exam_match(code_prediction(prediction, reference), code_reference(reference))
    if m == "exam_judge":
        got, want = judgements(prediction, True), judgements(reference, False)
        return mean([exam_match(g, w) for g, w in zip(got, want)])
    if m == "exam":
        return exam_match(prediction, reference)
    if m == "f1":
        return metrics.best_over(metrics.qa_f1, prediction, record.answers)
    if m == "rouge":
        return metrics.geometric_mean(_rouge_parts(prediction, reference))
    raise ValueError(f"{record.where}: L-Eval scores this record ({record.extra.get('evaluation')}) with a judge, "
                     "not automatically")


def summarize(records: Sequence[Record], predictions: Sequence[str]) -> dict[str, float]:
    """Per task, L-Eval's figure in percent: 100 x the mean score for exam and f1 tasks; for rouge tasks the
    geometric mean of the mean ROUGE-1, ROUGE-2 and ROUGE-L (auto_eval.py's ``geometric_mean``)."""
    check_pairs(records, predictions)
    scores: dict[str, list[float]] = {}
    parts: dict[str, list[tuple[float, float, float]]] = {}
    for r, p in zip(records, predictions):
        if r.metric == "rouge":
            parts.setdefault(r.task, []).append(_rouge_parts(p, r.answers[0]))
        elif r.metric != "judge":
            scores.setdefault(r.task, []).append(score(r, p))
    out = {t: 100 * mean(s) for t, s in scores.items()}
    for t, ps in parts.items():
        out[t] = 100 * metrics.geometric_mean([mean([x[i] for x in ps]) for i in range(3)])
    return out
