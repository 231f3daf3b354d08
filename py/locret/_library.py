"""Find the patched libllama that this checkout built, and prove a loaded library is ours.

llama-cpp-python is installed without its own copy of llama.cpp (CMAKE_ARGS=-DLLAMA_BUILD=OFF);
it loads whatever libllama LLAMA_CPP_LIB_PATH names. `import locret` sets that variable to our
build before llama_cpp is imported, so one llama.cpp build serves the C tools and Python alike.
"""
from __future__ import annotations

import ctypes
import os
import sys
import warnings
from pathlib import Path

# py/locret/_library.py -> repository root, when the package runs from a checkout (editable install); a wheel
# installed elsewhere has no checkout: its build folder comes from LOCRET_BUILD_DIR
REPO_ROOT = Path(__file__).resolve().parents[2]


def in_checkout() -> bool:
    return (REPO_ROOT / "scripts" / "setup.sh").is_file()
LIB_NAME = "libllama.so" if sys.platform != "darwin" else "libllama.dylib"


class LibraryError(RuntimeError):
    """Our libllama is missing, or the process already loaded another one."""


def build_dir() -> Path:
    """Folder holding the built binaries and shared libraries ($LOCRET_BUILD_DIR, else build/)."""
    return Path(os.environ.get("LOCRET_BUILD_DIR", REPO_ROOT / "build")).resolve()


def library_dir() -> Path:
    return build_dir() / "bin"


def library_path() -> Path:
    return library_dir() / LIB_NAME


def tool_path(name: str) -> Path:
    """Path of a built llama.cpp tool, e.g. tool_path('llama-cli')."""
    path = library_dir() / name
    if not path.is_file():
        raise LibraryError(f"{name} is not built at {path}: run `bash scripts/setup.sh`")
    return path


def point_llama_cpp_at_our_library() -> None:
    """Make the next `import llama_cpp` load our libllama (and libmtmd) from the build folder."""
    lib = library_path()
    if not lib.is_file():
        # not fatal here: model management and conversion work without a build; using llama_cpp will not. Outside a
        # checkout (a wheel) without LOCRET_BUILD_DIR there is nothing to point at and nothing to say.
        if in_checkout() or "LOCRET_BUILD_DIR" in os.environ:
            warnings.warn(f"the patched libllama is not built at {lib}: run `bash scripts/setup.sh`", stacklevel=3)
        return
    loaded = sys.modules.get("llama_cpp.llama_cpp")
    if loaded is not None:
        # too late to redirect it: say so unless it already loaded ours
        if Path(loaded._lib._name).resolve() != lib.resolve():
            raise LibraryError(
                f"llama_cpp was imported before locret and loaded {loaded._lib._name}; "
                "import locret first so that llama_cpp loads the patched library")
        return
    os.environ["LLAMA_CPP_LIB_PATH"] = str(lib.parent)
    os.environ.setdefault("MTMD_CPP_LIB", str(lib.parent))


SITE_HOOK_NAME = "locret-libllama.pth"


def site_hook_line(build: Path) -> str:
    """The line of a `.pth` file that makes a plain `import llama_cpp` load our libllama: run by every interpreter of the
    venv at start-up, it sets LLAMA_CPP_LIB_PATH (and MTMD_CPP_LIB) to `build`/bin, or to $LOCRET_BUILD_DIR/bin when
    that is set, unless the user set them. Scripts written for llama-cpp-python then run unchanged."""
    return ("import os; os.environ.setdefault('LLAMA_CPP_LIB_PATH', os.path.join(os.environ.get('LOCRET_BUILD_DIR') or "
            f"{str(build)!r}, 'bin')); os.environ.setdefault('MTMD_CPP_LIB', os.environ['LLAMA_CPP_LIB_PATH'])\n")


def install_site_hook() -> Path:
    """Write the `.pth` hook (site_hook_line) for this build into the running interpreter's site-packages (setup.sh
    calls it for the project's venv). Returns the file's path."""
    import sysconfig

    path = Path(sysconfig.get_paths()["purelib"]) / SITE_HOOK_NAME
    path.write_text(site_hook_line(build_dir()))
    return path


def native_version(lib: ctypes.CDLL) -> tuple[str, str]:
    """(version, patch series) reported by a loaded libllama; LibraryError if it is not ours."""
    try:
        version_fn = lib.llama_locret_version
        series_fn = lib.llama_locret_patch_series
    except AttributeError:
        raise LibraryError(f"{lib._name} is not the Locret-patched libllama (no llama_locret_version)")
    version_fn.restype = ctypes.c_char_p
    version_fn.argtypes = []
    series_fn.restype = ctypes.c_char_p
    series_fn.argtypes = []
    return version_fn().decode(), series_fn().decode()
