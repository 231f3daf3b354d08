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

__all__ = ["SUITES", "TASKS", "RulerError"]
