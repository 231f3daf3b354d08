"""cachelock.build_folder_once: a cached folder appears whole or not at all, and is built once across processes."""
from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest

from locret import cachelock


def _fill_with(files: dict[str, str]):
    def fill(staging: Path) -> None:
        for name, text in files.items():
            (staging / name).write_text(text)
    return fill


def test_the_folder_gets_what_fill_wrote_and_no_staging_is_left(tmp_path):
    folder = tmp_path / "cache" / "thing-abc"
    cachelock.build_folder_once(folder, (folder / "done").is_file, _fill_with({"a.bin": "A", "done": "1"}))
    assert sorted(p.name for p in folder.iterdir()) == ["a.bin", "done"]
    assert (folder / "a.bin").read_text() == "A"
    assert sorted(p.name for p in folder.parent.iterdir()) == ["thing-abc"]


def test_a_failed_fill_leaves_neither_the_folder_nor_its_staging(tmp_path):
    folder = tmp_path / "thing"

    def fill(staging: Path) -> None:
        (staging / "half.bin").write_text("half")
        raise RuntimeError("the converter failed")

    with pytest.raises(RuntimeError, match="the converter failed"):
        cachelock.build_folder_once(folder, (folder / "done").is_file, fill)
    assert list(tmp_path.iterdir()) == []


def test_a_built_folder_is_not_built_again_and_a_stale_one_is_replaced(tmp_path):
    folder = tmp_path / "thing"
    calls = []

    def fill(staging: Path) -> None:
        calls.append(staging.name)
        (staging / "done").write_text("new")

    folder.mkdir()
    (folder / "stale.bin").write_text("from a build of an older version")  # no "done": refused by is_built
    (tmp_path / "thing.tmp").mkdir()  # what a killed build leaves
    (tmp_path / "thing.tmp" / "partial").write_text("x")
    cachelock.build_folder_once(folder, (folder / "done").is_file, fill)
    cachelock.build_folder_once(folder, (folder / "done").is_file, fill)
    assert calls == ["thing.tmp"]
    assert sorted(p.name for p in folder.iterdir()) == ["done"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["thing"]


def _build_slowly(folder: str, log: str) -> None:
    def fill(staging: Path) -> None:
        with open(log, "a") as f:
            f.write("built\n")
        time.sleep(0.5)  # long enough for the other process to arrive while this one builds
        (staging / "done").write_text("1")

    cachelock.build_folder_once(Path(folder), (Path(folder) / "done").is_file, fill)


def test_two_processes_asking_at_once_build_once(tmp_path):
    folder, log = tmp_path / "thing", tmp_path / "log.txt"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_build_slowly, args=(str(folder), str(log))) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert log.read_text() == "built\n"
    assert (folder / "done").is_file()
