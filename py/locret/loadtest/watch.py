"""What the server holds while a load test plays: its RSS (from /proc, when it runs on this machine) and its
/metrics (llama.cpp's counters and Locret's gauges), sampled every `period_s` seconds on a thread of its own."""
from __future__ import annotations

import threading
import time
import urllib.request

from ..serve import parse_metrics, process_memory


def metrics(url: str, timeout: float = 10) -> dict[str, float]:
    """The server's /metrics as {name: value} (labelled series summed: locret_cells_used of every slot); {} when the
    server has no /metrics (started without --metrics) or does not answer."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout) as r:
            text = r.read().decode()
    except OSError:
        return {}
    return parse_metrics(text)


class Watch:
    """Samples (seconds since start, RSS bytes or None, metrics) until stop(); use as a context manager."""

    def __init__(self, url: str, pid: int | None, period_s: float = 2.0):
        self.url, self.pid, self.period_s = url, pid, period_s
        self.samples: list[tuple[float, int | None, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        t0 = time.monotonic()
        while True:
            self.samples.append((round(time.monotonic() - t0, 2), process_memory(self.pid) if self.pid else None,
                                 metrics(self.url)))
            if self._stop.wait(self.period_s):
                return

    def __enter__(self) -> "Watch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        """RSS at the first and last sample and its peak (MiB), the peak of Locret's KV gauge, the most slots busy at
        once (llama.cpp's requests_processing: what the run sustained), the last metrics."""
        rss = [r for _, r, _ in self.samples if r is not None]
        kv = [m["locret_kv_bytes"] for _, _, m in self.samples if "locret_kv_bytes" in m]
        busy = [m["requests_processing"] for _, _, m in self.samples if "requests_processing" in m]
        mib = lambda b: round(b / 2**20, 1)  # noqa: E731
        return {"samples": len(self.samples),
                "rss_mib_first": mib(rss[0]) if rss else None, "rss_mib_last": mib(rss[-1]) if rss else None,
                "rss_mib_peak": mib(max(rss)) if rss else None,
                "locret_kv_mib_peak": mib(max(kv)) if kv else None,
                "busy_slots_peak": int(max(busy)) if busy else None,
                "metrics_last": self.samples[-1][2] if self.samples else {}}
