"""`locret plan`: Locret settings for a model on a device, and the peak memory they will need.

The settings come from the device profile's size class for the model (devices/*.toml), each one
overridable. The predicted peak memory is the sum of:

- weights: the tensor bytes that the model GGUF's header announces (+ the retaining heads file's),
  placed per layer the way llama.cpp places them for the GPU-layer count;
- KV cache: under Locret llama.cpp allocates pad(b + B, 256) cells whatever the context, and each
  cell of each layer holds one K row and one V row: cells x sum over layers of
  (row_size(type, n_embd_k_gqa) + row_size(type, n_embd_v_gqa)), as llama_kv_cache sizes its tensors;
- compute and output buffers: llama.cpp's own estimate. A child process loads the model with
  `no_alloc` (metadata only; llama.cpp then simulates every allocation instead of making it), creates
  a context with the same context, chunk, budget, heads and KV type, and reports the KV bytes it sized
  (llama_locret_get_stats) and the buffer sizes per buffer type that llama.cpp logs ("compute buffer
  size = ...": no API splits them by backend). The child process keeps llama.cpp's global log hook and
  any abort away from the caller;
- sampling: every sequence's sampler holds arrays over the vocabulary (20 B per token, measured);
- Locret's own buffers, from the same child: the eviction graphs (llama_locret_debug_compute_buffers)
  and move tables (one compaction's sequences, at most COMPACT_MAX_SEQ) and the score store with the
  units' positions (every slot); the last two, and the sequences per compaction, from Locret's creation log.

The profile's memory.available_gib is the limit; a plan over it is refused with what to change.

Modules by job: inputs (GGUF header facts, the user's arguments, which heads), memory (settings, KV bytes,
placement on the device), measure (llama.cpp's estimate in a child process; `python -m locret.planner
--measure` runs it), advice (the plan, the slots that fit, what to change) and report (text, JSON, exit codes).
"""
from __future__ import annotations

from .advice import Plan, _pool_weights, _slots_that_fit, _variant_total, advice, plan, refusal
from .inputs import (ModelFacts, PlanError, parse_context, parse_gpu_layers, parse_slots, read_heads, read_model,
                     resolve_heads, row_size)
from .measure import (COMPACT_MAX_SEQ, LOCRET_PART, LOCRET_SCORES_PART, SAMPLING_BYTES_PER_TOKEN, SAMPLING_PART,
                      Measured, measure, plain_kv_bytes)
from .memory import (DEFAULT_CONTEXT, GIB, KV_PAD, MAX_SLOTS, MIB, Part, Settings, _on_gpu,
                     kv_bytes_per_layer, place, predict_kv_bytes, resolve_settings, sized)
from .report import EXIT_DOES_NOT_FIT, format_plan, run_cli

__all__ = [
    # inputs
    "ModelFacts", "PlanError", "parse_context", "parse_gpu_layers", "parse_slots", "read_heads", "read_model",
    "resolve_heads", "row_size",
    # memory
    "DEFAULT_CONTEXT", "GIB", "KV_PAD", "MAX_SLOTS", "MIB", "Part", "Settings",
    "kv_bytes_per_layer", "place", "predict_kv_bytes", "resolve_settings", "sized",
    # measure
    "COMPACT_MAX_SEQ", "LOCRET_PART", "LOCRET_SCORES_PART", "SAMPLING_BYTES_PER_TOKEN", "SAMPLING_PART", "Measured",
    "measure", "plain_kv_bytes",
    # advice
    "Plan", "advice", "plan", "refusal",
    # report
    "EXIT_DOES_NOT_FIT", "format_plan", "run_cli",
    # internals that tests reach through the package (tests/py/test_devices_planner.py)
    "_on_gpu", "_pool_weights", "_slots_that_fit", "_variant_total",
]
