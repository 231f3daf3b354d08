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
    end: int = 0  # the line of its closing fence (past the file's last line when the block is never closed)

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
        blocks.append(Block(path, i + 1, lang.lower(), marker, reason, "\n".join(body) + "\n", j + 1))
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


def linked_docs() -> list[Path]:
    """The pages whose links between each other must resolve: the docs, the shipped heads' page and the probes'."""
    return [*doc_files(), REPO / "heads" / "README.md", REPO / "experiments" / "README.md"]


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)[^)]*\)")
HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)(\s+#+)?\s*$")
INLINE_CODE = re.compile(r"(`+).*?\1")


def prose(path: Path) -> list[str]:
    """A markdown file's lines with those of fenced blocks blanked: a `#` or `[x](y)` in a block is code, not markup."""
    lines = path.read_text().splitlines()
    for block in parse_blocks(path):
        lines[block.line - 1:block.end] = [""] * len(lines[block.line - 1:block.end])
    return lines


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: a link keeps its text; lowercase; characters other than letters, digits,
    spaces, hyphens and underscores dropped; spaces become hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a markdown file; a repeated heading gets -1, -2, ... as on GitHub."""
    count: dict[str, int] = {}
    out = set()
    for line in prose(path):
        if m := HEADING.match(line):
            a = github_anchor(m.group(1))
            out.add(f"{a}-{count[a]}" if a in count else a)
            count[a] = count.get(a, 0) + 1
    return out


def test_results_hold_the_current_figures_in_at_most_400_lines():
    """docs/results.md is the current figure for each claim; superseded ones go to experiments/results-history.md
    (a page that only grows cannot be read for what is current)."""
    n = len((REPO / "docs" / "results.md").read_text().splitlines())
    assert n <= 400, f"docs/results.md has {n} lines: move superseded figures to docs/experiments/results-history.md"


def test_every_link_between_the_docs_resolves():
    """A relative link to a .md file (or to a heading of its own page) names a file that exists and, after `#`, an
    anchor one of that file's headings has: moving a section or renaming a heading must take its links along."""
    broken, known = [], {}
    for page in linked_docs():
        text = "\n".join(INLINE_CODE.sub("", line) for line in prose(page))
        for m in LINK.finditer(text):  # a link's text may wrap onto the next line
            target = m.group(1)
            file, _, anchor = target.partition("#")
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or (file and not file.endswith(".md")):
                continue  # https:, mailto:, pictures, source files
            dest = (page.parent / file).resolve() if file else page
            where = f"{page.relative_to(REPO)}:{text.count(chr(10), 0, m.start(1)) + 1}: ({target})"
            if not dest.is_file():
                broken.append(f"{where} no such file")
            elif anchor and anchor not in known.setdefault(dest, anchors(dest)):
                broken.append(f"{where} no heading with that anchor in {dest.relative_to(REPO)}")
    assert not broken, "links that do not resolve:\n" + "\n".join(broken)


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
