"""How many CPU threads a run uses when its caller names none.

llama.cpp's tools read LLAMA_ARG_THREADS for `-t` (and `-tb` follows `-t`); the library's runs (`locret.Llama`,
`locret eval`, `locret inspect`, `locret calibrate`) read the same variable, so one setting reaches every process of a
job (a test run, a batch of evaluations) without a flag on each command."""
from __future__ import annotations

import os

THREADS_ENV = "LLAMA_ARG_THREADS"


def threads_from_env() -> int | None:
    """LLAMA_ARG_THREADS as a thread count; None when unset or empty. As in llama.cpp, 0 or less means every core.
    ValueError (with the variable's name) when it is not a whole number."""
    value = os.environ.get(THREADS_ENV, "").strip()
    if not value:
        return None
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"{THREADS_ENV}={value!r} is not a number of threads") from None
    return n if n > 0 else (os.cpu_count() or 1)


def threads_or_default(given: int | None, fallback: int | None = None) -> int:
    """`given` as it is when the caller named a count (0 or less stays, for the caller's own refusal), else
    default_threads(fallback)."""
    return given if given is not None else default_threads(fallback)


def default_threads(fallback: int | None = None) -> int:
    """The thread count of a run that names none: LLAMA_ARG_THREADS, else `fallback`, else every core."""
    return threads_from_env() or fallback or os.cpu_count() or 1
