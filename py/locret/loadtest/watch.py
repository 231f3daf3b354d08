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


RSS_WINDOW_S = 600.0   # issue 79's flat-memory check: the last ten minutes of a run against its first ten


def rss_window_ratio(samples: list[tuple[float, int | None]], window_s: float = RSS_WINDOW_S) -> float | None:
    """Peak RSS over the run's last `window_s` seconds / peak over its first `window_s` (from (seconds, RSS bytes)
    samples): above 1 when the server's memory grew while it served. None when the run is shorter than two windows
    (the two would overlap) or has no RSS. Peaks, not means: a window's mean moves with how busy the slots were."""
    rss = [(t, r) for t, r in samples if r is not None]
    if not rss or rss[-1][0] - rss[0][0] < 2 * window_s:
        return None
    t0, t1 = rss[0][0], rss[-1][0]
    first = max(r for t, r in rss if t <= t0 + window_s)
    last = max(r for t, r in rss if t >= t1 - window_s)
    return round(last / first, 4)


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
        """RSS at the first and last sample and its peak (MiB), its last ten minutes' peak over its first ten's
        (rss_window_ratio; None under 20 minutes), the RSS at every sample ([seconds, MiB]), the peak of Locret's KV
        gauge, the most slots busy at once (llama.cpp's requests_processing: what the run sustained), the last
        metrics."""
        rss = [r for _, r, _ in self.samples if r is not None]
        kv = [m["locret_kv_bytes"] for _, _, m in self.samples if "locret_kv_bytes" in m]
        busy = [m["requests_processing"] for _, _, m in self.samples if "requests_processing" in m]
        mib = lambda b: round(b / 2**20, 1)  # noqa: E731
        return {"samples": len(self.samples),
                "rss_mib_first": mib(rss[0]) if rss else None, "rss_mib_last": mib(rss[-1]) if rss else None,
                "rss_mib_peak": mib(max(rss)) if rss else None,
                "rss_window_ratio": rss_window_ratio([(t, r) for t, r, _ in self.samples]),
                "rss_mib_timeline": [[t, mib(r)] for t, r, _ in self.samples if r is not None],
                "locret_kv_mib_peak": mib(max(kv)) if kv else None,
                "busy_slots_peak": int(max(busy)) if busy else None,
                "metrics_last": self.samples[-1][2] if self.samples else {}}
