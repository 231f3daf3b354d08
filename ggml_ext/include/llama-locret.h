// Public C API of the Locret extension compiled into libllama.
//
// Declared with LLAMA_API so the symbols are exported from the shared libllama exactly like the
// rest of llama.h; clients (C/C++ tools, llama-cpp-python through ctypes) reach them the same way.
#pragma once

#include "llama.h"

#ifdef __cplusplus
extern "C" {
#endif

// Version of the Locret extension compiled into this libllama, e.g. "0.1.0".
// A client calls it to prove that the library it loaded is ours and not a stock libllama.
LLAMA_API const char * llama_locret_version(void);

// Fingerprint (64 hex chars) of the patch series applied to the llama.cpp tree this library was
// built from; scripts/llama_tree.py computes the same value from patches/, so a stale build can be
// detected.
LLAMA_API const char * llama_locret_patch_series(void);

#ifdef __cplusplus
}
#endif
