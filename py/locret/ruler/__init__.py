"""RULER, the field's long-context yardstick, from NVIDIA's own package, offline, with the model's tokenizer.

    locret eval --suite ruler --lengths 4k,8k --samples 10 --methods full,locret,locret-q-auto --budgets 1024 -o out

Modules, one job each:

- ``package``  the installed package (`nvidia-long-context-eval`): its generators run as they are, with two
               offline stand-ins (the GGUF's tokenizer, nltk's Punkt without a download), its metrics and
               post-processing, the fingerprints of its data files (which training must never read);
- ``prompts``  a sample as the server is sent it (chat or completion), its token ids as the server counts them,
               and where its question starts (the split kvpress needs: context, then question);
- ``report``   RULER's figures from the evaluation's samples: per task, the average over the 13 tasks, the
               kvpress side by side table and its plot (score against compression ratio, one line a method).

The evaluation itself (servers per method, journal, resume) is `locret eval` (py/locret/evaluation): RULER is one of
its item sources, sent through llama-server's OpenAI API by the package's own client
(evaluation/server_backend.py).
"""
from __future__ import annotations

from .package import TASKS, RulerError

SUITES = ("ruler",)


def default_samples(gpu_layers: int | None) -> int:
    """Samples per task and length when --samples is not given: 10 on the CPU (about 40 s a 4K sample on two
    cores), 100 when layers run on a GPU (RULER's own count is 500; 100 keeps a 13-task run within minutes)."""
    return 100 if gpu_layers not in (None, 0) else 10


__all__ = ["SUITES", "TASKS", "RulerError", "default_samples"]
