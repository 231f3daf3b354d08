"""The Python package is one distribution: a wheel built from py/ and installed into a fresh virtual environment, away
from the checkout, converts a checkpoint with `locret convert` (the converter lives in the package, not in repository
files run by path).

The fresh environment gets the wheel itself and nothing of the checkout. Its third-party dependencies (numpy, gguf,
safetensors, torch) come from this environment's site-packages through a path entry; a path entry does not run that
folder's .pth hooks, so the editable install of the checkout stays out of it (checked below).
"""
from __future__ import annotations

import shutil
import sys
import sysconfig
from pathlib import Path

from gguf import GGUFReader

from conftest import REPO, run


def test_a_wheel_of_py_converts_a_checkpoint_outside_the_checkout(tmp_path, model_path):
    # built from a copy: setuptools writes its build folders next to the sources
    src = tmp_path / "py"
    shutil.copytree(REPO / "py", src, ignore=shutil.ignore_patterns("*.egg-info", "build", "__pycache__"))
    wheels = tmp_path / "wheels"
    proc = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", wheels, src],
               timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    wheel, = wheels.glob("locret-*.whl")

    venv = tmp_path / "fresh"
    assert run([sys.executable, "-m", "venv", venv], timeout=300).returncode == 0
    py = venv / "bin" / "python"
    proc = run([py, "-m", "pip", "install", "--no-deps", "--no-index", "-q", wheel], timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    site = Path(run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (site / "third-party.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    work = tmp_path / "elsewhere"
    work.mkdir()
    where = run([py, "-c", "import locret, locret.convert; print(locret.convert.__file__)"], cwd=work)
    assert where.returncode == 0, where.stderr[-2000:]
    assert Path(where.stdout.strip()).is_relative_to(venv) and not Path(where.stdout.strip()).is_relative_to(REPO)

    locret = venv / "bin" / "locret"
    ckpt, out = work / "random.safetensors", work / "heads.gguf"
    for args in (["make-random", "--base", model_path, "--d-r", "32", "--seed", "1", "-o", ckpt],
                 ["--base", model_path, "--heads", ckpt, "-o", out]):
        proc = run([locret, "convert", *args], cwd=work, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "not built" not in proc.stderr  # no checkout, no build: nothing to warn about
    heads = GGUFReader(out)
    assert heads.get_field("locret.hidden_size").contents() == 32
    assert len([t for t in heads.tensors if t.name.endswith("fc1.weight")]) == 30
