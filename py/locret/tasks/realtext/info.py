"""GNU info manuals as plain paragraphs: the text of each node, without what only an info reader uses.

An info file is nodes separated by the character 0x1f. Dropped: the preamble before the first node (the
directory entry and the permission notice), the indirect and tag tables, each node's header line ("File: ...,
Node: ..., Next: ..."), its menu (a menu ends its node in Texinfo, so everything from "* Menu:" on), the underlines
of titles, the footnote rulers, the marks makeinfo leaves for info readers, and the nodes that hold a licence
(the GFDL, "Copying This Manual").
"""
from __future__ import annotations

import gzip
import re

from . import paragraphs

SEPARATOR = "\x1f"
_HEADER = re.compile(r"^File: [^,]*,\s+Node: ([^,\n]*)")
_LICENCE_NODE = re.compile(r"licen[cs]e|copying", re.I)
_UNDERLINE = re.compile(r"^[*=\-.]{3,}$")
_FOOTNOTES = re.compile(r"^\s*-{5,} Footnotes -{5,}\s*$")
# makeinfo's marks for info readers ("\0\b[index\0\b]" opens an index node), and any other control character
_READER_MARK = re.compile(r"\x00\x08\[[^\x00]*\x00\x08\]|[\x00-\x08\x0b-\x1f\x7f]")


def read(data: bytes) -> str:
    """The text of an info file's bytes (gzip-compressed or not)."""
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    return data.decode("utf-8", errors="replace")


def node_texts(text: str) -> list[tuple[str, str]]:
    """(node name, body) of every node, in file order, without header line and menu."""
    out = []
    for chunk in text.split(SEPARATOR)[1:]:       # [0] is the preamble
        lines = chunk.lstrip("\n").split("\n")
        m = _HEADER.match(lines[0]) if lines else None
        if not m:
            continue                               # the indirect table, the tag table, local variables
        body = lines[1:]
        menu = next((i for i, line in enumerate(body) if line.startswith("* Menu:")), len(body))
        out.append((m.group(1).strip(), "\n".join(body[:menu])))
    return out


def units(data: bytes) -> list[str]:
    """The haystack units (paragraphs) of one info file."""
    out = []
    for name, body in node_texts(read(data)):
        if _LICENCE_NODE.search(name):
            continue
        body = _READER_MARK.sub("", body)
        kept = [line for line in body.split("\n") if not _UNDERLINE.match(line.strip()) and not _FOOTNOTES.match(line)]
        out.extend(paragraphs.prose_units("\n".join(kept)))
    return out
