"""A lock on a cache folder, so that two processes building the same file wait for each other.

The cache ($LOCRET_CACHE_DIR) is shared by every process of a user: two tools, or the test suite's
parallel workers, may ask for the same stand-in model or random heads at once. Each builder writes
into a temporary name and renames; the lock makes the second process wait and then find the first
one's result instead of building it again (or removing the first one's half-written folder)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from pathlib import Path
from typing import Callable


@contextlib.contextmanager
def held(target: str | os.PathLike):
    """Hold an exclusive lock on the folder that holds `target` until the block ends.

    The folder itself is locked (flock on its descriptor), so the cache gets no lock files; builds of
    other files in the same folder wait too, which costs little: a build happens once per machine."""
    folder = Path(target).parent
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def build_once(target: str | os.PathLike, is_built: Callable[[], bool], build: Callable[[], None]) -> None:
    """Run `build` unless `is_built()`: checked first without the lock (the usual case, already built), then again
    under it (another process may have built it while this one waited)."""
    if is_built():
        return
    with held(target):
        if not is_built():
            build()


def build_folder_once(folder: str | os.PathLike, is_built: Callable[[], bool], fill: Callable[[Path], None]) -> None:
    """Make `folder` with `fill` unless `is_built()` (see build_once).

    `fill(staging)` writes every file into an empty sibling folder (`<folder>.tmp`), which takes the folder's name
    only once `fill` returns: a reader never sees a half-written folder, and a build that fails or is killed
    leaves no folder (its staging is removed on failure, or by the next build)."""
    folder = Path(folder)

    def build() -> None:
        staging = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)  # a build killed before it could clean up
        staging.mkdir(parents=True)
        try:
            fill(staging)
            shutil.rmtree(folder, ignore_errors=True)  # an old or partial folder that is_built() refused
            staging.rename(folder)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    build_once(folder, is_built, build)
