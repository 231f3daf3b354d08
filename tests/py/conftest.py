"""Shared fixtures: paths of this checkout's build, the default model, and helpers to run tools."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from locret._library import library_dir  # noqa: E402  (first: it points llama-cpp-python at our libllama)
from locret.threads import default_threads  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

# What the shipped SmolLM2 heads' training logs say they read, by evaluation method (heldout.training): the plain
# heads the Python reference and the four first generated families; the Locret-Q heads (stage 1 from the plain heads,
# stage 2 on the trainer's real source) pypackages too. Written once: the tests that check held-out claims share it.
SHIPPED_HEADS_FAMILIES = {"locret": ["code", "legal", "logs", "prose", "pydoc"],
                          "locret-q": ["code", "legal", "logs", "prose", "pydoc", "pypackages"]}
# a sequence's cells are checked after each change in every engine a test starts (ggml_ext/src/locret-cells.h), also
# when pytest is run without scripts/test.sh
os.environ.setdefault("LOCRET_CHECK_CELLS", "1")
# The CPU threads of a run a test starts: LLAMA_ARG_THREADS when set (llama.cpp's tools and the library read it where a
# run names no count: py/locret/threads.py), else 2. One thread a run (cores / workers) measured slower, not faster: on
# three files, two workers, back to back, 247 s against 228 s with two (docs/testing.md).
THREADS = default_threads(2)
BIN = library_dir()  # build/bin, or $LOCRET_BUILD_DIR/bin (scripts/coverage.sh runs the tests on an instrumented build)
sys.path.insert(0, str(REPO / "scripts"))  # llama_tree is a script, imported by its tests
sys.path.insert(0, str(REPO / "experiments"))  # the probes, imported by their tests


import lanes  # noqa: E402  (tests/py/lanes.py: which test is in which lane, and the files' order)


def pytest_configure(config):
    config.addinivalue_line("markers", "fast: the fast lane (scripts/test.sh --fast; tests/py/lanes.py)")
    config.addinivalue_line("markers", "long: the long lane, not run by .ci/run (scripts/test.sh --long)")


def pytest_collection_modifyitems(items):
    for item in items:
        for lane in lanes.lanes_of(item.nodeid):
            item.add_marker(lane)
    # pytest-xdist (--dist loadfile) hands whole files, in collection order, to whichever worker is free: the longest
    # first. A stable sort: a file's tests keep their order.
    items.sort(key=lambda item: lanes.file_order(item.path.name))


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def model_path() -> Path:
    """The default model; scripts/test.sh resolves it once into LOCRET_TEST_MODEL."""
    env = os.environ.get("LOCRET_TEST_MODEL")
    if env:
        return Path(env)
    from locret import models

    return models.resolve(models.DEFAULT_MODEL, fetch=False)


@pytest.fixture(scope="session")
def heads_file(tmp_path_factory, model_path) -> Path:
    """Random heads (d_R 64, seed 3) for the default model, made by the converter's command line: the heads of the
    eviction mechanics tests, which compare llama.cpp with the numpy model on the scores the heads give (any heads
    do). Made once per test run, read-only, shared by the parallel workers (each worker's temporary folder sits in
    the run's; the first worker builds under a lock, the other waits and reuses)."""
    from locret import cachelock

    run_dir = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        run_dir = run_dir.parent  # pytest-N/popen-gwK: the run's folder is shared by its workers, not by other runs
    work = run_dir / "shared-random-heads"
    out = work / "heads.gguf"
    with cachelock.held(out):
        if not out.is_file():
            work.mkdir(parents=True, exist_ok=True)
            ckpt, partial = work / "random.safetensors", work / "heads.partial.gguf"
            for args in (["make-random", "--base", model_path, "--d-r", "64", "--seed", "3", "-o", ckpt],
                         ["--base", model_path, "--heads", ckpt, "-o", partial]):
                proc = run([sys.executable, REPO / "convert" / "heads_to_gguf.py", *args], timeout=300)
                assert proc.returncode == 0, proc.stderr[-3000:]
            partial.replace(out)
    return out


def tool(name: str) -> Path:
    path = BIN / name
    assert path.is_file(), f"{name} is not built at {path}: run scripts/setup.sh"
    return path


def natural_text() -> str:
    """Long natural English present on every machine: docstrings of standard-library modules."""
    import argparse
    import json
    import tarfile
    import zipfile

    return "\n\n".join(m.__doc__ for m in (argparse, json, tarfile, zipfile) if m.__doc__)


def run(cmd: list, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    """Run a command with captured text output and a hard time limit (never hang a test run). Undecodable bytes are
    replaced: a generation cut by -n can end inside a character (an emoji's first bytes), which is not a failure."""
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, errors="replace", timeout=timeout,
                          stdin=subprocess.DEVNULL, **kw)


def free_port() -> int:
    from locret.serve import free_port as port

    return port()


@contextlib.contextmanager
def http_server(cmd: list, log_path: Path, port: int, startup_s: float = 120):
    """Start a server command (its output to `log_path`), wait until GET /health answers 200, yield its
    base URL, and stop it afterwards. Fails with the log's tail if it exits or never becomes healthy."""
    from locret import serve

    with open(log_path, "w") as log:
        server = subprocess.Popen([str(c) for c in cmd], stdout=log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, cwd=REPO)
        try:
            url = f"http://127.0.0.1:{port}"
            try:
                serve.wait_healthy(url, server, log_path, startup_s)
            except RuntimeError as e:
                pytest.fail(str(e))
            yield url
        finally:
            server.terminate()
            server.wait(timeout=30)


def post_json(url: str, body: dict, timeout: float = 600) -> dict:
    import json
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)

