"""Shared fixtures: paths of this checkout's build, the default model, and helpers to run tools."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = REPO / "build" / "bin"
sys.path.insert(0, str(REPO / "scripts"))  # llama_tree is a script, imported by its tests


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def model_path() -> Path:
    """The default model; scripts/test.sh resolves it once into LOCRET_TEST_MODEL."""
    env = os.environ.get("LOCRET_TEST_MODEL")
    if env:
        return Path(env)
    from locret import models

    return models.resolve(models.DEFAULT_MODEL, fetch=False)


def tool(name: str) -> Path:
    path = BIN / name
    assert path.is_file(), f"{name} is not built at {path}: run scripts/setup.sh"
    return path


def natural_text() -> str:
    """Long natural English present on every machine: docstrings of standard-library modules."""
    import argparse
    import json
    import tarfile
    import zipfile

    return "\n\n".join(m.__doc__ for m in (argparse, json, tarfile, zipfile) if m.__doc__)


def run(cmd: list, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    """Run a command with captured text output and a hard time limit (never hang a test run)."""
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, **kw)
