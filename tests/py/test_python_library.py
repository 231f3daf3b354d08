"""`import locret; import llama_cpp` runs the libllama this checkout built, and nothing else."""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import llama_tree
from conftest import BIN, REPO, THREADS, run

PROBE = r"""
import json, locret, llama_cpp
import llama_cpp.llama_cpp as L
maps = [line.split()[-1] for line in open("/proc/self/maps") if "libllama" in line or "libggml" in line]
print(json.dumps({"lib": L._lib._name, "native": locret.native_version(),
                  "version": locret.__version__, "mapped": sorted(set(maps))}))
"""


def _probe():
    env = dict(os.environ)
    env.pop("LLAMA_CPP_LIB_PATH", None)
    return run([sys.executable, "-c", PROBE], env=env, timeout=120)


def test_import_locret_loads_our_library():
    proc = _probe()
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(info["lib"]).resolve() == (BIN / "libllama.so").resolve()
    # every llama/ggml library mapped into the process comes from our build folder
    assert info["mapped"], "no libllama/libggml mapped"
    for path in info["mapped"]:
        assert Path(path).resolve().parent == BIN.resolve(), f"{path} is not from {BIN}"
    native_version, native_series = info["native"]
    assert native_version == info["version"], "libllama and the locret package disagree on the version"
    # the library was built from exactly the patch series in patches/ (a stale build fails here)
    assert native_series == llama_tree.series_fingerprint(REPO / "patches")


def test_plain_import_llama_cpp_in_the_venv_loads_our_library():
    """A script written for llama-cpp-python runs unchanged in the project's venv: `import llama_cpp` without `import
    locret` loads this build's libllama (setup.sh's .pth hook), proved by the patch series it reports."""
    code = ("import ctypes, json, sys, llama_cpp.llama_cpp as L\n"
            "f = L._lib.llama_locret_patch_series; f.restype = ctypes.c_char_p\n"
            "print(json.dumps({'lib': L._lib._name, 'series': f().decode(), 'locret': 'locret' in sys.modules}))\n"
            "import locret\n"  # afterwards too: the library loaded first is ours, so locret accepts it
            "print('locret after llama_cpp:', locret.native_version()[1] == f().decode())\n")
    env = {k: v for k, v in os.environ.items() if k not in ("LLAMA_CPP_LIB_PATH", "MTMD_CPP_LIB")}
    proc = run([sys.executable, "-c", code], env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    info = json.loads(lines[-2])
    assert lines[-1] == "locret after llama_cpp: True", lines[-1]
    assert not info["locret"], "the probe imported locret: it must not need to"
    assert Path(info["lib"]).resolve() == (BIN / "libllama.so").resolve()
    assert info["series"] == llama_tree.series_fingerprint(REPO / "patches")


def test_llama_cpp_imported_first_with_another_library_is_refused(tmp_path):
    # a second copy of the libraries is "another libllama" for the purpose of this check
    for lib in BIN.glob("lib*.so*"):
        shutil.copy2(lib, tmp_path / lib.name)
    code = ("import llama_cpp\n"
            "try:\n    import locret\n"
            "except RuntimeError as e:\n    print('REFUSED:', e)\n")
    env = dict(os.environ, LLAMA_CPP_LIB_PATH=str(tmp_path))
    proc = run([sys.executable, "-c", code], env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "REFUSED:" in proc.stdout and "import locret first" in proc.stdout, proc.stdout


def test_llama_cpp_python_completes_with_our_library(model_path):
    import locret  # noqa: F401  (must come first)
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(model_path), n_ctx=512, n_threads=THREADS, n_threads_batch=THREADS, seed=42, verbose=False)
    try:
        out = llm.create_completion("The capital of France is", max_tokens=12, temperature=0.0)
    finally:
        llm.close()
    assert "Paris" in out["choices"][0]["text"], out
    assert Path(llama_cpp.llama_cpp._lib._name).resolve() == (BIN / "libllama.so").resolve()
