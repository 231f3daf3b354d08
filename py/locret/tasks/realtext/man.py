"""Manual pages as plain paragraphs, rendered by groff the way man shows them, without the formatting.

groff runs with tbl (the pages' tables), the man macros, UTF-8 output, and grotty's options that drop bold,
underline and colour (-P-cbou); continuous rendering (-rcR=1) makes one page without page breaks, and a line length
of 2000 characters (-rLL=2000n) sets each filled paragraph on one line, so no hyphenation or justification spaces
are left to undo; no-fill blocks (synopses, examples, tables) keep their own lines. The indentation of a
section's text is taken off (nested blocks keep theirs beyond it). The page's title line and footer
("open(2) System Calls Manual open(2)", "Linux man-pages 6.03 2023-02-05 open(2)") are part of the page as a reader
sees it, and stay.
"""
from __future__ import annotations

import gzip
import os
import subprocess

from . import paragraphs

GROFF = ("groff", "-t", "-man", "-Tutf8", "-k", "-rcR=1", "-rLL=2000n", "-P-cbou")
BODY_INDENT = 7     # the man macros' indentation of a section's text, taken off every line (nesting stays)


def source(data: bytes) -> str:
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    return data.decode("utf-8", errors="replace")


def is_redirect(text: str) -> bool:
    """A page that only includes another (".so man2/open.2"): read under that page's own name."""
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith(('.\\"', "'\\\""))]
    return len(lines) == 1 and lines[0].startswith(".so ")


def render(text: str) -> str:
    """The page as groff prints it (plain UTF-8 text); RuntimeError when groff fails."""
    env = dict(os.environ, LC_ALL="C.UTF-8")
    proc = subprocess.run(GROFF, input=text.encode(), capture_output=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"groff failed: {proc.stderr.decode(errors='replace')[-400:]}")
    return proc.stdout.decode("utf-8", errors="replace")


def units(data: bytes) -> list[str]:
    """The haystack units (paragraphs) of one page's file; [] for a redirection."""
    text = source(data)
    if is_redirect(text):
        return []
    return paragraphs.prose_units(outdent(render(text)), dedent=False)


def outdent(text: str, n: int = BODY_INDENT) -> str:
    """Every line with up to `n` of its leading spaces taken off."""
    return "\n".join(line[min(n, len(line) - len(line.lstrip(" "))):] for line in text.split("\n"))
