"""RULER's figures from an evaluation's summary rows: per task, the average over the tasks, and the kvpress side by
side (score against compression ratio, one line a method, kvpress's way of plotting).

Scores are RULER's: 0-100, a task's mean of the package's per-sample metric; the average is the mean over the tasks
(RULER's "Avg."), given only for a (method, budget, length) that has every task asked for.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from ..evaluation.items import RULER_PREFIX


def _task(source: str) -> str | None:
    return source[len(RULER_PREFIX):] if source.startswith(RULER_PREFIX) else None


def table(rows: list[dict], tasks: list[str]) -> list[dict]:
    """One entry per (method, budget, length): per-task scores (0-100), samples, and the average over `tasks`
    (None when a task is missing)."""
    groups: dict[tuple, dict] = defaultdict(lambda: {"scores": {}, "samples": 0, "kv_bytes": None, "ratio": None})
    for r in rows:
        task = _task(r["source"])
        if task is None or r["accuracy"] is None:
            continue
        g = groups[(r["method"], r["budget"], r["length"])]
        g["scores"][task] = round(100 * r["accuracy"], 2)
        g["samples"] += r["samples"]
        g["kv_bytes"] = r.get("kv_bytes") or g["kv_bytes"]
        g["ratio"] = r.get("compression_ratio", g["ratio"])
        g["seconds"] = r.get("seconds_per_sample")
    out = []
    for (method, budget, length), g in sorted(groups.items(), key=lambda kv: (kv[0][2] or 0, kv[0][0], kv[0][1] or 0)):
        complete = all(t in g["scores"] for t in tasks)
        out.append({"method": method, "budget": budget, "length": length, "ratio": g["ratio"], "scores": g["scores"],
                    "samples": g["samples"], "kv_bytes": g["kv_bytes"], "seconds_per_sample": g.get("seconds"),
                    "average": round(sum(g["scores"][t] for t in tasks) / len(tasks), 2) if complete else None})
    return out


def markdown(entries: list[dict], tasks: list[str]) -> str:
    short = {t: t.replace("niah_", "").replace("single_", "s").replace("multikey_", "mk").replace("multivalue", "mv")
             .replace("multiquery", "mq") for t in tasks}
    head = "| length | method | budget | ratio | n | avg | " + " | ".join(short[t] for t in tasks) + " | KV MiB | s/sample |"
    lines = [head, "|" + "---:|" * 2 + "---|" + "---:|" * (len(tasks) + 6)]
    lines[1] = "|---:|---|---:|---:|---:|---:|" + "---:|" * len(tasks) + "---:|---:|"
    for e in entries:
        kv = "-" if not e["kv_bytes"] else f"{e['kv_bytes'] / (1 << 20):.1f}"
        sec = "-" if e["seconds_per_sample"] is None else f"{e['seconds_per_sample']:.1f}"
        avg = "-" if e["average"] is None else f"{e['average']:.1f}"
        lines.append(f"| {e['length']} | {e['method']} | {e['budget'] or '-'} | "
                     f"{'-' if e['ratio'] is None else e['ratio']} | {e['samples']} | {avg} | " +
                     " | ".join("-" if t not in e["scores"] else f"{e['scores'][t]:.0f}" for t in tasks) +
                     f" | {kv} | {sec} |")
    lines.append("\nScores 0-100 (RULER's metrics: string_match_all, qa string_match_part); avg over the tasks "
                 "listed; n: samples over all tasks.")
    return "\n".join(lines)


def side_by_side(entries: list[dict]) -> str:
    """Average against compression ratio: a row per method, a column per ratio, per length; full attention's
    average as the ceiling."""
    out = []
    for length in sorted({e["length"] for e in entries}):
        at = [e for e in entries if e["length"] == length and e["average"] is not None]
        ratios = sorted({e["ratio"] for e in at if e["ratio"] is not None})
        if not ratios:
            continue
        full = next((e["average"] for e in at if e["method"] == "full"), None)
        out.append(f"\n**{length} tokens** (full attention: {'-' if full is None else f'{full:.1f}'})\n")
        out.append("| method | " + " | ".join(f"{r}" for r in ratios) + " |")
        out.append("|---|" + "---:|" * len(ratios))
        for method in sorted({e["method"] for e in at if e["ratio"] is not None}):
            cells = {e["ratio"]: e["average"] for e in at if e["method"] == method}
            out.append(f"| {method} | " + " | ".join("-" if r not in cells else f"{cells[r]:.1f}" for r in ratios) + " |")
    return "\n".join(out)


def tables(entries: list[dict], tasks: list[str]) -> str:
    """The per-task table, followed by the average against compression ratio where the entries have ratios: what
    `locret eval` prints for a RULER run and `scripts/ruler_table.py` for pooled folders."""
    text = markdown(entries, tasks)
    side = side_by_side(entries)
    if side:
        text += "\n\nAverage against compression ratio (budget = (1 - ratio) x length):\n" + side
    return text


def plot(entries: list[dict], path: Path) -> list[Path]:
    """score against compression ratio, one line a method, a figure per length, two panels: the question outside
    what is compressed (kvpress's default; ours without a pinned question) and query-aware (the question compressed
    with the context; ours with Locret-Q)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for length in sorted({e["length"] for e in entries}):
        at = [e for e in entries if e["length"] == length and e["average"] is not None]
        if not any(e["ratio"] is not None for e in at):
            continue
        fig, axes = plt.subplots(1, 2, figsize=(12, 6), sharey=True)
        for ax, aware in zip(axes, (False, True)):
            for method in sorted({e["method"] for e in at if e["ratio"] is not None}):
                if query_aware(method) != aware:
                    continue
                pts = sorted((e["ratio"], e["average"]) for e in at if e["method"] == method)
                ours = not method.startswith("kvpress:")
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", lw=2.5 if ours else 1.2,
                        ls="-" if ours else "--", label=method)
            full = next((e["average"] for e in at if e["method"] == "full"), None)
            if full is not None:
                ax.axhline(full, color="black", lw=1, ls=":", label="full attention")
            ax.set_title("question compressed with the context (query-aware)" if aware else
                         "question outside what is compressed")
            ax.set_xlabel("compression ratio")
            ax.grid(alpha=0.3)
            # below the plot: inside it, the legend hid the curves it names
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3)
        axes[0].set_ylabel("RULER average (0-100)")
        fig.suptitle(f"RULER at {length} tokens")
        fig.tight_layout()
        out = path.with_name(f"{path.stem}-{length}{path.suffix}")
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(out)
    return written


def query_aware(method: str) -> bool:
    """Whether a method sees the question when it compresses: kvpress's rows of a question setting other than
    outside (`+q`, `+copy`: kvpress_backend.SETTING_SUFFIX), our Locret-Q and SnapKV-Q rows."""
    from ..evaluation.kvpress_backend import SETTING_SUFFIX

    return method.endswith(tuple(x for x in SETTING_SUFFIX.values() if x)) or "-q" in method.split("@")[0]
