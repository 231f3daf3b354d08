"""A family's corpus: every source file turned into paragraphs once per machine, cached, and read as one long text.

The cache file ($LOCRET_CACHE_DIR/realtext/FAMILY-KEY.json) records what it was built from: each file's name below
the family's root, its sha256 and size, and the tools that shaped it (the Python version for pysource, groff's for
man). KEY is a hash of the sorted file list with sizes and modification times and of those tools, so a changed,
added or removed file builds a new corpus, and the same files always give the same one. Two processes building it
at once wait for each other (cachelock).

A haystack is a stretch of the corpus: paragraphs in document order from a seeded starting paragraph, on into the
next documents (after the last document, the first).
"""
from __future__ import annotations

import bisect
import functools
import hashlib
import json
import os
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

from . import info, man, pysource, sources

FORMAT = 1          # bump when the extraction changes: older caches are then not read


@dataclass(frozen=True)
class Document:
    name: str                        # the file's path below the family's root
    sha256: str
    paragraphs: tuple[str, ...]


@dataclass(frozen=True)
class Family:
    name: str
    roots: Callable[[], tuple[Path, ...]]           # where its files may be
    files: Callable[[], list[sources.SourceFile]]   # sorted
    units: Callable[[bytes], list[str]]             # one file's paragraphs
    tools: Callable[[], dict]                       # what else shapes the text
    parallel: bool = False                          # extraction runs a program per file (threads help)


FAMILIES: dict[str, Family] = {
    "info": Family("info", lambda: (sources.INFO_ROOT,), sources.info_files, info.units, lambda: {}),
    "man": Family("man", lambda: (sources.MAN_ROOT,), sources.man_files, man.units,
                  lambda: {"groff": sources.groff_version(), "command": " ".join(man.GROFF)}, parallel=True),
    "pysource": Family("pysource", lambda: (sources.stdlib_root(),), sources.pysource_files, pysource.units,
                       lambda: {"python": sources.python_version(), "stdlib": str(sources.stdlib_root())}),
}
# text the trainer may read (--contexts pypackages): real source and docstrings, none of it held out
TRAINING_FAMILIES: dict[str, Family] = {
    "pypackages": Family("pypackages", lambda: (sources.purelib_root(),), sources.pypackages_files, pysource.units,
                         lambda: {"python": sources.python_version(), "packages": list(sources.PYPACKAGES)}),
}


@dataclass
class Corpus:
    family: str
    documents: tuple[Document, ...]
    built_with: dict = field(default_factory=dict)   # tools and the cache key
    path: Path | None = None                         # the cache file it was read from

    def __post_init__(self):
        self._starts = []                 # index of each document's first paragraph in the whole corpus
        n = 0
        for d in self.documents:
            self._starts.append(n)
            n += len(d.paragraphs)
        self.n_paragraphs = n
        if n == 0:
            raise sources.MissingSource(f"the {self.family} corpus holds no text")

    def locate(self, i: int) -> tuple[int, int]:
        """(document index, paragraph index in it) of the corpus's paragraph `i`."""
        d = bisect.bisect_right(self._starts, i) - 1
        while not self.documents[d].paragraphs:      # documents without paragraphs share a start
            d += 1
        return d, i - self._starts[d]

    @functools.cached_property
    def lower_text(self) -> str:
        """Every paragraph in lower case, to check that a made-up name occurs nowhere."""
        return "\n".join(p.lower() for d in self.documents for p in d.paragraphs)

    def contains(self, word: str) -> bool:
        return word.lower() in self.lower_text

    @property
    def id(self) -> str:
        return f"{self.family}-{self.built_with.get('key', 'memory')}"


class Stretch:
    """Endless units of a corpus from paragraph `start` on, each a paragraph and a blank line; remembers which
    documents the units it gave came from."""

    def __init__(self, corpus: Corpus, start: int):
        self.corpus, self.start, self.given = corpus, start % corpus.n_paragraphs, []

    def __iter__(self) -> Iterator[str]:
        i = self.start
        while True:
            d, p = self.corpus.locate(i)
            self.given.append(d)
            yield self.corpus.documents[d].paragraphs[p] + "\n\n"
            i = (i + 1) % self.corpus.n_paragraphs

    def documents(self, n_units: int) -> list[Document]:
        """The documents the first `n_units` units came from, in order, each once."""
        return [self.corpus.documents[d] for d in dict.fromkeys(self.given[:n_units])]


def stretch(corpus: Corpus, rng: random.Random) -> Stretch:
    """A stretch starting at a paragraph drawn from `rng` (one draw)."""
    return Stretch(corpus, rng.randrange(corpus.n_paragraphs))


# ------------------------------------------------------------------ building and caching

def cache_folder() -> Path:
    from ...models import cache_dir
    return cache_dir() / "realtext"


def cache_key(family: Family, files: Sequence[sources.SourceFile], tools: dict) -> str:
    listing = []
    for f in files:
        st = f.path.stat()
        listing.append([f.name, str(f.path), st.st_size, st.st_mtime_ns])
    blob = json.dumps([FORMAT, family.name, tools, listing])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _extract(family: Family, f: sources.SourceFile, roots: tuple[Path, ...]) -> tuple[dict, Document]:
    real = sources.check_allowed(f.path, roots)
    data = real.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    return ({"name": f.name, "sha256": digest, "bytes": len(data)},
            Document(f.name, digest, tuple(family.units(data))))


def build(family: Family, files: Sequence[sources.SourceFile], tools: dict, key: str, target: Path) -> None:
    """Extract every file (with a progress bar when it takes more than a few seconds) and write the cache file."""
    from tqdm import tqdm

    roots = family.roots()
    for f in files:                        # refuse before reading anything
        sources.check_allowed(f.path, roots)
    workers = min(4, os.cpu_count() or 1) if family.parallel else 1
    with ThreadPoolExecutor(workers) as pool, \
            tqdm(total=len(files), desc=f"building the {family.name} corpus", unit="file", delay=3) as bar:
        results = []
        for r in pool.map(lambda f: _extract(family, f, roots), files):
            results.append(r)
            bar.update(1)
    record = {"format": FORMAT, "family": family.name, "built_with": dict(tools, key=key),
              "files": [r[0] for r in results],
              "documents": [{"name": d.name, "sha256": d.sha256, "paragraphs": list(d.paragraphs)}
                            for _, d in results if d.paragraphs]}
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(record, ensure_ascii=False))
    tmp.replace(target)


def read(path: Path) -> Corpus:
    record = json.loads(path.read_text())
    docs = tuple(Document(d["name"], d["sha256"], tuple(d["paragraphs"])) for d in record["documents"])
    return Corpus(record["family"], docs, record["built_with"], path)


def manifest(corpus: Corpus) -> list[dict]:
    """The files a cached corpus was built from: name, sha256 and bytes of each."""
    return json.loads(corpus.path.read_text())["files"] if corpus.path else []


# every family load() builds: the held-out ones and the trainer's
_ALL_FAMILIES: dict[str, Family] = {**FAMILIES, **TRAINING_FAMILIES}


def unknown_family(name: str) -> ValueError:
    return ValueError(f"unknown real-text family {name!r}; valid: {', '.join(_ALL_FAMILIES)}")


@functools.lru_cache(maxsize=None)
def _load(name: str, folder: str) -> Corpus:
    from ... import cachelock

    family = _ALL_FAMILIES[name]
    files = family.files()
    tools = family.tools()
    key = cache_key(family, files, tools)
    target = Path(folder) / f"{name}-{key}.json"
    cachelock.build_once(target, target.is_file, lambda: build(family, files, tools, key, target))
    return read(target)


def load(name: str) -> Corpus:
    """The corpus of family `name` (held out or training text), built on first use on this machine (MissingSource
    when its files are not here, ForbiddenSource when a file lies under a forbidden root)."""
    if name not in _ALL_FAMILIES:
        raise unknown_family(name)
    return _load(name, str(cache_folder()))
