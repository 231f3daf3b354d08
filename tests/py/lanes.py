"""Which tests run in which lane of scripts/test.sh, and in which order the parallel workers take the files.

  fast  `test.sh --fast`: the files a change runs first, a few minutes on 2 cores with ctest: the rule book,
        refusals, parsers, the converter, the planner, the patch series, and the engine's mechanics on short prompts
        against the numpy model. A test added to one of these files must be as quick as its neighbours.
  long  `test.sh --long`: end-to-end runs of the evaluation and benchmark scripts and of long server loads, a minute
        or more each, whose parts the other lanes test on their own (each entry says where). Not run by .ci/run.
  ci    `test.sh` (the README's test command, .ci/run): every test but the long lane.

`python tests/py/lanes.py JUNIT.xml` prints each lane's test count and seconds from a run's junit report
(`bash scripts/test.sh --all --junitxml=JUNIT.xml`), and each file's seconds: the figures below come from it.
"""
from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

# Seconds per file in the ci lane (setup + call + teardown of its tests but the long ones, summed: one worker's time),
# from `bash scripts/test.sh --all --junitxml=...` on the 2-core CI machine, two workers, 2026-12-02 at 377be23 (all
# lanes: 7,892 s of worker time, 3,974 s of pytest). The workers take the files in this order, the longest first, so
# that the run does not end with one worker on a long file while the other waits; files under a second follow.
SECONDS_PER_FILE: dict[str, float] = {
    "test_docs.py": 752, "test_schedule.py": 487, "test_eviction.py": 487, "test_eval_runner.py": 474,
    "test_iswa.py": 368, "test_kept_positions.py": 356, "test_sequences.py": 341, "test_locret_q.py": 244,
    "test_sage.py": 217, "test_transactions.py": 201, "test_ruler.py": 184, "test_api_long_inputs.py": 168,
    "test_lagkv.py": 165, "test_in_place_positions.py": 140, "test_inspect.py": 129, "test_rpc.py": 127,
    "test_auto_query.py": 125, "test_devices_planner.py": 106, "test_speculative.py": 104, "test_trainer.py": 100,
    "test_compaction_stack.py": 97, "test_openai_client.py": 96, "test_passkey.py": 95, "test_snapkv.py": 89,
    "test_cis_parity.py": 84, "test_models.py": 82, "test_heads_stack.py": 81, "test_policies.py": 80,
    "test_heads_runtime.py": 67, "test_sage_reference.py": 67, "test_shapes.py": 58, "test_state_files.py": 52,
    "test_openai_chats.py": 52, "test_convert.py": 38, "test_haystacks.py": 37, "test_soak.py": 36,
    "test_gpu_scripts.py": 35, "test_standins.py": 33, "test_cli.py": 26, "test_budget_mib.py": 23,
    "test_calibrate.py": 23, "test_wheel.py": 20, "test_realtext.py": 18, "test_llama_tree.py": 13,
    "test_real_needles.py": 13, "test_refusals_at_creation.py": 12, "test_rule_book.py": 9, "test_llama_cli.py": 6,
    "test_needle_ranks.py": 5, "test_loadtest.py": 60, "test_web_ui.py": 20, "test_plan_documents.py": 8, "test_slots_memory.py": 5, "test_fuzz_checkpoints.py": 4, "test_python_library.py": 2,
    "test_eval_tasks.py": 2, "test_ruler_pool.py": 4, "test_build_config.py": 1, "test_code_shape.py": 1,
}

# 216 s of worker time in the run above: with ctest, about 3 minutes on the two cores
FAST_FILES: set[str] = {
    "test_rule_book.py", "test_refusals_at_creation.py", "test_build_config.py", "test_llama_tree.py",
    "test_convert.py", "test_eval_tasks.py", "test_haystacks.py", "test_fuzz_checkpoints.py",
    "test_fuzz_regressions.py", "test_python_library.py", "test_tool_output.py", "test_main_job.py",
    "test_llama_cli.py", "test_slots_memory.py", "test_cli.py", "test_budget_mib.py", "test_calibrate.py",
    "test_real_needles.py", "test_lanes.py", "test_plan_documents.py", "test_code_shape.py",
    "test_policy_settings.py", "test_policy_traits.py", "test_ruler_pool.py",
}

_KVPRESS = ("kvpress's side runs in its own environment (.venv-kvpress) and is tested only in this lane; the ci lane "
            "tests the RULER prompts both sides read (test_ruler.py) and our scores against PyTorch (test_cis_parity.py)")
_BENCH = ("scripts/bench_eviction.py end to end, for its figures; the layouts it times are tested in the ci lane "
          "(test_in_place_positions.py, test_kept_positions.py, test_compaction_stack.py)")

# file -> where its parts are tested in the ci lane (every test of the file is in the long lane)
LONG_FILES: dict[str, str] = {
    "test_locret_press.py": "our heads as a kvpress press, in kvpress's environment; " + _KVPRESS,
}

# file::test -> where its parts are tested in the ci lane. Each took a minute or more (seconds from the run above).
LONG_TESTS: dict[str, str] = {
    "test_loadtest.py::test_side_by_side_in_the_same_memory":
        "scripts/loadtest_side_by_side.py end to end (three servers in turn, a few minutes); the load generator's "
        "figures against a stub and a real short load test against locret serve are in the ci lane "
        "(test_loadtest.py)",
    "test_kvpress_side.py::test_replaying_one_prefill_gives_each_presss_own_result": "293 s; " + _KVPRESS,
    "test_kvpress_side.py::test_the_side_by_side_feeds_kvpress_the_ids_the_server_reads": "262 s; " + _KVPRESS,
    "test_gpu_scripts.py::test_bench_eviction_decode_split": "269 s; " + _BENCH,
    "test_gpu_scripts.py::test_bench_eviction_measures_each_positions_layout": "66 s; " + _BENCH,
    "test_gpu_scripts.py::test_bench_eviction_decode_figures_span_one_eviction_cycle": "45 s; " + _BENCH,
    "test_server_faults.py::test_the_server_keeps_serving_under_load_and_faults_with_the_most_slots_that_fit":
        "108 s, the most slots that fit under load and faults; the ci lane tests slots with a budget "
        "(test_api_long_inputs.py, test_openai_client.py), failed steps rolled back (test_transactions.py) and too "
        "many slots refused (test_server_faults.py's other test)",
    "test_needle_ranks.py::test_the_report_matches_a_recomputation":
        "66 s, the script end to end; the rank shares are checked against a counting reference in the ci lane "
        "(test_rank_shares_match_a_counting_reference)",
    "test_soak.py::test_standin_soak_holds_memory_counts_and_state_size":
        "50 s of soak; the soak's stop, resume and report checks are in the ci lane (test_soak.py's other tests)",
}


def lanes_of(nodeid: str) -> list[str]:
    """The markers a test carries: 'fast', 'long', or none (the ci lane only)."""
    path, _, name = nodeid.partition("::")
    file = Path(path).name
    key = f"{file}::{name.split('[')[0]}"
    if key in LONG_TESTS or file in LONG_FILES:
        return ["long"]
    return ["fast"] if file in FAST_FILES else []


def file_order(file: str) -> float:
    """Sort key: the longest files first; files not measured yet after the measured ones."""
    return -SECONDS_PER_FILE.get(file, 0.0)


def report(junit: Path) -> str:
    """Per lane: tests and seconds (one worker's time; about half of it on two workers); then per file."""
    import xml.etree.ElementTree as ET

    per_lane: dict[str, list[float]] = defaultdict(list)
    per_file: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit).getroot().iter("testcase"):
        # classname "tests.py.test_docs", name "test_x[param]"
        file = case.get("classname", "").rsplit(".", 1)[-1] + ".py"
        seconds = float(case.get("time", 0))
        lanes = lanes_of(f"{file}::{case.get('name', '')}")
        per_lane["long" if "long" in lanes else "ci"].append(seconds)
        if "fast" in lanes:
            per_lane["fast"].append(seconds)
        per_file[file] += seconds
    lines = ["lane  tests  seconds (one worker)"]
    for lane in ("fast", "ci", "long"):
        lines.append(f"{lane:5} {len(per_lane[lane]):6d} {sum(per_lane[lane]):9.0f}")
    lines.append("")
    lines += [f"{s:8.1f}  {f}" for f, s in sorted(per_file.items(), key=lambda kv: -kv[1])]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/py/lanes.py JUNIT.xml")
    print(report(Path(sys.argv[1])))
