"""`locret eval`: long-context tasks and benchmarks, with every scoring method side by side in one run.

    locret eval --tasks passkey,niah --lengths 4k,16k --budgets 512,1024 -o results/eval
    locret eval --benchmark longbench --dataset hotpotqa.jsonl --methods full,locret -o results/lb

Modules, one job each:

- ``items``     what to ask: generated task samples (seeded) or benchmark records, as prompt tokens
                with their scorer, identical for every method;
- ``decoding``  the model's tokenizer and chat template, greedy decoding token by token;
- ``worker``    one (method, budget, length) run in its own process: prefill and decode every item,
                timed, with the eviction figures and, for chosen items, the retained units per layer and
                KV head after every chunk; the process's own peak memory is the run's;
- ``runner``    the plan (methods x budgets x lengths), the per-sample journal that an interrupted run
                resumes from, the device profile's settings and memory check;
- ``report``    summary JSON and the markdown table;
- ``plots``     PNGs: accuracy against budget, length and depth, and retained-unit heatmaps.
"""
from __future__ import annotations

METHODS = ("full", "locret", "locret-q", "locret-q-auto", "locret-pyramid", "locret-schedule", "random-heads", "lagkv",
           "sage", "snapkv", "snapkv-q-auto", "random", "streaming")
# scored by retaining heads (score pooling applies); locret-pyramid: the trained heads with PyramidKV's per-layer budgets;
# locret-schedule: with the per-layer budgets of --schedule FILE (e.g. from locret calibrate)
HEADS_METHODS = ("locret", "locret-q", "locret-q-auto", "locret-pyramid", "locret-schedule", "random-heads")
TRAINED_HEADS_METHODS = ("locret", "locret-q", "locret-q-auto", "locret-pyramid", "locret-schedule")
# Locret-Q: the task's question placed at the start and pinned ("locret-q"), or the question the auto rule finds in
# the user message (llama_locret_find_question, as `--locret-query auto` does; none found: plain Locret)
QUERY_METHODS = ("locret-q", "locret-q-auto", "snapkv-q-auto")
# the question the auto rule finds: with the trained Locret-Q heads, or with SnapKV (no training), whose observation
# window the pinned question then is
AUTO_QUERY_METHODS = ("locret-q-auto", "snapkv-q-auto")
# a heads method with per-layer budgets: METHOD@pyramid (PyramidKV's) or METHOD@schedule (the --schedule file's), e.g.
# locret-q-auto@pyramid; locret-pyramid and locret-schedule are locret@pyramid and locret@schedule under their old names
SCHEDULE_VARIANTS = ("pyramid", "schedule")
SCHEDULABLE_METHODS = ("locret", "locret-q", "locret-q-auto", "random-heads")


def split_method(name: str) -> tuple[str, str]:
    """(base method, schedule variant or "") of a --methods entry; ValueError for a variant that does not exist or a
    method it does not apply to."""
    base, at, variant = name.partition("@")
    if not at:
        return name, ""
    if base not in SCHEDULABLE_METHODS or variant not in SCHEDULE_VARIANTS:
        raise ValueError(f"{name}: a budget schedule variant is METHOD@{'|'.join(SCHEDULE_VARIANTS)} with METHOD one "
                         f"of {', '.join(SCHEDULABLE_METHODS)}")
    return base, variant


def uses_schedule_file(methods: list[str]) -> bool:
    """Whether a method of the list runs the per-layer budgets of --schedule FILE."""
    return any(m == "locret-schedule" or m.endswith("@schedule") for m in methods)
