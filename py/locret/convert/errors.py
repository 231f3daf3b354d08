"""The converter's refusals and notes, each one line on stderr.

Every refusal (bad input, mismatch with the base model, unreadable file) is raised as a
ConversionError whose message is one line naming the file, layer or tensor at fault; the command
line prints it as ``heads_to_gguf: error: <message>`` and exits with status 1, never a traceback.
Notes tell the user about a choice the converter made for them (e.g. a type fallback).
"""
from __future__ import annotations

import argparse
import sys

PROGRAM = "heads_to_gguf"


class ConversionError(Exception):
    """A refusal with a one-line, user-facing message."""


class RefusingParser(argparse.ArgumentParser):
    """argparse whose usage errors are ConversionErrors, so a bad flag is a one-line refusal (exit status 1)
    like every other, in each of the convert/ commands."""

    def error(self, message: str):
        raise ConversionError(message)


def note(message: str) -> None:
    print(f"{PROGRAM}: note: {message}", file=sys.stderr)


def first_line(error: BaseException) -> str:
    """The first line of a library exception's message, for embedding in a one-line refusal."""
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else "no details"
