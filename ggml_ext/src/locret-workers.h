// Host threads for the eviction's bookkeeping.
//
// After the one wait of an eviction the host turns each (layer, KV head)'s chosen cells into keep lists, new
// positions and move tables before it queues the compaction: O(units held) per row, about a millisecond for
// SmolLM2's 90 rows of 2,560 cells on one core. On a GPU the device idles through it (a ubatch there computes in about
// 11 ms), so the layers are spread over the context's batch threads, which sit idle at that moment. The threads are
// made once, when the context is made (reserve), and park between evictions: starting threads per eviction would
// cost about as much as the work. The caller takes items too and waits for the items, not the threads, so a thread
// that gets no core in time (a loaded machine) delays nothing.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <cstddef>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

class locret_workers {
public:
    locret_workers() = default;
    ~locret_workers();
    locret_workers(const locret_workers &) = delete;
    locret_workers & operator=(const locret_workers &) = delete;

    // f(i) for every i in [0, n), over the calling thread and min(n, n_threads) - 1 parked ones (made on first use or
    // by reserve; the pool grows to the most asked, never shrinks); returns when every f(i) has returned. f must not
    // throw; calls from several threads at once are not supported (the memory evicts from one thread).
    void parallel_for(size_t n, unsigned n_threads, const std::function<void(size_t)> & f);

    // makes the n_threads - 1 parked threads a job of n_threads uses now, so that the first eviction does not pay for
    // starting them
    void reserve(unsigned n_threads);

    size_t n_parked() const { return threads.size(); }

private:
    void worker_loop(size_t me); // `me`: the thread's index, it joins a job when below n_wanted
    void run_items();

    std::vector<std::thread> threads;
    std::mutex               mtx;
    std::condition_variable  cv_work;
    std::condition_variable  cv_done;
    const std::function<void(size_t)> * job = nullptr;
    size_t   n_items   = 0;   // the current job's items (all under mtx)
    size_t   next_item = 0;   // ... the next one to hand out
    size_t   n_done    = 0;   // ... the ones that have returned: the caller waits for n_done == n_items
    unsigned n_wanted  = 0;   // parked threads woken for the current job
    uint64_t round     = 0;   // bumped per job: a parked thread joins each round at most once
    bool     stop      = false;
};
