// What the seeded fuzzers (fuzz-locret-heads, fuzz-locret-state) share: the mutations they apply to a valid input: a truncation,
// flipped bits, a 4- or 8-byte field set to a boundary value (or its negation), bytes inserted or removed. Three in
// four positions fall in the input's region of interest [lo, hi) (where the reader under test makes its decisions:
// a GGUF header, a state's Locret section), the rest anywhere; and the report of the most frequent refusals.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

static void fuzz_mutate(std::vector<uint8_t> & in, size_t lo, size_t hi, std::mt19937_64 & rng) {
    auto pick  = [&](size_t n) { return n == 0 ? (size_t) 0 : (size_t) (rng() % n); };
    auto where = [&]() {
        const size_t a = std::min(lo, in.size());
        const size_t b = std::max(a, std::min(hi, in.size()));
        return rng() % 4 != 0 ? a + pick(b - a) : pick(in.size());
    };
    static const uint64_t boundary[] = { 0, 1, 2, 0x7f, 0xff, 0x7fff, 0xffff, 0x7fffffffull, 0x80000000ull,
                                         0xffffffffull, 0x100000000ull, 0x7fffffffffffffffull, 0xffffffffffffffffull };
    switch (rng() % 5) {
        case 0: { // truncation
            in.resize(rng() % 2 ? where() : pick(in.size() + 1));
        } break;
        case 1: { // flipped bits
            const int n = 1 + (int) (rng() % 8);
            for (int i = 0; i < n && !in.empty(); ++i) {
                in[where()] ^= (uint8_t) (1u << (rng() % 8));
            }
        } break;
        case 2: { // a 4- or 8-byte field set to a boundary value, or its negation (counts and positions may be signed)
            const size_t width = rng() % 2 ? 4 : 8;
            if (in.size() >= width) {
                size_t at = where();
                at = std::min(at - at % 4, in.size() - width);
                uint64_t v = boundary[rng() % (sizeof(boundary) / sizeof(boundary[0]))];
                if (rng() % 4 == 0) {
                    v = ~v + 1;
                }
                std::memcpy(in.data() + at, &v, width);
            }
        } break;
        case 3: { // bytes inserted
            const size_t at = std::min(where(), in.size());
            std::vector<uint8_t> extra(1 + pick(16));
            for (auto & b : extra) {
                b = (uint8_t) rng();
            }
            in.insert(in.begin() + (ptrdiff_t) at, extra.begin(), extra.end());
        } break;
        default: { // bytes removed
            const size_t at = std::min(where(), in.size());
            const size_t n  = std::min(1 + pick(16), in.size() - at);
            in.erase(in.begin() + (ptrdiff_t) at, in.begin() + (ptrdiff_t) (at + n));
        } break;
    }
}

// the `n_top` most frequent kinds of refusal, most frequent first
static void fuzz_print_kinds(const std::map<std::string, long> & kinds, size_t n_top = 12) {
    std::vector<std::pair<long, std::string>> top;
    for (const auto & [kind, n] : kinds) {
        top.push_back({ n, kind });
    }
    std::sort(top.rbegin(), top.rend());
    for (size_t i = 0; i < top.size() && i < n_top; ++i) {
        std::printf("  %8ld  %s\n", top[i].first, top[i].second.c_str());
    }
}
