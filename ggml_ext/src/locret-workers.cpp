// The parked host threads of the eviction's bookkeeping (see locret-workers.h): parallel_for hands out items under one
// lock, and the caller takes items too.

#include "locret-workers.h"

#include <algorithm>

locret_workers::~locret_workers() {
    {
        std::lock_guard<std::mutex> lock(mtx);
        stop = true;
    }
    cv_work.notify_all();
    for (auto & t : threads) {
        t.join();
    }
}

void locret_workers::run_items() {
    // items are handed out under the lock: a job has tens of items (layers), each tens of microseconds of work
    std::unique_lock<std::mutex> lock(mtx);
    while (next_item < n_items) {
        const size_t i = next_item++;
        const std::function<void(size_t)> * f = job;
        lock.unlock();
        (*f)(i);
        lock.lock();
        if (++n_done == n_items) {
            cv_done.notify_one();
        }
    }
}

void locret_workers::worker_loop(size_t me) {
    uint64_t seen = 0;
    for (;;) {
        {
            std::unique_lock<std::mutex> lock(mtx);
            cv_work.wait(lock, [&] { return stop || (round != seen && me < n_wanted); });
            if (stop) {
                return;
            }
            seen = round;
        }
        // a thread that wakes after the job's items are all taken finds none and parks again: the caller waits for
        // the items, not for the threads, so a thread that gets no core in time delays nothing
        run_items();
    }
}

void locret_workers::reserve(unsigned n_threads) {
    while (threads.size() + 1 < n_threads) {
        const size_t me = threads.size();
        threads.emplace_back([this, me] { worker_loop(me); });
    }
}

void locret_workers::parallel_for(size_t n, unsigned n_threads, const std::function<void(size_t)> & f) {
    if (n == 0) {
        return;
    }
    const unsigned n_helpers = (unsigned) std::min<size_t>(n, std::max(1u, n_threads)) - 1;
    if (n_helpers == 0) {
        for (size_t i = 0; i < n; ++i) {
            f(i);
        }
        return;
    }
    reserve(n_helpers + 1);
    {
        std::lock_guard<std::mutex> lock(mtx);
        job       = &f;
        n_items   = n;
        next_item = 0;
        n_done    = 0;
        n_wanted  = n_helpers;
        ++round;
    }
    cv_work.notify_all();
    // the caller takes items too: however late the helpers get a core (a loaded machine, more threads than cores), the
    // job takes about as long as on the caller alone at worst
    run_items();
    std::unique_lock<std::mutex> lock(mtx);
    cv_done.wait(lock, [&] { return n_done == n_items; });
    job = nullptr;
}
