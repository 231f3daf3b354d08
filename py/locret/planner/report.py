"""`locret plan`'s report: the plan as text (or JSON) and the command line's exit codes."""
from __future__ import annotations

import json
import sys

from ..devices import DeviceError
from ..gguf_header import ModelFileError
from .advice import Plan, plan, refusal
from .inputs import PlanError
from .memory import _fmt

EXIT_DOES_NOT_FIT = 3        # 1 is a bad input, 3 a valid plan that does not fit the device


# --- report ---------------------------------------------------------------------------------------

def format_plan(p: Plan) -> str:
    d, m, s = p.device, p.model, p.settings
    mem = d.memory
    lines = [f"device    {d.name}: {d.description}",
             f"          {mem.available_gib:.2f} GiB of {mem.total_gib:g} GiB available to the model "
             f"({mem.kind} memory, {mem.bandwidth_gbs:g} GB/s)",
             f"model     {m.path.name}: {m.arch}, {m.n_layer} layers, {m.n_params / 1e9:.3g}B parameters, "
             f"trained window {m.n_ctx_train} -> size class {s.size_class}",
             f"heads     {p.heads_path if p.heads_path else 'embedded in the model'}",
             f"settings  budget {s.budget}, chunk (ubatch) {s.ubatch}, stabilizers {s.stabilizers}, KV cache "
             f"{s.kv_type}, GPU layers {'all' if s.gpu_layers < 0 else s.gpu_layers}, context {s.context}"
             + (f" per slot, {s.slots} slots" if s.slots > 1 else ""),
             f"          from {d.name}'s {s.size_class} defaults"
             + (f"; given: {', '.join(s.overridden)}" if s.overridden else ""),
             f"llama.cpp {' '.join(s.llama_args(p.heads_path))}",
             "predicted peak memory:"]
    discrete = mem.kind == "discrete"
    if discrete:
        lines.append(f"  {'':18s} {'GPU':>11s} {'host RAM':>11s}")
    for part in p.parts:
        cols = (f"{_fmt(part.device_bytes):>11s} {_fmt(part.host_bytes):>11s}" if discrete
                else f"{_fmt(part.host_bytes):>11s}")
        lines.append(f"  {part.what:18s} {cols}   {part.how}")
    if p.measured is not None:
        lines.append(f"  (llama.cpp: KV cache {_fmt(p.measured.kv_bytes)} in {p.measured.n_cells} cells, model tensors "
                     f"{_fmt(p.measured.model_size)}, local tail {p.measured.local})")
    total = (f"{_fmt(p.total('device')):>11s} {_fmt(p.total('host')):>11s}" if discrete else f"{_fmt(p.total()):>11s}")
    lines.append(f"  {'total':18s} {total}")
    verdict = ("fits" if p.fits else "does NOT fit") if p.measured is not None or p.total() > p.limit else "not checked"
    lines.append(f"limit     {_fmt(p.limit)} ({'GPU memory' if discrete else 'memory'} available on {d.name}): "
                 f"{verdict} ({100.0 * p.total() / p.limit:.1f} % used)")
    lines += [f"note      {n}" for n in p.notes]
    return "\n".join(lines)


def run_cli(args) -> int:
    """`locret plan` (arguments from cli.py): print the plan; exit 0 if it fits, 3 if not, 1 on bad input."""
    try:
        p = plan(args.device, args.model, heads=args.heads, context=args.context, budget=args.budget,
                 ubatch=args.ubatch, stabilizers=args.stabilizers, kv_type=args.kv_type, gpu_layers=args.gpu_layers,
                 policy=getattr(args, "policy", None), schedule=getattr(args, "budget_schedule", None),
                 slots=getattr(args, "slots", None) or 1, budget_mib=getattr(args, "budget_mib", None),
                 doc_tokens=getattr(args, "doc_tokens", None), accuracy=getattr(args, "accuracy", None))
    except (DeviceError, PlanError, ModelFileError, RuntimeError) as e:
        print(f"locret: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(p.as_dict(), indent=1) if args.json else format_plan(p))
    if not p.fits:
        print(f"locret: error: {refusal(p)}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    return 0
