"""Real-text haystack families: documents people wrote, with the version numbers, dates, sizes and look-alike facts
real documents are full of (the generated families of haystacks.py carry no digit at all, so there every number in
a prompt is a needle's).

- ``info``: the GNU info manuals under /usr/share/info (coreutils, find, diffutils, grep, sed, gzip, ...: every
  *.info.gz and its parts *.info-N.gz), node headers, menus, title underlines and licence nodes stripped (info.py);
- ``man``: the Linux man-pages project's pages of sections 2, 3, 5 and 7 (Debian's manpages and manpages-dev;
  scripts/setup.sh installs them), rendered to plain text by groff as man shows them (man.py);
- ``pysource``: the Python standard library's own source files, comments and code, of the interpreter that runs
  the venv (sysconfig's stdlib path), without its test suites, site-packages, the codecs' generated tables and
  pydoc_data (the head trainer's "pydoc" text) (pysource.py).

No family reads under /usr/share/doc, /usr/share/common-licenses or the RULER package (sources.py refuses such a
path with a message), and blocks that are licence grants are dropped everywhere (paragraphs.py).

Each family is built once per machine into a cached corpus that records every file it read by name and sha256
(corpus.py). A haystack is a contiguous stretch of it: paragraphs in document order from a seeded paragraph of a
seeded document, on into the next document; each unit is one paragraph (whole lines) and a blank line, the
contract haystack.assemble keeps. The needle tasks over these families are real_number, real_code and
real_lookalike (tasks/realneedle.py).

No training run has used these families: they are the held-out families of the evaluation (heldout.py), and the
trainer refuses them (holdout.HELD_OUT_FAMILIES). Its own real text is a family of its own, held out from nothing:

- ``pypackages``: the source files of a few third-party packages in the venv's site-packages (numpy, scipy, pandas,
  matplotlib, networkx, nltk: sources.PYPACKAGES), their docstrings and comments, without their test suites.

The real_* needle tasks take it too (NEEDLE_FAMILIES), as the tuning family: a setting (a budget schedule, a pooling
window) is tried there first, and only what holds there is measured once on the held-out three. A figure on it is not
held out from heads trained on it (`locret eval --held-out` refuses it for them: their training logs name it).
"""
from __future__ import annotations

import random

from . import corpus
from .corpus import Corpus, Document, Stretch, load, stretch
from .sources import ForbiddenSource, MissingSource, check_allowed

FAMILIES = tuple(corpus.FAMILIES)   # info, man, pysource: held out
TRAINING_FAMILIES = tuple(corpus.TRAINING_FAMILIES)   # pypackages: the trainer's real text
NEEDLE_FAMILIES = FAMILIES + TRAINING_FAMILIES        # what the real_* tasks take: the held-out three, then tuning


def units(family: str, rng: random.Random) -> Stretch:
    """Endless units of a stretch of `family` starting where `rng` says (one draw); ValueError for an unknown family."""
    return stretch(load(family), rng)


__all__ = ["FAMILIES", "NEEDLE_FAMILIES", "TRAINING_FAMILIES", "Corpus", "Document", "ForbiddenSource",
           "MissingSource", "Stretch",
           "check_allowed", "load", "stretch", "units"]
