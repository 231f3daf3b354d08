"""The tests read a tool's output whole, however it ends.

- The command runner reads whatever bytes end it: llama-completion with -n stops after a token count, and the last
  token can be the first bytes of a character (an emoji cut in two). CI once failed on `b'Hello there! \\xf0\\x9f'`
  from a two-token generation.
- A tool's last lines reach a reader that drains its output slowly. llama.cpp's log is printed by a thread of its own,
  and its singleton is never destroyed, so what that thread had not printed when a tool returned was lost
  (patches/0023). CI once got llama-completion's output without its perf figures, exit status 0. Here stderr is a
  pipe shrunk to one page that nobody reads until the tool has had time to finish its work, and then only a page at a
  time: the logging thread blocks on the full pipe while the tool runs on, so its last lines are still queued when the
  tool returns. Without the fix the perf figures are lost every time."""
from __future__ import annotations

import fcntl
import os
import select
import subprocess
import sys
import time

import pytest

from conftest import run, tool

F_SETPIPE_SZ = 1031   # <linux/fcntl.h>; Python 3.11's fcntl module does not name it
PAGE = 4096


def run_with_a_slow_reader(cmd: list, wait_s: float = 4.0, timeout: float = 120) -> tuple[int, str]:
    """Run `cmd` with stderr on a one-page pipe read only after `wait_s` (or once the tool exits, if sooner) and then
    a page every 0.2 s; return its exit status and all of its stderr."""
    read_end, write_end = os.pipe()
    try:
        fcntl.fcntl(write_end, F_SETPIPE_SZ, PAGE)
    except OSError:
        os.close(read_end)
        os.close(write_end)
        pytest.fail("this check needs Linux's F_SETPIPE_SZ")
    proc = subprocess.Popen([str(c) for c in cmd], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=write_end)
    os.close(write_end)
    deadline = time.monotonic() + wait_s
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    # then a page at a time, slowly: a tool that returns while its logging thread waits on the pipe exits meanwhile
    chunks, give_up = [], time.monotonic() + timeout
    try:
        while True:
            if time.monotonic() > give_up:
                pytest.fail(f"{cmd[0]} still wrote to stderr after {timeout} s")
            if not select.select([read_end], [], [], 1.0)[0]:
                continue
            chunk = os.read(read_end, PAGE)
            if not chunk:   # the tool (every copy of the pipe's write end) is gone
                break
            chunks.append(chunk)
            time.sleep(0.2)
        return proc.wait(timeout=timeout), b"".join(chunks).decode(errors="replace")
    finally:
        os.close(read_end)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_llama_completion_prints_its_perf_figures_to_a_slow_reader(model_path):
    rc, err = run_with_a_slow_reader([tool("llama-completion"), "-m", model_path, "-c", "4096", "-b", "512",
                                      "-ub", "64", "-p", "The quick brown fox jumps over the lazy dog. " * 30,
                                      "-n", "2", "-no-cnv", "--temp", "0", "-t", "1", "-lv", "4", "--no-warmup", "--no-display-prompt",
                                      "--locret-policy", "streaming", "--locret-budget", "128"])
    assert rc == 0, err[-2000:]
    assert len(err) > 2 * PAGE, "the tool printed less than the pipe holds: this check proves nothing"
    assert "Locret eviction: policy streaming" in err
    assert "prompt eval time =" in err and "total time =" in err, err[-1500:]


def test_output_cut_inside_a_character_is_read_with_a_replacement():
    out = run([sys.executable, "-c", "import sys; sys.stdout.buffer.write(b'Hello there! \\xf0\\x9f\\n')"])
    assert out.returncode == 0
    assert out.stdout == "Hello there! \ufffd\n"
