"""Python source files as haystack units: the blocks of code and comments between blank lines, as written.

Nothing is reflowed or dedented (indentation is the code's structure); a block longer than the cap is cut at line
ends, and a block that is a licence grant is dropped like every family's (paragraphs.py).
"""
from __future__ import annotations

from . import paragraphs


def units(data: bytes) -> list[str]:
    text = data.decode("utf-8", errors="replace").replace("\r\n", "\n")
    return paragraphs.prose_units(text, dedent=False, squeeze=False)
