"""One lock per cached artefact, so that two processes building the same file wait for each other.

The cache ($LOCRET_CACHE_DIR) is shared by every process of a user: two tools, or the test suite's
parallel workers, may ask for the same stand-in model or random heads at once. Each builder writes
into a temporary name and renames; the lock makes the second process wait and then find the first
one's result instead of building it again (or removing the first one's half-written folder)."""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path


@contextlib.contextmanager
def held(target: str | os.PathLike):
    """Hold an exclusive lock named after `target` (a file or folder in the cache) until the block ends.

    The lock file sits beside the target (`<name>.lock`) and is never removed: removing it would let a
    third process lock a new file while the second still holds the old one."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
