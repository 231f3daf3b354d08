"""One evaluation run through llama-server, as people run it: the method's command line, the OpenAI API, the
package's own client (RULER's `GenericOAIURLClient`, which works offline against any OpenAI-compatible URL).

Per run: llama-server starts with the method's flags (the same settings the in-process worker gives locret.Llama,
as tool options), answers every item, and stops. Per item:

- the token ids are checked: the server's /apply-template and /tokenize must give the item's tokens, the ids kvpress
  is fed in the side by side (a mismatch is recorded, `tokens_match`, and counted in the summary; Locret-Q auto's
  server rearranges the prompt, so its requests are not compared);
- the request goes through the package's client (chat or completion endpoint), timed from outside;
- the server's /metrics before and after give the request's prefill and decode seconds and tokens, and its KV bytes
  (`locret_kv_bytes`); /slots its Locret figures (cells used, evictions, pinned tokens);
- the log says what Locret-Q auto pinned (`query_found`).

The run's end record has the server's peak RSS (VmHWM of its process) and KV bytes, like the worker's.
"""
from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.request
from pathlib import Path

from .. import serve
from .._library import tool_path
from . import AUTO_QUERY_METHODS, HEADS_METHODS
from .items import Item
from .worker import RunSpec, locret_settings

STARTUP_S = 300
REQUEST_TIMEOUT_S = 3600
# the question may span lines: up to the quote that ends the log line (the next line starts with a timestamp)
_PINNED = re.compile(r'Locret-Q \(auto\): the request\'s closing question goes to its start and is pinned: "(.*?)"\n'
                     r'(?=\d+\.\d+\.\d+\.\d+ |\Z)', re.S)


def command(spec: RunSpec, port: int) -> list[str]:
    """llama-server's command line for a run: one slot, the run's context, chunk and threads, and its Locret
    settings as the tools' --locret-* options (a locret.Llama keyword locret_x is the option --locret-x)."""
    cmd = [str(tool_path("llama-server")), "-m", spec.model_path, "-c", str(spec.n_ctx), "-ub", str(spec.ubatch),
           "-b", str(max(spec.ubatch, 2048)), "-np", "1", "-t", str(spec.threads), "-tb", str(spec.threads),
           "-fa", "on", "--host", "127.0.0.1", "--port", str(port), "--metrics", "--no-webui",
           "-ngl", str(spec.gpu_layers if spec.gpu_layers >= 0 else 999)]
    if spec.kv_type:
        cmd += ["-ctk", spec.kv_type, "-ctv", spec.kv_type]
    if spec.method == "full":
        return cmd
    for key, value in locret_settings(spec).items():
        if value is not None:
            cmd += ["--" + key.replace("_", "-"), str(value)]
    if spec.method in AUTO_QUERY_METHODS:
        cmd += ["--locret-query", "auto"]   # the question at the end of each request, found by the library's rule
    elif spec.method in HEADS_METHODS:
        cmd += ["--locret-query", "off"]    # not what a Locret-Q heads file recommends: the run asks for none
    return cmd


class Server:
    """A llama-server process for one run, its log in `log_path`."""

    def __init__(self, cmd: list[str], log_path: Path, port: int):
        self.url, self.log_path = f"http://127.0.0.1:{port}", log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            serve.wait_healthy(self.url, self.proc, log_path, STARTUP_S)
        except RuntimeError:
            self.stop()
            raise

    def get(self, path: str):
        with urllib.request.urlopen(self.url + path, timeout=60) as r:
            body = r.read().decode()
        return body if path == "/metrics" else json.loads(body)

    def post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            return json.loads(r.read().decode())

    def metrics(self) -> dict[str, float]:
        return serve.parse_metrics(self.get("/metrics"))

    def peak_rss(self) -> int | None:
        return serve.process_memory(self.proc.pid, "VmHWM")

    def pinned_questions(self) -> list[str]:
        return _PINNED.findall(self.log_path.read_text(errors="replace"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            serve.stop(self.proc)
        self._log.close()


def server_tokens(server: Server, item: Item) -> list[int]:
    """The ids the server reads for an item: its chat template applied by /apply-template (chat mode), then
    /tokenize with the model's special tokens (BOS as the model adds it)."""
    text = item.extra["prompt_text"]
    if item.extra["mode"] == "chat":
        text = server.post("/apply-template", {"messages": [{"role": "user", "content": text}]})["prompt"]
    return server.post("/tokenize", {"content": text, "add_special": True, "parse_special": True})["tokens"]


def client(server: Server, item: Item):
    """RULER's own client for the item's endpoint, greedy (temperature 0), the task's answer length."""
    from long_context_eval.pred.client_wrappers import GenericOAIURLClient

    chat = item.extra["mode"] == "chat"
    return GenericOAIURLClient(url=server.url + ("/v1/chat/completions" if chat else "/v1/completions"),
                               model_name="locret", mode="chat" if chat else "completion", timeout=REQUEST_TIMEOUT_S,
                               temperature=0.0, top_p=1.0, random_seed=0, stop=[],
                               tokens_to_generate=item.max_new_tokens)


def ask(server: Server, spec: RunSpec, item: Item) -> dict:
    """Send one item; its sample record (without the score, which the runner adds)."""
    # the ids the server reads, against the ids kvpress is fed; not for Locret-Q auto, whose server places the found
    # question at the start (other ids by design: the same prompt, rearranged)
    tokens_match = None if spec.method in AUTO_QUERY_METHODS else server_tokens(server, item) == list(item.tokens)
    n_pinned_before = len(server.pinned_questions())
    before = server.metrics()
    t0 = time.perf_counter()
    answer = client(server, item)(prompt=item.extra["prompt_text"])["text"][0] or ""
    wall = time.perf_counter() - t0
    after = server.metrics()
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    evicting = spec.method != "full"
    slot = server.get("/slots")[0].get("locret", {}) if evicting else {}
    prefill_s, decode_s = delta.get("prompt_seconds_total", 0.0), delta.get("tokens_predicted_seconds_total", 0.0)
    n_prompt, n_gen = int(delta.get("prompt_tokens_total", 0)), int(delta.get("tokens_predicted_total", 0))
    out = dict(spec.labels, item=item.id, source=item.source, length=item.length, depth=item.depth,
               prompt_tokens=len(item.tokens), answer=answer, answers=list(item.answers), new_tokens=n_gen,
               wall_s=round(wall, 4), prefill_s=round(prefill_s, 4), decode_s=round(decode_s, 4),
               prefill_tok_s=round(n_prompt / prefill_s, 2) if prefill_s > 0 else None,
               decode_tok_s=round(n_gen / decode_s, 2) if decode_s > 0 and n_gen else None,
               cells_used_max=int(slot["n_cells_used"]) if slot else None,
               n_cells=int(slot["n_cells"]) if slot else None, evictions=int(slot.get("n_evictions", 0)),
               pinned=int(slot.get("n_pinned", 0)), kv_bytes=int(after["locret_kv_bytes"]) if evicting else None,
               tokens_match=tokens_match, via="llama-server", extra=item.extra)
    if spec.method in AUTO_QUERY_METHODS:
        found = server.pinned_questions()[n_pinned_before:]
        out["query_found"] = found[-1] if found else ""
        out["query_is_the_tasks"] = bool(found) and found[-1].strip() == item.query.strip()
    return out


def execute(spec: RunSpec, todo: list[Item], on_sample, deadline: float | None, log_dir: Path) -> dict | None:
    """Answer `todo` with one server: each sample record goes to `on_sample` as it comes; the run's end record, or
    None when the deadline stopped it. RuntimeError (with the server log's tail) if the server fails."""
    port = serve.free_port()
    server = Server(command(spec, port), log_dir / f"{spec.labels['run'].replace('/', '_')}.log", port)
    try:
        for i, item in enumerate(todo):
            on_sample(ask(server, spec, item))
            if deadline is not None and time.monotonic() > deadline and i + 1 < len(todo):
                return None
        kv = int(server.metrics().get("locret_kv_bytes", 0)) if spec.method != "full" else None
        return {"peak_rss_bytes": server.peak_rss(), "gpu_bytes": None, "kv_bytes": kv, "via": "llama-server"}
    except (OSError, ValueError, KeyError) as e:
        tail = server.log_path.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{spec.labels['run']}: the server failed ({e}); its log ends:\n{tail}") from None
    finally:
        server.stop()
