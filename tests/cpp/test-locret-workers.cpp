// The eviction's host threads (locret_workers, internal to libllama): every item of a job runs exactly once, on the
// number of threads asked (the caller and parked helpers), over many jobs of changing sizes and thread counts.
#include "locret-workers.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "test-checks.h"

// every item of many jobs runs exactly once, with job sizes below, at and above the thread count
static void test_each_item_once() {
    locret_workers w;
    for (int round = 0; round < 3000; ++round) {
        const size_t   n         = (size_t) (round % 37);
        const unsigned n_threads = 1 + (unsigned) (round % 5);
        std::vector<std::atomic<int>> hits(n);
        for (auto & h : hits) {
            h = 0;
        }
        w.parallel_for(n, n_threads, [&](size_t i) { hits[i]++; });
        for (size_t i = 0; i < n; ++i) {
            if (hits[i] != 1) {
                CHECK(hits[i] == 1, "round %d: item %zu of %zu ran %d times with %u threads", round, i, n,
                      hits[i].load(), n_threads);
                return;
            }
        }
    }
    // helpers are made for the largest job that could use them and kept: 4 beside the caller (5 threads asked)
    CHECK(w.n_parked() == 4, "%zu parked threads after jobs of up to 5 threads", w.n_parked());
}

// a job asked to run on k threads runs on k distinct threads, the caller among them, when its items wait for each
// other to start
static void test_threads_used() {
    locret_workers w;
    for (unsigned k : { 1u, 2u, 4u }) {
        std::mutex mtx;
        std::set<std::thread::id> ids;
        std::atomic<unsigned> started { 0 };
        w.parallel_for(k, k, [&](size_t) {
            {
                std::lock_guard<std::mutex> lock(mtx);
                ids.insert(std::this_thread::get_id());
            }
            // each item waits (up to 2 s) until k items have started: only k threads at once can get there
            started++;
            const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
            while (started < k && std::chrono::steady_clock::now() < until) {
                std::this_thread::yield();
            }
        });
        CHECK(ids.size() == k, "%zu distinct threads for a job of %u items on %u threads", ids.size(), k, k);
        CHECK(ids.count(std::this_thread::get_id()) == 1, "the caller takes part in the job (k = %u)", k);
    }
}

// one thread asked, or one item: everything runs on the caller and no helper is made
static void test_caller_only() {
    locret_workers w;
    std::set<std::thread::id> ids;
    w.parallel_for(10, 1, [&](size_t) { ids.insert(std::this_thread::get_id()); });
    w.parallel_for(1, 8, [&](size_t) { ids.insert(std::this_thread::get_id()); });
    CHECK(ids.size() == 1 && ids.count(std::this_thread::get_id()) == 1, "%zu threads ran a caller-only job", ids.size());
    CHECK(w.n_parked() == 0, "%zu helpers made for caller-only jobs", w.n_parked());
}

int main() {
    test_each_item_once();
    test_threads_used();
    test_caller_only();
    if (g_failures > 0) {
        std::fprintf(stderr, "%d check(s) failed\n", g_failures);
        return 1;
    }
    std::printf("test-locret-workers: all checks passed\n");
    return 0;
}
