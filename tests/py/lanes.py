"""Which tests run in which lane of scripts/test.sh, and in which order the parallel workers take the files.

  fast  `test.sh --fast`: the files a change runs first, a few minutes on 2 cores with ctest: the rule book,
        refusals, parsers, the converter, the planner, the patch series, and the engine's mechanics on short prompts
        against the numpy model. A test added to one of these files must be as quick as its neighbours.
  long  `test.sh --long`: end-to-end runs of the evaluation and benchmark scripts and of long server loads, a minute
        or more each, whose parts the other lanes test on their own (each entry says where). Not run by .ci/run.
  ci    `test.sh` (the README's test command, .ci/run): every test but the long lane.

`python tests/py/lanes.py JUNIT.xml` prints each lane's test count and seconds from a run's junit report
(every `scripts/test.sh` run leaves one: `build/pytest-LANE.xml`), and each file's seconds: the figures below come from it.
"""
from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

# Seconds per file in the ci lane (setup + call + teardown of its tests, summed: one worker's time), from the junit
# report of a fresh-clone `.ci/run` on the 2-core CI machine, two workers, 2026-12-07 at 2096f33 (2,361 s of worker
# time, 1,190 s of pytest). The workers take the files in this order, the longest first, so that the run does not end
# with one worker on a long file while the other waits.
SECONDS_PER_FILE: dict[str, float] = {
    "test_docs.py": 265, "test_eval_runner.py": 174, "test_eviction.py": 133, "test_sequences.py": 121,
    "test_iswa.py": 106, "test_schedule.py": 105, "test_kept_positions.py": 103, "test_sage.py": 78,
    "test_inspect.py": 78, "test_transactions.py": 78, "test_auto_query.py": 73, "test_locret_q.py": 69,
    "test_api_long_inputs.py": 56, "test_in_place_positions.py": 50, "test_devices_planner.py": 50,
    "test_ruler.py": 48, "test_trainer.py": 47, "test_openai_client.py": 46, "test_speculative.py": 45,
    "test_lagkv.py": 43, "test_snapkv.py": 42, "test_rpc.py": 38, "test_cis_parity.py": 36, "test_loadtest.py": 30,
    "test_passkey.py": 30, "test_heads_stack.py": 29, "test_heads_runtime.py": 28, "test_compaction_stack.py": 23,
    "test_policies.py": 23, "test_state_files.py": 21, "test_shapes.py": 19, "test_hf_gguf.py": 19,
    "test_convert.py": 19, "test_models.py": 19, "test_openai_chats.py": 18, "test_web_ui.py": 18,
    "test_sage_reference.py": 16, "test_gpu_scripts.py": 16, "test_soak.py": 15, "test_plan_documents.py": 14,
    "test_standins.py": 12, "test_haystacks.py": 12, "test_cli.py": 12, "test_budget_mib.py": 11,
    "test_wheel.py": 11, "test_calibrate.py": 10, "test_llama_tree.py": 8, "test_realtext.py": 7,
    "test_tool_output.py": 5, "test_refusals_at_creation.py": 4, "test_policy_settings.py": 4,
    "test_llama_cli.py": 4, "test_rule_book.py": 3, "test_real_needles.py": 3, "test_slots_memory.py": 3,
    "test_ruler_pool.py": 2, "test_needle_ranks.py": 2, "test_lanes.py": 1, "test_python_library.py": 1,
    "test_fuzz_checkpoints.py": 1, "test_build_config.py": 1, "test_cachelock.py": 1, "test_eval_tasks.py": 1,
    "test_threads.py": 1, "test_server_faults.py": 0, "test_code_shape.py": 0, "test_main_job.py": 0,
    "test_policy_traits.py": 0, "test_fuzz_regressions.py": 0, "test_free_port.py": 0,
}

# 122 s of worker time in the run above: with ctest, about 2 minutes on the two cores
FAST_FILES: set[str] = {
    "test_rule_book.py", "test_refusals_at_creation.py", "test_build_config.py", "test_llama_tree.py",
    "test_convert.py", "test_eval_tasks.py", "test_haystacks.py", "test_fuzz_checkpoints.py",
    "test_fuzz_regressions.py", "test_python_library.py", "test_tool_output.py", "test_main_job.py",
    "test_llama_cli.py", "test_slots_memory.py", "test_cli.py", "test_budget_mib.py", "test_calibrate.py",
    "test_real_needles.py", "test_lanes.py", "test_plan_documents.py", "test_code_shape.py",
    "test_policy_settings.py", "test_policy_traits.py", "test_ruler_pool.py", "test_threads.py", "test_free_port.py",
    "test_cachelock.py",
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
    "test_kvpress_side.py::test_pinned_leading_tokens_are_kept_by_every_selection":
        "kvpress's selections given Locret-Q's pin; the split it pins at is in the ci lane (test_ruler.py); " + _KVPRESS,
    "test_eval_runner.py::test_sigterm_stops_kvpress_an_evaluation_started":
        "63-78 s, the same command signalled in llama-server, then resumed through llama-server's full run of a "
        "4096-token prompt and signalled in kvpress; SIGTERM stopping llama-server is in the ci lane "
        "(test_sigterm_stops_the_servers_an_evaluation_started); " + _KVPRESS,
    "test_gpu_scripts.py::test_bench_eviction_decode_split": "269 s; " + _BENCH,
    "test_gpu_scripts.py::test_gpu_train_trains_each_run":
        "about 2 minutes a model, two trainer runs of two steps end to end; the trainer's own steps, labels and "
        "refusals are in the ci lane (test_trainer.py), gpu_train.sh's packs and refusals too (test_gpu_scripts.py)",
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

# file::test[parameters] -> why the ci lane needs not run that one case of a parametrized test: each combines
# settings that the test's other cases (still in the ci lane) check one by one, so a case moved here only leaves its
# combination to the long lane. Moved 2026-12-03 (ci lane 24.0 min at f5e51c4, over the 20-minute target); seconds
# from that day's run beside other work.
_SAME_TEST = "the test's other cases check the same in the ci lane"
LONG_CASES: dict[str, str] = {
    "test_gpu_scripts.py::test_gpu_train_packs_each_model_in_parts_that_one_call_carries[gemma3-270m-5-False]":
        "11 s, 267 MB packed and joined; the same logic in more than one part by [smollm2-135m-2-True], "
        + _SAME_TEST,
    "test_sequences.py::test_every_sequence_evicts_as_algorithm_1_on_its_own[4-1-None]":
        "32 s; compactions in turns are checked by [4-2-inplace] and [4-3-keep:200], " + _SAME_TEST,
    "test_schedule.py::test_groups_of_caches_give_the_logits_of_one_masked_cache[host-None-None]":
        "21 s; the host's selection by [host-keep:300-None], " + _SAME_TEST,
    "test_schedule.py::test_groups_of_caches_give_the_logits_of_one_masked_cache[graph-inplace-None]":
        "22 s; in-place positions with a schedule by test_in_place_positions.py and test_schedule.py's "
        "test_kept_positions_follow_the_schedule",
    "test_ruler.py::test_our_run_of_the_generator_gives_the_packages_own_samples[niah_single_1]":
        "57 s (the essays' set-up); [vt] checks the same agreement with the package, the essay haystack by "
        "test_essay_haystacks_start_at_a_random_word_per_sample",
    "test_kept_positions.py::test_tokens_over_evictions_stay_as_close_to_llama_cpp_as_llama_cpp_to_itself[keep:200]":
        "22 s; [keep] and [compact] check the same bound, keep:N's own compaction by test_compaction_stack.py",
    "test_kept_positions.py::test_tokens_over_evictions_stay_as_close_to_llama_cpp_as_llama_cpp_to_itself[inplace]":
        "22 s; in-place positions' tokens by test_in_place_positions.py, " + _SAME_TEST,
    "test_rpc.py::test_rpc_runs_evict_as_the_local_cpu_run_does[host]":
        "38 s; [default] runs the same eviction over RPC, and the host's selection equals the graph's in "
        "test_schedule.py's test_heads_kept_sets_follow_the_schedule_selected_on_the_device_or_the_host",
    "test_schedule.py::test_heads_kept_sets_follow_the_schedule_selected_on_the_device_or_the_host[110-host]":
        "14 s; [400-host] and [110-graph] check the host and the smaller budget, " + _SAME_TEST,
    "test_schedule.py::test_masked_cells_are_not_attended[None-masked]":
        "14 s; [keep-masked] and [None-grouped], " + _SAME_TEST,
    "test_eviction.py::test_retained_sets_match_algorithm_1_after_every_chunk[graph-24-0-1]":
        "10 s; stabilizers on the graph by [graph-24-5-4], " + _SAME_TEST,
    "test_compaction_stack.py::test_stacked_compaction_keeps_the_cache_of_the_per_layer_one[compact-pyramid]":
        "13 s; [compact-pyramid-staged] compacts the same pyramid, " + _SAME_TEST,
    "test_iswa.py::test_gemma_full_attention_layers_evict_as_algorithm_1_and_the_window_follows[keep:800]":
        "14 s; [None] and [inplace], and keep:N's compaction by test_compaction_stack.py",
    # moved 2026-12-06 (ci lane 1,377 s of pytest, over the 1,200-s target); seconds from that day's ci run
    "test_eviction.py::test_no_graph_outgrows_the_buffers_reserved_at_creation[graph-0-None]":
        "7 s; the graph's reservation without pooling by [graph-0-keep:384], compact positions by [host-0-None] and "
        "[graph-9-None], " + _SAME_TEST,
    "test_schedule.py::test_kept_sets_and_counts_follow_the_schedule[file-520]":
        "8 s; a schedule file by [file-110], a prompt taking every layer to its budget by [pyramid-520], " + _SAME_TEST,
    "test_schedule.py::test_heads_kept_sets_follow_the_schedule_selected_on_the_device_or_the_host[400-graph]":
        "7 s; the longer prompt by [400-host], the graph's selection by [110-graph], " + _SAME_TEST,
    "test_schedule.py::test_groups_of_caches_give_the_logits_of_one_masked_cache[graph-None-None]":
        "12 s; the graph's selection with compact positions by [graph-None-q8_0 fa], an F16 cache by "
        "[host-keep:300-None], " + _SAME_TEST,
    # moved 2026-12-07 (ci lane 1,257 s of pytest at 88e54b2, over the 1,200-s target); seconds from that run
    "test_models.py::test_header_walk_agrees_with_gguf_py[gemma3-270m]":
        "14 s; the walk by [smollm2-135m], Gemma's file read through it by "
        "test_chunked_model_reassembles_when_the_cached_file_is_corrupt (check_gguf), " + _SAME_TEST,
    "test_compaction_stack.py::test_stacked_compaction_keeps_the_cache_of_the_per_layer_one[keep]":
        "8 s; kept positions' rows copied as words by [keep-q8_0], F16 rows' bytes by test_kept_positions.py's "
        "test_rows_that_only_move_keep_their_bytes (its f16 case)",
    "test_snapkv.py::test_snapkv_scores_and_kept_sets_match_numpy[host-0-32]":
        "7 s; the host's selection by [host-5-16], unpooled scores on the host by test_eviction.py's "
        "test_retained_sets_match_algorithm_1_after_every_chunk, " + _SAME_TEST,
    "test_lagkv.py::test_lagkv_scores_and_retained_sets_match_numpy[host-0-False]":
        "7 s; LagKV's scores by [graph-0-True] and [graph-40-False]; the host's selection from scores, which every "
        "policy shares, by test_eviction.py's and test_snapkv.py's host cases",
    "test_eviction.py::test_retained_sets_match_algorithm_1_after_every_chunk[host-0-0-1]":
        "7 s; the host's selection by [host-24-0-4] and [host-0-7-1], " + _SAME_TEST,
    "test_kept_positions.py::test_retained_sets_and_positions_match_the_model_after_every_chunk[host-0-0-None]":
        "7 s; the host's selection with kept positions by [host-24-7-200], " + _SAME_TEST,
    "test_schedule.py::test_masked_cells_are_not_attended[keep-grouped]":
        "7 s; kept positions by [keep-masked], grouped caches by [None-grouped], " + _SAME_TEST,
    "test_schedule.py::test_a_pinned_query_pooling_and_kept_positions_with_a_schedule[host]":
        "9 s; the same run with the graph's selection by [graph], the host's selection with a schedule by "
        "test_heads_kept_sets_follow_the_schedule_selected_on_the_device_or_the_host (its 400-host case)",
}


def lanes_of(nodeid: str) -> list[str]:
    """The markers a test carries: 'fast', 'long', or none (the ci lane only)."""
    path, _, name = nodeid.partition("::")
    file = Path(path).name
    key = f"{file}::{name.split('[')[0]}"
    if key in LONG_TESTS or f"{file}::{name}" in LONG_CASES or file in LONG_FILES:
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
