"""Locret for llama.cpp: long-context inference in bounded KV memory with trained retaining heads.

Importing this package points llama-cpp-python at the patched libllama built by this project. In the
project's own venv ``import llama_cpp`` alone loads it too (setup.sh installs a ``.pth`` hook that sets
``LLAMA_CPP_LIB_PATH``); elsewhere import ``locret`` first::

    import locret
    import llama_cpp   # now runs the patched library

Submodules load on first use: ``locret.models``, ``locret.heads``, ``locret.tasks`` ... work after a plain
``import locret``.
"""
from __future__ import annotations

import importlib
import importlib.util
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _dist_version

from ._library import LibraryError, library_path, point_llama_cpp_at_our_library, tool_path

try:
    __version__ = _dist_version("locret")
except PackageNotFoundError:  # run from a bare tree through PYTHONPATH=py (e.g. scripts/make_shape_models.py)
    __version__ = "0+unknown"

point_llama_cpp_at_our_library()


def native_version() -> tuple[str, str]:
    """(version, patch series) of the libllama that llama_cpp loaded; proves it is ours."""
    import llama_cpp.llama_cpp as _llama_cpp

    from ._library import native_version as _native_version

    return _native_version(_llama_cpp._lib)


def __getattr__(name: str):
    # `locret.Llama` imports llama_cpp, which must come after the library was pointed at ours (above)
    if name == "Llama":
        from .llama import Llama

        return Llama
    # a submodule on first use (`locret.models` after `import locret`), without importing them all at start
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Llama", "LibraryError", "library_path", "native_version", "tool_path", "__version__"]
