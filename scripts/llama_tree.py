#!/usr/bin/env python3
"""Manage the patched llama.cpp tree that this project builds on.

The tree is never committed here. It comes from the ``vendor/llama.cpp`` folder of the pinned
llama-cpp-python sdist, fetched with pip and checked against its sha256. ``prepare`` extracts it
into an ignored folder, makes it a git repository whose first commit is the pristine tree (tag
``locret-base``) and applies ``patches/*.patch`` in order with ``git am``. Developers then edit
llama.cpp there, commit, and run ``export`` to regenerate ``patches/`` with ``git format-patch``.

Commands:
  fetch        download (if needed) and verify the sdist; print its path
  prepare      make the patched tree (idempotent: a tree already carrying patches/ is left alone)
  export       regenerate patches/ from the tree's commits after locret-base
  check        regenerate the series into a temporary folder and compare it with patches/
  fingerprint  print the fingerprint of patches/ (what libllama reports as its patch series)

Every failure ends with a one-line reason on stderr and exit status 1.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

SDIST_NAME = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
SDIST_FILE = f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
VENDOR_PREFIX = "vendor/llama.cpp/"

BASE_TAG = "locret-base"
# Fixed identity and dates make the pristine commit and every applied patch commit the same on
# every machine, so llama.cpp's build info (it embeds the tree's HEAD) and ccache stay stable.
GIT_ENV = {
    "GIT_AUTHOR_NAME": "llama.cpp",
    "GIT_AUTHOR_EMAIL": "llama.cpp@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000",
    "GIT_COMMITTER_NAME": "locret",
    "GIT_COMMITTER_EMAIL": "locret@localhost",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
}
# format-patch options that make the output depend only on the commits' content and messages
FORMAT_PATCH_ARGS = ["--zero-commit", "--no-signature", "--full-index", "--no-numbered", "--no-renames"]


class TreeError(Exception):
    """A failure with a message for the user; main() prints it and exits 1."""


def log(msg: str) -> None:
    print(f"llama_tree: {msg}", file=sys.stderr, flush=True)


def default_cache_dir() -> Path:
    env = os.environ.get("LOCRET_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "locret"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def series_fingerprint(patches_dir: Path) -> str:
    """Fingerprint of a patch series: names and contents, in order.

    The same value is compiled into libllama (llama_locret_patch_series) when it is built."""
    h = hashlib.sha256()
    for patch in list_patches(patches_dir):
        h.update(f"{patch.name}\n{sha256_file(patch)}\n".encode())
    return h.hexdigest()


def list_patches(patches_dir: Path) -> list[Path]:
    if not patches_dir.is_dir():
        raise TreeError(f"patch folder {patches_dir} does not exist")
    return sorted(patches_dir.glob("*.patch"))


def git(tree: Path, *args: str, check: bool = True, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.update(GIT_ENV)
    if env_extra:
        env.update(env_extra)
    proc = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True, env=env)
    if check and proc.returncode != 0:
        raise TreeError(f"git {' '.join(args)} failed in {tree}:\n{proc.stderr.strip()}")
    return proc


# --- sdist -------------------------------------------------------------------------------------

def verify_sdist(path: Path, expected_sha256: str) -> None:
    if not path.is_file():
        raise TreeError(f"sdist {path} does not exist")
    got = sha256_file(path)
    if got != expected_sha256:
        raise TreeError(
            f"sdist {path} has sha256 {got}, expected {expected_sha256}: "
            "refusing to build from an unverified llama.cpp source (delete the file to download it again)")


def fetch_sdist(cache_dir: Path, expected_sha256: str) -> Path:
    """Return the verified sdist from the cache, downloading it with pip when absent."""
    path = cache_dir / SDIST_FILE
    if not path.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        log(f"downloading {SDIST_NAME}=={SDIST_VERSION} sdist with pip into {cache_dir}")
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
             "--no-build-isolation", "--disable-pip-version-check", "-q",
             f"{SDIST_NAME}=={SDIST_VERSION}", "-d", str(cache_dir)],
            capture_output=True, text=True)
        if proc.returncode != 0 or not path.exists():
            # without scikit-build-core (the sdist's build backend; setup.sh installs it) pip cannot
            # read the sdist's metadata in place: let it build an isolated environment (slower)
            proc = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                 "--disable-pip-version-check", "-q", f"{SDIST_NAME}=={SDIST_VERSION}", "-d", str(cache_dir)],
                capture_output=True, text=True)
        if proc.returncode != 0 or not path.exists():
            raise TreeError(f"pip could not download {SDIST_NAME}=={SDIST_VERSION}:\n{proc.stderr.strip()[-2000:]}")
    verify_sdist(path, expected_sha256)
    return path


def extract_vendor_tree(sdist: Path, dest: Path) -> None:
    """Extract <top>/vendor/llama.cpp/ of the sdist into dest (which must not exist)."""
    try:
        tar = tarfile.open(sdist, "r:gz")
    except (tarfile.TarError, OSError) as e:
        raise TreeError(f"sdist {sdist} is not a readable .tar.gz: {e}")
    with tar:
        members = []
        # extracted files get the current time, not the sdist's: a build folder that already
        # holds objects from another tree must see every source as changed
        now = int(time.time())
        for m in tar.getmembers():
            parts = m.name.split("/", 1)
            if len(parts) != 2 or not parts[1].startswith(VENDOR_PREFIX):
                continue
            rel = parts[1][len(VENDOR_PREFIX):]
            # the vendored tree carries a .git *file* pointing into llama-cpp-python's own repo
            if rel in ("", ".git"):
                continue
            m.name = rel
            m.mtime = now
            members.append(m)
        if not members:
            raise TreeError(f"sdist {sdist} has no {VENDOR_PREFIX} folder")
        dest.mkdir(parents=True)
        tar.extractall(dest, members=members, filter="data")


# --- patches -----------------------------------------------------------------------------------

def failing_hunk(patch: Path, file: str, line: int) -> str:
    """The hunk of `patch` that touches `file` and starts at old line `line` (git's report)."""
    text = patch.read_text(errors="replace")
    current_file = None
    hunks: list[tuple[str, int, list[str]]] = []
    for row in text.splitlines():
        if row.startswith("diff --git "):
            current_file = None
        elif row.startswith("--- "):
            current_file = row[4:].removeprefix("a/")
        elif row.startswith("@@"):
            m = re.match(r"@@ -(\d+)", row)
            hunks.append((current_file or "", int(m.group(1)) if m else -1, [row]))
        elif hunks and row[:1] in (" ", "+", "-", "\\") and not row.startswith("-- "):
            hunks[-1][2].append(row)
    for f, start, rows in hunks:
        if f == file and start == line:
            return "\n".join(rows)
    for f, _, rows in hunks:
        if f == file:
            return "\n".join(rows)
    return "(hunk not found in the patch)"


def apply_series(tree: Path, patches: list[Path]) -> None:
    for i, patch in enumerate(patches, 1):
        log(f"applying [{i}/{len(patches)}] {patch.name}")
        proc = git(tree, "am", "--committer-date-is-author-date", str(patch), check=False)
        if proc.returncode == 0:
            continue
        report = (proc.stdout + proc.stderr).strip()
        git(tree, "am", "--abort", check=False)
        where = re.search(r"error: patch failed: (.+):(\d+)", report)
        if where:
            hunk = failing_hunk(patch, where.group(1), int(where.group(2)))
            detail = f"hunk at {where.group(1)}:{where.group(2)} does not apply:\n{hunk}"
        else:
            detail = report
        raise TreeError(f"patch {patch.name} does not apply to the llama.cpp tree: {detail}")


def format_series(tree: Path, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    proc = git(tree, "format-patch", *FORMAT_PATCH_ARGS, "-o", str(out_dir), f"{BASE_TAG}..HEAD")
    return [Path(p) for p in proc.stdout.split()]


# --- tree state --------------------------------------------------------------------------------

def stamp_path(tree: Path) -> Path:
    return tree.with_name(tree.name + ".json")


def read_stamp(tree: Path) -> dict | None:
    try:
        return json.loads(stamp_path(tree).read_text())
    except (OSError, ValueError):
        return None


def write_stamp(tree: Path, sdist_sha256: str, patches_dir: Path) -> None:
    head = git(tree, "rev-parse", "HEAD").stdout.strip()
    stamp = {
        "sdist": f"{SDIST_NAME}=={SDIST_VERSION}",
        "sdist_sha256": sdist_sha256,
        "series": series_fingerprint(patches_dir),
        "patches": [p.name for p in list_patches(patches_dir)],
        "head": head,
    }
    tmp = stamp_path(tree).with_suffix(".json.tmp")
    tmp.write_text(json.dumps(stamp, indent=2) + "\n")
    tmp.replace(stamp_path(tree))


def tree_is_dirty(tree: Path) -> bool:
    return bool(git(tree, "status", "--porcelain", "--untracked-files=no").stdout.strip())


def make_pristine_repo(tree: Path) -> None:
    git(tree, "init", "-q", "-b", "locret")
    git(tree, "config", "core.autocrlf", "false")
    git(tree, "add", "-A", "-f", ".")
    git(tree, "commit", "-q", "--no-verify", "-m", f"llama.cpp pristine: vendor/llama.cpp of {SDIST_FILE}")
    git(tree, "tag", BASE_TAG)


def prepare(tree: Path, patches_dir: Path, sdist: Path | None, sdist_sha256: str, force: bool,
            cache_dir: Path | None = None) -> None:
    """Make `tree` carry the pristine sdist tree plus `patches_dir`. The sdist is needed only when the
    tree must be extracted again; when `sdist` is None it is then fetched into `cache_dir`."""
    patches = list_patches(patches_dir)
    want_series = series_fingerprint(patches_dir)
    stamp = read_stamp(tree)

    if tree.exists() and stamp and (tree / ".git").is_dir():
        head = git(tree, "rev-parse", "HEAD").stdout.strip()
        if (stamp.get("sdist_sha256") == sdist_sha256 and stamp.get("series") == want_series
                and stamp.get("head") == head):
            log(f"{tree} is up to date ({len(patches)} patches, series {want_series[:12]})")
            return
        if not force:
            if tree_is_dirty(tree):
                raise TreeError(
                    f"{tree} has uncommitted changes and patches/ changed: commit them and run "
                    "`scripts/llama_tree.py export`, or pass --force to discard them")
            if stamp.get("head") != head:
                raise TreeError(
                    f"{tree} has commits that are not in patches/ (HEAD {head[:12]}): run "
                    "`scripts/llama_tree.py export` first, or pass --force to discard them")
        if stamp.get("sdist_sha256") == sdist_sha256:
            log(f"patch series changed: resetting {tree} to {BASE_TAG} and applying {len(patches)} patches")
            git(tree, "am", "--abort", check=False)
            git(tree, "reset", "-q", "--hard", BASE_TAG)
            apply_series(tree, patches)
            write_stamp(tree, sdist_sha256, patches_dir)
            return

    if sdist is None:
        sdist = fetch_sdist(cache_dir or default_cache_dir(), sdist_sha256)
    verify_sdist(sdist, sdist_sha256)
    if tree.exists():
        if not force and (tree / ".git").is_dir() and tree_is_dirty(tree):
            raise TreeError(f"{tree} has uncommitted changes: pass --force to replace it")
        log(f"removing stale tree {tree}")
        shutil.rmtree(tree)
    stamp_path(tree).unlink(missing_ok=True)
    log(f"extracting {VENDOR_PREFIX} of {sdist.name} into {tree}")
    # build the tree beside its final place and rename it at the end: no half-made tree on failure
    tree.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".llama-tree-", dir=tree.parent))
    try:
        shutil.rmtree(tmp)
        extract_vendor_tree(sdist, tmp)
        make_pristine_repo(tmp)
        apply_series(tmp, patches)
        tmp.rename(tree)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_stamp(tree, sdist_sha256, patches_dir)
    log(f"{tree} ready: pristine + {len(patches)} patches, series {want_series[:12]}")


def export(tree: Path, patches_dir: Path) -> None:
    if not (tree / ".git").is_dir():
        raise TreeError(f"{tree} is not a prepared tree: run `scripts/llama_tree.py prepare` first")
    if tree_is_dirty(tree):
        raise TreeError(f"{tree} has uncommitted changes: commit them first (only commits become patches)")
    with tempfile.TemporaryDirectory() as tmp:
        new = format_series(tree, Path(tmp))
        for old in list_patches(patches_dir):
            old.unlink()
        for p in new:
            shutil.copy2(p, patches_dir / p.name)
    stamp = read_stamp(tree) or {}
    write_stamp(tree, stamp.get("sdist_sha256", SDIST_SHA256), patches_dir)
    log(f"wrote {len(new)} patches to {patches_dir}")


def check(tree: Path, patches_dir: Path) -> None:
    """Regenerate the series from the tree and compare with patches/, file by file."""
    if not (tree / ".git").is_dir():
        raise TreeError(f"{tree} is not a prepared tree: run `scripts/llama_tree.py prepare` first")
    with tempfile.TemporaryDirectory() as tmp:
        regenerated = {p.name: p.read_bytes() for p in format_series(tree, Path(tmp))}
    committed = {p.name: p.read_bytes() for p in list_patches(patches_dir)}
    problems = []
    for name in sorted(set(regenerated) | set(committed)):
        if name not in committed:
            problems.append(f"{name}: in the tree, missing from {patches_dir}")
        elif name not in regenerated:
            problems.append(f"{name}: in {patches_dir}, not in the tree")
        elif regenerated[name] != committed[name]:
            problems.append(f"{name}: differs from what the tree regenerates")
    if problems:
        raise TreeError("patches/ and the tree have drifted (run `scripts/llama_tree.py export`):\n  "
                        + "\n  ".join(problems))
    log(f"patches/ matches the tree ({len(committed)} patches)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["fetch", "prepare", "export", "check", "fingerprint"])
    ap.add_argument("--tree", type=Path, default=REPO / "third_party" / "llama.cpp",
                    help="the patched llama.cpp tree (default: third_party/llama.cpp)")
    ap.add_argument("--patches", type=Path, default=REPO / "patches", help="patch folder (default: patches/)")
    ap.add_argument("--sdist", type=Path, default=None,
                    help="use this sdist file instead of the cached download")
    ap.add_argument("--sha256", default=SDIST_SHA256, help="expected sha256 of the sdist")
    ap.add_argument("--cache-dir", type=Path, default=None,
                    help="download cache (default: $LOCRET_CACHE_DIR or ~/.cache/locret)")
    ap.add_argument("--force", action="store_true", help="discard uncommitted or unexported work in the tree")
    args = ap.parse_args(argv)

    try:
        if args.command == "fingerprint":
            print(series_fingerprint(args.patches))
        elif args.command == "fetch":
            sdist = args.sdist or fetch_sdist(args.cache_dir or default_cache_dir(), args.sha256)
            verify_sdist(sdist, args.sha256)
            print(sdist)
        elif args.command == "prepare":
            prepare(args.tree.resolve(), args.patches.resolve(), args.sdist, args.sha256, args.force,
                    args.cache_dir)
        elif args.command == "export":
            export(args.tree.resolve(), args.patches.resolve())
        elif args.command == "check":
            check(args.tree.resolve(), args.patches.resolve())
    except TreeError as e:
        print(f"llama_tree: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
