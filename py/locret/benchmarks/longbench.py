"""LongBench (v1 and LongBench-E) JSONL files: records and scores as LongBench defines them.

Record layout (LongBench README, "Data Format"): ``input`` (the question or instruction, may be empty),
``context`` (the long text), ``answers`` (list of gold strings), ``length`` (words, or characters for
Chinese), ``dataset`` (task name), ``language``, ``all_classes`` (class names for classification tasks,
else null), ``_id``. We need input, context, answers and dataset; the others are checked when present,
and all_classes is required for the classification tasks.

Scoring follows LongBench's eval.py: each dataset has one metric (DATASET_METRIC, the mapping of
eval.py's ``dataset2metric``); for trec, triviaqa, samsum and lsht only the first line of the
prediction (after leading newlines) is scored; a prediction scores its best over the gold answers;
a task's result is 100 x the mean, rounded to two decimals (LongBench-E also per length band:
under 4k, 4k to 8k, 8k and more). The metric functions live in locret.metrics.

LongBench's official prompt templates (its config/dataset2prompt.json) are not part of this module; the
runner decides how context and question are put together.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .. import metrics
from .records import DatasetError, Fields, Record, check_pairs, mean, read_jsonl

NAME = "longbench"
LAYOUT = ("input", "context", "answers", "length", "dataset", "language", "all_classes", "_id")

DATASET_METRIC = {
    "narrativeqa": "qa_f1", "qasper": "qa_f1", "multifieldqa_en": "qa_f1", "multifieldqa_zh": "qa_f1_zh",
    "hotpotqa": "qa_f1", "2wikimqa": "qa_f1", "musique": "qa_f1", "dureader": "rouge_zh",
    "gov_report": "rouge", "qmsum": "rouge", "multi_news": "rouge", "vcsum": "rouge_zh",
    "trec": "classification", "triviaqa": "qa_f1", "samsum": "rouge", "lsht": "classification",
    "passage_retrieval_en": "retrieval", "passage_count": "count", "passage_retrieval_zh": "retrieval_zh",
    "lcc": "code_sim", "repobench-p": "code_sim",
}
FIRST_LINE_ONLY = frozenset({"trec", "triviaqa", "samsum", "lsht"})


def _task_name(dataset: str) -> str:
    return dataset[:-2] if dataset.endswith("_e") and dataset[:-2] in DATASET_METRIC else dataset


def load(path: str | Path, task: str | None = None) -> list[Record]:
    """Records of a LongBench JSONL file. `task` overrides each record's ``dataset`` field."""
    out = []
    for where, rec in read_jsonl(path):
        f = Fields(rec, where, "LongBench", LAYOUT)
        context, question, answers = f.text("context"), f.text("input"), f.texts("answers")
        dataset = task or f.text("dataset")
        name = _task_name(dataset)
        if name not in DATASET_METRIC:
            raise f.fail(f"unknown LongBench dataset {dataset!r}; known: {', '.join(DATASET_METRIC)}")
        if not answers:
            raise f.fail("field 'answers' is empty: nothing to score against")
        all_classes = f.texts("all_classes", required=False, nullable=True)
        if DATASET_METRIC[name] == "classification" and not all_classes:
            raise f.fail(f"{name} is a classification task and needs 'all_classes', a list of class names")
        if DATASET_METRIC[name].startswith("retrieval"):
            pattern = r"段落(\d+)" if name.endswith("_zh") else r"Paragraph (\d+)"
            try:
                for a in answers:
                    metrics.retrieval_score("", a, pattern)
            except ValueError as e:
                raise f.fail(str(e)) from None
        length = f.integer("length", required=False)
        language = f.text("language", required=False, nullable=True)
        out.append(Record(NAME, name, f.identifier("_id", where), context, question, tuple(answers),
                          DATASET_METRIC[name], where,
                          {"all_classes": all_classes, "length": length, "language": language}))
    return out


def score(record: Record, prediction: str) -> float:
    """LongBench's score of one prediction, in [0, 1]."""
    if record.task in FIRST_LINE_ONLY:
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric = record.metric
    if metric in ("qa_f1_zh", "rouge_zh"):
        segment = metrics.chinese_segmenter()
        fn = ((lambda p, g: metrics.qa_f1_zh_words(p, g, segment)) if metric == "qa_f1_zh"
              else (lambda p, g: metrics.rouge_l_zh_longbench(p, g, segment)))
    elif metric == "classification":
        classes = record.extra["all_classes"]
        fn = lambda p, g: metrics.classification_score(p, g, classes)   # noqa: E731
    else:
        fn = {"qa_f1": metrics.qa_f1, "rouge": metrics.rouge_l_longbench, "count": metrics.count_score,
              "code_sim": metrics.code_sim_score,
              "retrieval": metrics.retrieval_score,
              "retrieval_zh": lambda p, g: metrics.retrieval_score(p, g, r"段落(\d+)")}[metric]
    return metrics.best_over(fn, prediction, record.answers)


def summarize(records: Sequence[Record], predictions: Sequence[str]) -> dict[str, float]:
    """Per task, 100 x the mean score rounded to two decimals (LongBench's eval.py ``scorer``)."""
    check_pairs(records, predictions)
    by_task: dict[str, list[float]] = {}
    for r, p in zip(records, predictions):
        by_task.setdefault(r.task, []).append(score(r, p))
    return {t: round(100 * mean(s), 2) for t, s in by_task.items()}


def summarize_by_length(records: Sequence[Record], predictions: Sequence[str]) -> dict[str, dict[str, float]]:
    """LongBench-E's ``scorer_e``: per task, 100 x the mean score in the length bands 0-4k, 4-8k, 8k+
    (of the records' ``length`` field; a band with no records is left out)."""
    check_pairs(records, predictions)
    out: dict[str, dict[str, list[float]]] = {}
    for r, p in zip(records, predictions):
        length = r.extra.get("length")
        if length is None:
            raise DatasetError(f"{r.where}: no 'length' field, needed to score by length band")
        band = "0-4k" if length < 4000 else "4-8k" if length < 8000 else "8k+"
        out.setdefault(r.task, {}).setdefault(band, []).append(score(r, p))
    return {t: {b: round(100 * mean(s), 2) for b, s in bands.items()} for t, bands in out.items()}
