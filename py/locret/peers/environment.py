"""Where the peers run: kvpress needs an environment of its own (transformers below 5.3; see the package docstring)."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


class PeerEnvironmentError(RuntimeError):
    """The peer's environment is missing; the message says how to make it."""


def kvpress_python() -> Path:
    """The interpreter of .venv-kvpress (made by scripts/setup.sh), or PeerEnvironmentError."""
    python = REPO / ".venv-kvpress" / "bin" / "python"
    if not python.is_file():
        raise PeerEnvironmentError(f"kvpress's environment is missing ({python}): run bash scripts/setup.sh "
                                   "(it makes .venv-kvpress from scripts/requirements-kvpress.txt)")
    return python
