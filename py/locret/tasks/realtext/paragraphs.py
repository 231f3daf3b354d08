"""Cutting extracted text into haystack units: whole paragraphs (blocks between blank lines), none too long, none
that is a licence.

Why a cap: haystack.assemble places a needle only between units and stops the filler at the last whole unit that
fits, so a unit of thousands of tokens would make depths coarse and prompts short. A block over MAX_CHARS is cut at
line ends (a long one-line paragraph at sentence ends), so every unit is still whole lines or whole sentences.

Why no licences: the team keeps licence texts out of every haystack for checks of its own (the common licences, and
the licence grants that manuals and source files carry), so a block that reads like one is dropped.
"""
from __future__ import annotations

import re
import textwrap

MAX_CHARS = 1200

# phrases that only licence grants and disclaimers use
_LICENCE = re.compile(
    r"permission is (hereby )?granted|permission to use, copy|general public license|free documentation license|"
    r"without any warranty|licensed under the|apache license|redistribution and use in source|"
    r"warranties of merchantability|this (program|library|file) is free software", re.I)
_BLANK = re.compile(r"\n[ \t]*\n")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(\"'])")


def blocks(text: str) -> list[str]:
    """The blocks of `text` between blank lines, each line's trailing space removed."""
    out = []
    for block in _BLANK.split(text):
        lines = [line.rstrip() for line in block.split("\n")]
        while lines and not lines[0]:
            lines.pop(0)
        if any(lines):
            out.append("\n".join(lines).rstrip("\n"))
    return out


def is_licence(block: str) -> bool:
    return bool(_LICENCE.search(" ".join(block.split())))


def has_words(block: str) -> bool:
    """False for a block of rules and punctuation only (an underline, a ruler of dashes)."""
    return bool(re.search(r"[A-Za-z0-9]", block))


def cap(block: str, max_chars: int = MAX_CHARS) -> list[str]:
    """`block` as pieces of at most about `max_chars` characters, cut at line ends, and a line longer than that at
    sentence ends (a sentence longer than that stays whole)."""
    if len(block) <= max_chars:
        return [block]
    pieces: list[str] = []
    current: list[str] = []
    size = 0
    for line in _long_lines_split(block.split("\n"), max_chars):
        if current and size + len(line) + 1 > max_chars:
            pieces.append("\n".join(current))
            current, size = [], 0
        current.append(line)
        size += len(line) + 1
    if current:
        pieces.append("\n".join(current))
    return [p for p in pieces if p.strip()]


def _long_lines_split(lines: list[str], max_chars: int) -> list[str]:
    """Lines, with each line over `max_chars` cut into runs of whole sentences (its indentation kept on each)."""
    out = []
    for line in lines:
        if len(line) <= max_chars:
            out.append(line)
            continue
        indent = line[:len(line) - len(line.lstrip())]
        run = ""
        for sentence in _SENTENCE_END.split(line.strip()):
            if run and len(indent) + len(run) + 1 + len(sentence) > max_chars:
                out.append(indent + run)
                run = sentence
            else:
                run = f"{run} {sentence}" if run else sentence
        if run:
            out.append(indent + run)
    return out


def prose_units(text: str, *, dedent: bool = True, squeeze: bool = True) -> list[str]:
    """The haystack units of extracted text: its blocks (dedented, the double spaces of typeset text squeezed),
    without licences and rulers, cut to MAX_CHARS."""
    out = []
    for block in blocks(text):
        if dedent:
            block = textwrap.dedent(block)
        if squeeze:
            block = "\n".join(_squeeze(line) for line in block.split("\n"))
        if not has_words(block) or is_licence(block):
            continue
        out.extend(cap(block))
    return out


def _squeeze(line: str) -> str:
    """A line's inner runs of spaces made short: two (typeset sentence spacing) become one, longer ones (a column
    gap, a man page's title spread over the line) two. Its indentation stays."""
    body = line.lstrip(" ")
    indent = line[:len(line) - len(body)]
    body = re.sub(r" {3,}", "  ", re.sub(r"(?<! ) {2}(?! )", " ", body))
    return indent + body
