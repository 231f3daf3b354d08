"""A load test's figures from its request records (drive.Request): what docs/results.md quotes per server.

Percentiles interpolate linearly between the closest ranks (numpy's default), so a p95 of 16 values lies between
the 15th and 16th smallest. A conversation is completed when every turn got an answer (right or wrong); conversations
per minute are completed conversations over the run's wall time (first arrival to the last answer) in minutes.
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0 <= q <= 100) of `values`, linear between closest ranks; None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"a percentile is between 0 and 100, got {q}")
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _spread(values: Iterable[float | None]) -> dict:
    xs = [v for v in values if v is not None]
    p50, p95 = percentile(xs, 50), percentile(xs, 95)
    return {"n": len(xs), "p50": None if p50 is None else round(p50, 4), "p95": None if p95 is None else round(p95, 4)}


def summarize(records: Sequence[dict], n_users: int, turns: int, wall_s: float) -> dict:
    """The run's figures from its request records (Request.as_dict) for `n_users` users of `turns` turns each."""
    ok = [r for r in records if r["error"] is None]
    by_user: dict[int, list[dict]] = {}
    for r in ok:
        by_user.setdefault(r["user"], []).append(r)
    completed = [u for u, rs in by_user.items() if len(rs) == turns]
    first = [r["score"] for r in ok if r["turn"] == 0]
    every = [r["score"] for r in ok]
    errors: dict[str, int] = {}
    for r in records:
        if r["error"] is not None:
            kind = r["error"].split(":")[0]
            errors[kind] = errors.get(kind, 0) + 1
    return {
        "users": n_users, "turns": turns, "wall_s": round(wall_s, 2),
        "requests": len(records), "requests_failed": len(records) - len(ok), "errors": errors,
        "conversations_completed": len(completed),
        "conversations_per_min": round(len(completed) / (wall_s / 60), 3) if wall_s > 0 else None,
        "ttft_s": _spread(r["ttft_s"] for r in ok),
        "e2e_s": _spread(r["e2e_s"] for r in ok),
        "decode_tok_s": _spread(r["decode_tok_s"] for r in ok),
        # right answers out of every user's first question (a refused or failed one counts as wrong), and out of
        # every turn asked of the script (n_users * turns)
        "first_turn_right": sum(first), "first_turn_asked": n_users,
        "turns_right": sum(every), "turns_asked": n_users * turns,
        "accuracy": round(sum(every) / (n_users * turns), 4),
    }
