"""Locret beside other KV-cache libraries.

- ``locret_press``: ``LocretPress``, the retaining heads as a kvpress press (scores computed in PyTorch from the
  same heads GGUF the engine reads)
- ``torch_heads``:  a heads GGUF as PyTorch weights in Hugging Face's Q/K order, and the scores they give
- ``pooling``:      score pooling, the mean over a window of neighbouring tokens
- ``kvpress_side``: kvpress's presses on the evaluation's prompts, run as a process of its own
- ``environment``:  where that process's interpreter is

ENVIRONMENT (read this first): kvpress 0.5.5 needs transformers below 5.3 (5.23 dropped the `cache_position`
argument its presses read), while the project's .venv must keep transformers 5.23 (the stand-in models of
tests/py/test_standins.py break under 5.2). So kvpress lives in its own venv, `.venv-kvpress/`
(scripts/requirements-kvpress.txt: torch 2.13, transformers 5.2.0, kvpress --no-deps, and this package installed
editable without dependencies). Never downgrade transformers in .venv. Run kvpress code with
`.venv-kvpress/bin/python`; a test in .venv reaches it through a subprocess of that interpreter
(`peers.environment.kvpress_python()`).

torch and kvpress are imported on first use of a name below, never by ``import locret`` or ``import locret.peers``.
"""
from __future__ import annotations

import importlib


def __getattr__(name: str):
    # LocretPress subclasses a kvpress class, so its module imports kvpress (and torch): only when asked for
    if name == "LocretPress":
        return importlib.import_module(f"{__name__}.locret_press").LocretPress
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["LocretPress"]
