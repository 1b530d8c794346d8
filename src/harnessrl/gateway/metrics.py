"""Prometheus metrics of the gateway, in the text exposition format (no client library needed)."""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict
from collections.abc import Callable

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)

Labels = tuple[tuple[str, str], ...]


def _fmt(labels: Labels, extra: tuple[tuple[str, str], ...] = ()) -> str:
    items = labels + extra
    if not items:
        return ""
    return "{" + ",".join(f'{k}="{v}"' for k, v in items) + "}"


class Metrics:
    """Counters, one latency histogram and gauges read at scrape time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, dict[Labels, float]] = defaultdict(lambda: defaultdict(float))
        self._help: dict[str, str] = {}
        self._hist: dict[Labels, list[float]] = {}  # per label set: bucket counts + [sum, count]
        self._gauges: dict[str, tuple[str, Callable[[], float]]] = {}

    def inc(self, name: str, help_text: str, value: float = 1.0, **labels: str) -> None:
        """Add `value` to a counter."""
        key = tuple(sorted(labels.items()))
        with self._lock:
            self._help[name] = help_text
            self._counters[name][key] += value

    def observe_latency(self, seconds: float, **labels: str) -> None:
        """Record one call's latency."""
        key = tuple(sorted(labels.items()))
        with self._lock:
            h = self._hist.setdefault(key, [0.0] * (len(LATENCY_BUCKETS) + 2))
            i = bisect.bisect_left(LATENCY_BUCKETS, seconds)
            if i < len(LATENCY_BUCKETS):
                h[i] += 1
            h[-2] += seconds
            h[-1] += 1

    def gauge(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        """Register a gauge read when scraped."""
        self._gauges[name] = (help_text, read)

    def render(self) -> str:
        """The exposition text."""
        lines: list[str] = []
        with self._lock:
            for name, series in sorted(self._counters.items()):
                lines += [f"# HELP {name} {self._help[name]}", f"# TYPE {name} counter"]
                lines += [f"{name}{_fmt(k)} {v:g}" for k, v in sorted(series.items())]
            name = "harnessrl_gateway_call_latency_seconds"
            lines += [
                f"# HELP {name} Latency of model calls through the gateway.",
                f"# TYPE {name} histogram",
            ]
            for key, h in sorted(self._hist.items()):
                cumulative = 0.0
                for bound, n in zip(LATENCY_BUCKETS, h, strict=False):
                    cumulative += n
                    lines.append(f"{name}_bucket{_fmt(key, (('le', f'{bound:g}'),))} {cumulative:g}")
                lines.append(f"{name}_bucket{_fmt(key, (('le', '+Inf'),))} {h[-1]:g}")
                lines += [f"{name}_sum{_fmt(key)} {h[-2]:g}", f"{name}_count{_fmt(key)} {h[-1]:g}"]
        for gname, (help_text, read) in sorted(self._gauges.items()):
            lines += [f"# HELP {gname} {help_text}", f"# TYPE {gname} gauge", f"{gname} {read():g}"]
        return "\n".join(lines) + "\n"
