"""Every example in README.md and docs/ runs as written.

The convention (docs/testing.md): a fenced block of code in a shell or in Python carries a word after its language:
`run` (this test runs it) or `no-run` followed by the reason it cannot run here (a GPU build, a 128K prompt, a command
that runs the tests themselves). A block without either fails here, so no example is left unchecked by accident.
Blocks of other languages (text, toml, json, C declarations) show data, not commands.

How a block runs: in a fresh folder whose entries link to the checkout's (so `build/`, `heads/`, `.venv/`,
`scripts/` are where the text says, and the files an example writes stay out of the checkout); bash with `set -eo
pipefail`, Python with the venv's interpreter. Where the text says `long_text` (Python) or `$LONG_TEXT` (a file, in
bash), the test supplies a few thousand tokens of the bundled document instead of a long one.
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import REPO, run

RUNNABLE_LANGS = {"bash", "sh", "shell", "python", "py"}
LONG_TEXT_CHARS = 3_200  # about 900 tokens of the bundled document: more than b + B = 768 cells, so examples at b = 512 evict
BLOCK_TIMEOUT_S = 300


@dataclass
class Block:
    path: Path
    line: int
    lang: str
    marker: str  # "run", "no-run" or ""
    reason: str
    text: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([^\s`]*)\s*(.*)$")


def parse_blocks(path: Path) -> list[Block]:
    """The fenced blocks of a markdown file, with the word after the language."""
    blocks, lines = [], path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang, rest = m.groups()
        body, j = [], i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j])
            j += 1
        rest = rest.strip()
        marker, reason = "", ""
        if rest == "run":
            marker = "run"
        elif rest.startswith("no-run"):
            marker, reason = "no-run", rest[len("no-run"):].strip(" :()")
        blocks.append(Block(path, i + 1, lang.lower(), marker, reason, "\n".join(body) + "\n"))
        i = j + 1
    return blocks


def all_blocks() -> list[Block]:
    return [b for p in doc_files() for b in parse_blocks(p)]


def test_the_fence_parser_reads_markers_and_reasons(tmp_path):
    md = tmp_path / "x.md"
    md.write_text("text\n```bash run\necho 1\n```\n\n```python no-run (needs a GPU)\nprint(2)\n```\n"
                  "```text\nplain\n```\n  ```sh\n  ls\n  ```\n")
    got = [(b.lang, b.marker, b.reason, b.text) for b in parse_blocks(md)]
    assert got == [("bash", "run", "", "echo 1\n"), ("python", "no-run", "needs a GPU", "print(2)\n"),
                   ("text", "", "", "plain\n"), ("sh", "", "", "ls\n")]


def test_every_code_block_says_whether_it_runs():
    unmarked = [b.name for b in all_blocks() if b.lang in RUNNABLE_LANGS and not b.marker]
    assert not unmarked, f"code blocks marked neither `run` nor `no-run (why)`: {unmarked}"
    no_reason = [b.name for b in all_blocks() if b.marker == "no-run" and not b.reason]
    assert not no_reason, f"`no-run` blocks must say why they cannot run: {no_reason}"
    wrong_lang = [b.name for b in all_blocks() if b.marker == "run" and b.lang not in RUNNABLE_LANGS]
    assert not wrong_lang, f"`run` on a block this test cannot run: {wrong_lang}"


@pytest.fixture(scope="module")
def long_text_file(tmp_path_factory) -> Path:
    text = (REPO / "scripts" / "data" / "harbor-log.txt").read_text()[:LONG_TEXT_CHARS]
    path = tmp_path_factory.mktemp("long") / "long.txt"
    path.write_text(text)
    return path


def sandbox(tmp_path: Path) -> Path:
    """A folder that looks like the checkout (links to its entries) but keeps what an example writes."""
    for entry in REPO.iterdir():
        if entry.name not in (".git",):
            (tmp_path / entry.name).symlink_to(entry)
    return tmp_path


RUN_BLOCKS = [b for b in all_blocks() if b.marker == "run"]


@pytest.mark.parametrize("block", RUN_BLOCKS, ids=[b.name for b in RUN_BLOCKS])
def test_example_runs_as_written(block: Block, tmp_path, long_text_file):
    cwd = sandbox(tmp_path)
    env = dict(os.environ, LONG_TEXT=str(long_text_file), PYTHONUNBUFFERED="1")
    if block.lang in ("python", "py"):
        prelude = f"long_text = open({str(long_text_file)!r}).read()\n" if "long_text" in block.text else ""
        script = cwd / "example.py"
        script.write_text(prelude + block.text)
        cmd = [sys.executable, str(script)]
    else:
        cmd = ["bash", "-c", "set -eo pipefail\n" + block.text]
    proc = run(cmd, timeout=BLOCK_TIMEOUT_S, cwd=cwd, env=env)
    assert proc.returncode == 0, (f"{block.name} failed (exit {proc.returncode}):\n{block.text}\n--- stdout\n"
                                  f"{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}")
