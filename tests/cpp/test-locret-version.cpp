// The libllama this test links against must be ours, built from the current patch series:
// the version marker must exist and report what CMake configured.
#include "llama-locret.h"

#include <cstdio>
#include <cstring>

static int check(const char * what, const char * got, const char * want) {
    if (got == nullptr || std::strcmp(got, want) != 0) {
        std::fprintf(stderr, "FAIL: %s: got '%s', want '%s'\n", what, got ? got : "(null)", want);
        return 1;
    }
    std::printf("ok: %s = %s\n", what, got);
    return 0;
}

int main() {
    int failures = 0;
    failures += check("llama_locret_version()",      llama_locret_version(),      LOCRET_EXPECTED_VERSION);
    failures += check("llama_locret_patch_series()", llama_locret_patch_series(), LOCRET_EXPECTED_PATCH_SERIES);

    const size_t n = std::strlen(llama_locret_patch_series());
    if (n != 64) {
        std::fprintf(stderr, "FAIL: patch series fingerprint has %zu chars, want 64 hex chars\n", n);
        failures++;
    }
    return failures == 0 ? 0 : 1;
}
