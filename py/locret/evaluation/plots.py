"""PNG figures of an evaluation: accuracy against budget, length and depth (one panel per task), and
retained-unit heatmaps: for chosen layers and every KV head, which logical positions of the prompt the
cache holds after each chunk (time runs down, prompt position runs right)."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np

HEATMAP_LAYERS = 6  # layers shown per heatmap figure, spread from first to last


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _panels(plt, n: int, title: str):
    cols = min(n, 3)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    fig.suptitle(title)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat)


def _label(method: str, budget) -> str:
    return method if budget is None else f"{method} b={budget}"


def accuracy_vs(rows: list[dict], key: str, out: Path) -> Path | None:
    """key "budget": x = budget, one line per evicting method, full attention as a dashed level;
    key "length": x = prompt length, one line per (method, budget)."""
    plt = _plt()
    # by budget: every task (full attention is a level); by length: tasks with lengths (not benchmark files)
    sources = sorted({r["source"] for r in rows if key == "budget" or r["length"] is not None})
    if not sources:
        return None
    fig, axes = _panels(plt, len(sources), f"accuracy vs {key}")
    for ax, source in zip(axes, sources):
        series: dict[str, dict] = defaultdict(lambda: defaultdict(list))
        full = []
        for r in rows:
            if r["source"] != source or r["accuracy"] is None:
                continue
            if key == "budget":
                if r["method"] == "full":
                    full.append(r["accuracy"])
                else:
                    series[r["method"]][r["budget"]].append(r["accuracy"])
            elif r["length"] is not None:
                series[_label(r["method"], r["budget"])][r["length"]].append(r["accuracy"])
        for name, points in sorted(series.items()):
            xs = sorted(points)
            ax.plot(xs, [np.mean(points[x]) for x in xs], marker="o", label=name)
        if full:
            ax.axhline(np.mean(full), linestyle="--", color="black", label="full attention")
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.05, 1.05)
        ax.set_title(source)
        ax.set_xlabel("budget b (units per layer and KV head)" if key == "budget" else "prompt tokens")
        ax.set_ylabel("score")
        ax.legend(fontsize=7)
    path = out / f"accuracy_vs_{key}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def accuracy_vs_depth(samples: list[dict], out: Path) -> Path | None:
    plt = _plt()
    with_depth = [s for s in samples if s.get("depth") is not None]
    sources = sorted({s["source"] for s in with_depth})
    if not sources:
        return None
    fig, axes = _panels(plt, len(sources), "accuracy vs needle depth (mean over lengths)")
    for ax, source in zip(axes, sources):
        series: dict[str, dict] = defaultdict(lambda: defaultdict(list))
        for s in with_depth:
            if s["source"] == source:
                series[_label(s["method"], s["budget"])][s["depth"]].append(s["score"])
        for name, points in sorted(series.items()):
            xs = sorted(points)
            ax.plot(xs, [np.mean(points[x]) for x in xs], marker="o", label=name)
        ax.set_ylim(-0.05, 1.05)
        ax.set_title(source)
        ax.set_xlabel("needle depth (share of the text before it)")
        ax.set_ylabel("score")
        ax.legend(fontsize=7)
    path = out / "accuracy_vs_depth.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def heatmap(npz: Path, out: Path, needles: list | None = None) -> Path:
    """retained [chunks, layers, kv heads, bins] -> a grid of panels (layers x heads)."""
    plt = _plt()
    data = np.load(npz)
    retained = data["retained"].astype(np.float32)
    n_chunks, n_layer, n_head, n_bins = retained.shape
    layers = sorted({int(round(x)) for x in np.linspace(0, n_layer - 1, min(HEATMAP_LAYERS, n_layer))})
    n_prompt = int(data["prompt_tokens"])
    fig, axes = plt.subplots(len(layers), n_head, figsize=(2.6 * n_head + 1, 1.9 * len(layers) + 0.8),
                             squeeze=False)
    fig.suptitle(f"retained units: {data['method']} on {data['item']} ({n_prompt} tokens, chunk {int(data['ubatch'])})",
                 fontsize=9)
    for row, il in enumerate(layers):
        for ih in range(n_head):
            ax = axes[row][ih]
            ax.imshow(retained[:, il, ih, :], aspect="auto", interpolation="nearest", vmin=0, vmax=1, cmap="viridis",
                      extent=(0, n_prompt, n_chunks, 0))
            for _, start, end in needles or []:  # outline only: the retention under the needle stays visible
                ax.axvline(start, color="red", lw=0.6, ls=":")
                ax.axvline(end, color="red", lw=0.6, ls=":")
            ax.set_title(f"layer {il} head {ih}", fontsize=7)
            ax.tick_params(labelsize=6)
            if ih == 0:
                ax.set_ylabel("chunk", fontsize=7)
            if row == len(layers) - 1:
                ax.set_xlabel("prompt position", fontsize=7)
    fig.tight_layout()
    path = out / (npz.stem + ".png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_all(out_dir: Path, rows: list[dict], samples: list[dict]) -> list[Path]:
    plots = out_dir / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    written = [accuracy_vs(rows, "budget", plots), accuracy_vs(rows, "length", plots), accuracy_vs_depth(samples, plots)]
    needles = {s["item"]: s.get("extra", {}).get("needles") for s in samples}
    for s in samples:
        if s.get("heatmap"):
            npz = out_dir / "heatmaps" / s["heatmap"]
            if npz.exists():
                written.append(heatmap(npz, plots, needles.get(s["item"])))
    return [p for p in written if p is not None]
