"""kvpress's presses on the evaluation's items: one run per length group, in kvpress's own environment.

The evaluation's items (token ids, where the question starts, where the input ends) go to
`python -m locret.peers.kvpress_side` in .venv-kvpress; every item comes back with the answers of every (press, ratio,
question setting), which become sample records like any method's: method `kvpress:PRESS` (question outside what is
compressed, kvpress's default), `kvpress:PRESS+q` (the question compressed with the context, query-aware) or
`kvpress:PRESS+copy` (Locret-Q auto's prompt: the question copied to the start and pinned, the question at the end
outside), the budget our engine is given at the same ratio (round((1 - ratio) x length)), the ratio itself, and the
ratio the press was run at (`press_ratio`: the one that keeps the budget's units of the item's context, so that both
hold the same KV memory).
"""
from __future__ import annotations

import json
import subprocess
import tempfile
import time
from pathlib import Path

from .items import Item
from .worker import RunSpec

SETTING_SUFFIX = {"outside": "", "compressed": "+q", "copied": "+copy"}


def method_name(press: str, setting: str) -> str:
    return f"kvpress:{press}{SETTING_SUFFIX[setting]}"


def budget_at(ratio: float, length: int) -> int:
    """The budget our engine gets at a compression ratio: the KV units a press keeps of a `length`-token context."""
    return max(1, round((1.0 - ratio) * length))


def execute(spec: RunSpec, todo: list[Item], on_sample, deadline: float | None, log_dir: Path, *, presses: list[str],
            ratios: list[float], settings: list[str], heads: str | None) -> dict | None:
    """Answer `todo` in one kvpress process; `on_sample` gets every record of an item at once (so that an
    interrupted run resumes on whole items). The run's end record, or None when the deadline stopped it."""
    from ..peers.environment import kvpress_python

    python = kvpress_python()
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{spec.labels['run'].replace('/', '_')}.log"
    with tempfile.TemporaryDirectory(prefix="kvpress-") as tmp:
        spec_path, items_path = Path(tmp) / "spec.json", Path(tmp) / "items.jsonl"
        spec_path.write_text(json.dumps({"model_path": spec.model_path, "presses": presses, "ratios": ratios,
                                         "settings": settings, "heads": heads, "threads": spec.threads}))
        items_path.write_text("".join(json.dumps(_side_item(it, ratios, "copied" in settings)) + "\n" for it in todo))
        by_id = {it.id: it for it in todo}
        with open(log_path, "w") as log:
            proc = subprocess.Popen([str(python), "-m", "locret.peers.kvpress_side", str(spec_path), str(items_path)],
                                    stdout=subprocess.PIPE, stderr=log, text=True, cwd=str(Path(__file__).parents[2]))
            try:
                for line in proc.stdout:
                    if not line.strip():
                        continue
                    result = json.loads(line)
                    on_sample([_record(spec, by_id[result["item"]], r) for r in result["records"]])
                    if deadline is not None and time.monotonic() > deadline:
                        return None
                if proc.wait() != 0:
                    tail = log_path.read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"{spec.labels['run']}: kvpress's process failed (exit {proc.returncode}); "
                                       f"its log ends:\n{tail}")
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    return {"peak_rss_bytes": None, "gpu_bytes": None, "kv_bytes": None, "via": "kvpress"}


def _side_item(item: Item, ratios: list[float], copied: bool) -> dict:
    """An item as kvpress_side reads it: its ids, cuts and our budget at each ratio; with the "copied" setting,
    Locret-Q auto's prompt and its cuts too."""
    out = {"id": item.id, "tokens": list(item.tokens), "question_at": item.extra["question_at"],
           "input_end": item.extra["input_end"], "max_new_tokens": item.max_new_tokens,
           "budgets": {str(r): budget_at(r, item.length) for r in ratios}}
    if copied:
        if item.extra.get("copied_question_at") is None:
            # RuntimeError: the runner reports it as the evaluation's error (EvalError), not as a crash
            raise RuntimeError(f"{item.id}: the 'copied' setting cannot cut Locret-Q auto's prompt: the library cannot "
                               "pin the copied question in it, or the copy changes how the prompt's end tokenizes "
                               "(items.py, _copied_question_split)")
        out.update(copied_tokens=list(item.auto_query_tokens or item.tokens),
                   copied_question_at=item.extra["copied_question_at"], copied_pinned=item.extra["copied_pinned"])
    return out


def _record(spec: RunSpec, item: Item, r: dict) -> dict:
    return dict(spec.labels, method=method_name(r["press"], r["setting"]), budget=budget_at(r["ratio"], item.length),
                compression_ratio=r["ratio"], press_ratio=r["press_ratio"], item=item.id, source=item.source,
                length=item.length, depth=item.depth,
                prompt_tokens=len(item.tokens), answer=r["answer"], answers=list(item.answers), new_tokens=None,
                prefill_s=None, decode_s=r["seconds"], prefill_tok_s=None, decode_tok_s=None, cells_used_max=None,
                n_cells=None, evictions=0, pinned=0, kv_bytes=None, kept_units=r["kept_units"],
                masked_units=r["masked_units"], context_tokens=r["context_tokens"], via="kvpress", extra=item.extra)
