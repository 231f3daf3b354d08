// The checks of the C++ tests: a failed one prints where and why and counts in g_failures, and the test goes on, so
// that one run lists every failure; main() returns non-zero when g_failures > 0. One copy per test executable.
#pragma once

#include <cstdio>

static int g_failures = 0;

#define CHECK(cond, ...) do { \
        if (!(cond)) { std::fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
                       std::fprintf(stderr, __VA_ARGS__); std::fprintf(stderr, "\n"); g_failures++; } \
    } while (0)

#define CHECK_EQ(a, b) do { \
        const long long va_ = (long long) (a), vb_ = (long long) (b); \
        if (va_ != vb_) { std::fprintf(stderr, "FAIL %s:%d: %s == %s: %lld != %lld\n", __FILE__, __LINE__, #a, #b, \
                                       va_, vb_); g_failures++; } \
    } while (0)
