"""Text the project holds out: never read by a haystack of ours, never training data. The one rule book for it.

- Debian's per-package documentation and the common licence texts (/usr/share/doc: changelogs, NEWS, READMEs,
  copyright files; /usr/share/common-licenses): the team keeps them for its own checks on text like its users'.
- The data of RULER's package (`long_context_eval`: Paul Graham's essays, SQuAD v2 dev, HotpotQA dev): a benchmark
  others use, which a result is only worth anything on if no heads ever learned from it.

A path is held out when it lies (before or after following links) under a held-out root, or inside the RULER package
wherever that is installed; a training data file is refused too when its bytes are one of RULER's data files (a copy
elsewhere). Used by the real-text families (tasks/realtext/sources.py), the trainer (train/trainer.py, which also
names every data file by sha256 in its log) and RULER's evaluation (which refuses heads whose log names such a file).
"""
from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

HELD_OUT_ROOTS = (Path("/usr/share/doc"), Path("/usr/share/common-licenses"))
# a path with one of these folders in it is the RULER package's (its data sits beside its code)
HELD_OUT_PACKAGE_DIRS = ("long_context_eval",)
RULER_DATA_FILES = ("PaulGrahamEssays.json", "squad.json", "hotpotqa.json")
# the real-text families of the evaluation (tasks/realtext: GNU info manuals, the man-pages project, the standard
# library's source): what our real-text results are measured on, so no training run may draw its text from them
HELD_OUT_FAMILIES = ("info", "man", "pysource")


def why_held_out_family(name: str) -> str | None:
    """Why text kind `name` may not be training text (a held-out real-text family), or None."""
    if name in HELD_OUT_FAMILIES:
        return (f"{name} is a held-out real-text family ({', '.join(HELD_OUT_FAMILIES)}: the evaluation's real "
                "text), which no training run may read")
    return None


def held_out_roots() -> tuple[Path, ...]:
    """HELD_OUT_ROOTS, and the RULER package's folder where it is installed (found without importing it)."""
    roots = list(HELD_OUT_ROOTS)
    for package in HELD_OUT_PACKAGE_DIRS:
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            spec = None
        for location in (spec.submodule_search_locations or []) if spec else []:
            roots.append(Path(location))
    return tuple(roots)


def _under(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def why_held_out(path: str | Path) -> str | None:
    """Why `path` is held out, or None. Links are followed, so a link pointing into a held-out root counts."""
    given = Path(path)
    for candidate in (given.absolute(), given.resolve()):
        for root in held_out_roots():
            if _under(candidate, root.resolve()) or _under(candidate, root):
                return (f"{given} is under {root}, which is held out (the team's own checks: Debian's package "
                        "documentation and licence texts, and RULER's data)")
        if any(part in HELD_OUT_PACKAGE_DIRS for part in candidate.parts):
            return f"{given} is inside the RULER package ({', '.join(HELD_OUT_PACKAGE_DIRS)}), whose data is held out"
    return None


def sha256_of(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def ruler_data_fingerprints() -> dict[str, str]:
    """{sha256: file name} of RULER's bundled data files where the package is installed ({} where it is not)."""
    out = {}
    for root in held_out_roots():
        folder = root / "data" / "synthetic" / "json"
        for name in RULER_DATA_FILES:
            if (folder / name).is_file():
                out[sha256_of(folder / name)] = name
    return out


def why_not_training_data(path: str | Path, sha256: str | None = None) -> str | None:
    """Why a training data file must not be read (held out by its path, or a copy of RULER's data by its bytes), or
    None. `sha256` when it is known already (a training log's record)."""
    problem = why_held_out(path)
    if problem:
        return problem
    digest = sha256 or (sha256_of(path) if Path(path).is_file() else None)
    name = ruler_data_fingerprints().get(digest) if digest else None
    return f"{path} is a copy of RULER's {name} (sha256 {digest[:12]}...), which is held out" if name else None
