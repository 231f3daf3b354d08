"""The tests' command runner reads a tool's output whatever bytes end it: llama-completion with -n stops after a token
count, and the last token can be the first bytes of a character (an emoji cut in two). CI once failed on
`b'Hello there! \\xf0\\x9f'` from a two-token generation."""
from __future__ import annotations

import sys

from conftest import run


def test_output_cut_inside_a_character_is_read_with_a_replacement():
    out = run([sys.executable, "-c", "import sys; sys.stdout.buffer.write(b'Hello there! \\xf0\\x9f\\n')"])
    assert out.returncode == 0
    assert out.stdout == "Hello there! \ufffd\n"
