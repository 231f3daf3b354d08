"""What every benchmark loader shares: the Record it produces, and reading a JSONL file with errors that
name the file and line.

Why strict: a benchmark file a user downloaded, exported or edited by hand can be truncated, be a JSON
array instead of JSONL, or come from another benchmark. Scoring such a file would give a number that
looks fine and means nothing, so a loader refuses it and says where and why (file:line, the field, what
it should be).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence


class DatasetError(ValueError):
    """A benchmark file that cannot be used as it is; the message starts with file:line."""


@dataclass(frozen=True)
class Record:
    """One question of a benchmark, mapped to what a runner needs.

    context: the long text; question: what is asked about it (for some tasks it is empty because the
    benchmark puts the request in the context, e.g. code completion); answers: the gold answers as the
    benchmark gives them (strings, or numbers for some InfiniteBench tasks); metric: the name of the
    benchmark's scoring rule for this task (see the benchmark's module); where: "file:line".
    """
    benchmark: str
    task: str
    id: str
    context: str
    question: str
    answers: tuple
    metric: str
    where: str
    extra: dict = field(default_factory=dict)


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object"


def read_jsonl(path: str | Path) -> Iterator[tuple[str, dict]]:
    """(where, record) for every non-blank line; DatasetError for a missing or empty file, a line that is
    not UTF-8 or not JSON, or a JSON value that is not an object."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no such file")
    n = 0
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DatasetError(f"{path}:{lineno}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            if lineno == 1:
                line = line.lstrip("\ufeff")
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{lineno}: not JSON ({e.msg} at column {e.colno}); a JSONL file "
                                   "holds one JSON object per line") from None
            if not isinstance(obj, dict):
                raise DatasetError(f"{path}:{lineno}: expected a JSON object, got {_kind(obj)}")
            n += 1
            yield f"{path}:{lineno}", obj
    if n == 0:
        raise DatasetError(f"{path}: empty file, no records")


class Fields:
    """Typed access to one record's fields, with errors naming file:line, the field and the benchmark's
    record layout."""

    def __init__(self, record: dict, where: str, benchmark: str, layout: Sequence[str]):
        self.record, self.where, self.benchmark, self.layout = record, where, benchmark, layout

    def fail(self, message: str) -> DatasetError:
        return DatasetError(f"{self.where}: {message}")

    def _get(self, name: str, required: bool) -> Any:
        if name not in self.record:
            if required:
                raise self.fail(f"missing field {name!r} ({self.benchmark} records have: {', '.join(self.layout)})")
            return None
        return self.record[name]

    def _wrong(self, name: str, expected: str, value: Any) -> DatasetError:
        return self.fail(f"field {name!r} should be {expected}, got {_kind(value)}")

    def text(self, name: str, required: bool = True, nullable: bool = False) -> str | None:
        value = self._get(name, required)
        if value is None and (nullable or not required):
            return None
        if not isinstance(value, str):
            raise self._wrong(name, "a string", value)
        return value

    def texts(self, name: str, required: bool = True, nullable: bool = False) -> list[str] | None:
        value = self._get(name, required)
        if value is None and (nullable or not required):
            return None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self._wrong(name, "a list of strings", value)
        return value

    def integer(self, name: str, required: bool = True) -> int | None:
        value = self._get(name, required)
        if value is None and not required:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._wrong(name, "an integer", value)
        return value

    def identifier(self, name: str, fallback: str) -> str:
        value = self._get(name, False)
        if value is None:
            return fallback
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise self._wrong(name, "a string or an integer", value)
        return str(value)

    def raw(self, name: str, required: bool = True) -> Any:
        return self._get(name, required)


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def check_pairs(records: Sequence[Record], predictions: Sequence[str]) -> None:
    """One prediction per record, or a ValueError."""
    if len(records) != len(predictions):
        raise ValueError(f"{len(records)} records but {len(predictions)} predictions")
