"""`locret serve`: llama.cpp's OpenAI-compatible llama-server (the patched build) with Locret's flags, so
long-context requests are answered in a cache of budget + chunk cells.

The flags are llama.cpp's own (--locret-heads, --locret-budget, --locret-stabilizers, --locret-local,
--locret-policy, -ub, -c); this module only resolves them: the model by name or path, the shipped heads
for a registered model, and a device profile's settings. Anything after `--` goes to llama-server as is.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

from . import devices, eviction, models, planner
from ._library import LibraryError, tool_path

DEFAULT_BUDGET = 2048
DEFAULT_UBATCH = 512
DEFAULT_CONTEXT = "128k"


_PORTS_GIVEN: set[int] = set()


def free_port() -> int:
    """A loopback port free now, for a server a script or test starts next. Never the same port twice in one
    process: the kernel may hand a port it just released to the next bind(0), and a caller that takes two ports
    before starting either server (an HTTP server and its RPC servers) would then give both the same one."""
    import socket

    for _ in range(1000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _PORTS_GIVEN:
            _PORTS_GIVEN.add(port)
            return port
    # a bound, not a loop that could spin once a process has taken most of the kernel's ephemeral range
    raise RuntimeError(f"no loopback port this process has not handed out already ({len(_PORTS_GIVEN)} given)")


def wait_healthy(url: str, server, log_path, startup_s: float) -> None:
    """Wait until the server process `server` (a subprocess.Popen writing its log to `log_path`) answers GET
    /health with 200; RuntimeError with the log's tail if it exits first or is not healthy in `startup_s`."""
    import time
    import urllib.request
    from pathlib import Path

    deadline = time.monotonic() + startup_s
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
        tail = lambda: Path(log_path).read_text(errors="replace")[-3000:]  # noqa: E731
        if server.poll() is not None:
            raise RuntimeError("the server exited: " + tail())
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server was not healthy in {startup_s:.0f} s: " + tail())


def stop(server, timeout_s: float = 30) -> None:
    """Stop a server process (a subprocess.Popen): SIGTERM, then SIGKILL if it has not exited in `timeout_s`."""
    import subprocess

    server.terminate()
    try:
        server.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


_METRIC = re.compile(r"^llamacpp:(\w+)(?:\{[^}]*\})? ([-+0-9.eE]+)$", re.M)


def parse_metrics(text: str) -> dict[str, float]:
    """llama-server's /metrics (Prometheus text) as {name without 'llamacpp:': value}; a labelled series is summed
    over its labels (locret_cells_used{slot="i"}: the cells of every slot)."""
    out: dict[str, float] = {}
    for name, value in _METRIC.findall(text):
        out[name] = out.get(name, 0.0) + float(value)
    return out


def process_memory(pid: int, field: str = "VmRSS") -> int | None:
    """A server process's resident memory (VmRSS) or its peak (VmHWM) in bytes, from /proc; None when it cannot be
    read (the process is gone, or runs on another machine)."""
    from pathlib import Path

    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def command(args: argparse.Namespace) -> list[str]:
    """The llama-server command line; PlanError / DeviceError / ModelError / LibraryError on bad input."""
    server = tool_path("llama-server")
    model_path = models.resolve(args.model)
    facts = planner.read_model(model_path)
    slots = planner.parse_slots(getattr(args, "slots", None))
    if args.device is not None:
        if slots == "max":
            # the planner measures llama.cpp's buffers for the slot count it settles on
            p = planner.plan(args.device, str(model_path), heads=args.heads, context=args.context, budget=args.budget,
                             ubatch=args.ubatch, stabilizers=args.stabilizers, kv_type=args.kv_type,
                             gpu_layers=args.gpu_layers, policy=args.policy, slots="max")
            if not p.fits:
                raise planner.PlanError(planner.refusal(p))
            s = p.settings
        else:
            s = planner.resolve_settings(devices.load(args.device), facts, context=args.context, budget=args.budget,
                                         ubatch=args.ubatch, stabilizers=args.stabilizers, kv_type=args.kv_type,
                                         gpu_layers=args.gpu_layers, slots=slots)
        budget, ubatch, stabilizers, kv_type, gpu_layers, context, slots = (
            s.budget, s.ubatch, s.stabilizers, s.kv_type, s.gpu_layers, s.context, s.slots)
    else:
        if slots == "max":
            raise planner.PlanError("--slots max needs --device: the most slots that fit depends on its memory")
        if not 1 <= slots <= planner.MAX_SLOTS:
            raise planner.PlanError(f"slots must be between 1 and {planner.MAX_SLOTS}, got {slots}")
        budget = DEFAULT_BUDGET if args.budget is None else args.budget
        ubatch = DEFAULT_UBATCH if args.ubatch is None else args.ubatch
        stabilizers, kv_type = args.stabilizers, args.kv_type
        gpu_layers = planner.parse_gpu_layers(args.gpu_layers)
        context = planner.parse_context(args.context or DEFAULT_CONTEXT)
    # -c is split between the slots (one KV stream each): every slot gets the whole logical context
    cmd = [str(server), "-m", str(model_path), "-c", str(context * slots), "-ub", str(ubatch),
           "-b", str(max(ubatch, 2048)), "-np", str(slots), "--host", args.host, "--port", str(args.port),
           "--locret-budget", str(budget), "--locret-policy", args.policy]
    if eviction.policy_traits(args.policy).needs_heads:
        heads, _ = planner.resolve_heads(args.model, model_path, facts, args.heads)
        if heads is not None:
            cmd += ["--locret-heads", str(heads)]
    if stabilizers is not None:
        cmd += ["--locret-stabilizers", str(stabilizers)]
    if args.local is not None:
        cmd += ["--locret-local", str(args.local)]
    if kv_type:
        cmd += ["-ctk", kv_type, "-ctv", kv_type]
    if gpu_layers is not None:
        cmd += ["-ngl", "all" if gpu_layers < 0 else str(gpu_layers)]
    if args.threads is not None:
        cmd += ["-t", str(args.threads)]
    extra = list(args.server_args or [])
    return cmd + (extra[1:] if extra[:1] == ["--"] else extra)


def run_cli(args: argparse.Namespace) -> int:
    cmd = command(args)
    print(" ".join(cmd), file=sys.stderr if not args.print_command else sys.stdout, flush=True)
    if args.print_command:
        return 0
    # become llama-server (exec, not a child): a signal that stops `locret serve` (a service manager, a test, kill)
    # then stops the server itself instead of leaving it running, orphaned, on its port
    try:
        os.execv(cmd[0], cmd)
    except OSError as e:
        raise RuntimeError(f"cannot start {cmd[0]}: {e}") from None


def _policy(spec: str) -> str:
    """--policy as the library reads it (eviction.parse_policy): the spec itself, or argparse's error with the
    library's reason (an unknown name naming the valid ones, a setting the policy does not have, ...)."""
    try:
        eviction.parse_policy(spec)
    except eviction.HeadsError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return spec


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=models.DEFAULT_MODEL, help=f"model name or .gguf path (default {models.DEFAULT_MODEL})")
    p.add_argument("--heads", help="retaining heads .gguf (default: embedded in the model, or shipped in heads/)")
    p.add_argument("--policy", default="heads", type=_policy,
                   help="what scores the KV units, NAME or NAME:key=value,... (default heads; the policies and their "
                   "settings: docs/policies.md)")
    p.add_argument("--budget", type=int, help=f"Locret budget b (default {DEFAULT_BUDGET}, or the device profile's)")
    p.add_argument("--ubatch", type=int, help=f"chunk B (default {DEFAULT_UBATCH}, or the device profile's)")
    p.add_argument("--stabilizers", type=int, help="stabilizers n_s (default: the heads file's recommendation)")
    p.add_argument("--local", type=int, help="local tail length (default: the heads file's recommendation)")
    p.add_argument("--context", help=f"logical context in tokens: 131072, 128k, 1m (default {DEFAULT_CONTEXT}); "
                   "memory does not depend on it")
    p.add_argument("--kv-type", help="KV cache type for K and V: f16, q8_0, ...")
    p.add_argument("--gpu-layers", help="layers on the GPU: a number or 'all'")
    p.add_argument("--device", help="device profile (devices/): its settings for the model")
    p.add_argument("--slots", help="requests served at once (llama-server -np), each in its own cache of budget + "
                   "chunk cells; 'max' (with --device): the most that fit the device's memory (default 1)")
    p.add_argument("--threads", type=int, help="CPU threads (default: llama-server's)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--print-command", action="store_true", help="print the llama-server command and exit")
    p.add_argument("server_args", nargs=argparse.REMAINDER, help="after --: more llama-server options, as they are")


__all__ = ["command", "run_cli", "add_arguments", "LibraryError"]
