// Faults a test can inject into an evicting context (llama_locret_debug_inject_fault): each makes the next matching
// operation fail where a real failure could, so that the tests see the cache left consistent.
#pragma once

enum locret_fault {
    LOCRET_FAULT_NONE           = 0,
    LOCRET_FAULT_EVICT_ALLOC    = 1, // the next compaction graph cannot be allocated
    LOCRET_FAULT_EVICT_COMPUTE  = 2, // the next compaction graph fails to start
    LOCRET_FAULT_UBATCH         = 3, // the next ubatch fails after it was placed and computed
    LOCRET_FAULT_STATE_READ     = 4, // the next state load fails after the KV cells were restored
};

// the fault injected for the next matching operation, consumed when it matches
struct locret_faults {
    locret_fault pending = LOCRET_FAULT_NONE;

    void inject(locret_fault f) { pending = f; }
    bool take(locret_fault f) {
        if (pending != f) {
            return false;
        }
        pending = LOCRET_FAULT_NONE;
        return true;
    }
};
