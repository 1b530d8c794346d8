"""Prometheus metrics of the gateway, in the text exposition format (no client library needed)."""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

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


def _escape(value: str) -> str:
    """A label value as the exposition format writes it (backslash, quote and newline escaped)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _fmt(labels: Labels, extra: tuple[tuple[str, str], ...] = ()) -> str:
    items = labels + extra
    if not items:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in items) + "}"


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

    def inc_capped(self, name: str, help_text: str, max_series: int, **labels: str) -> None:
        """Add 1 to a counter whose label values come from clients (field names, tool types): once it
        has `max_series` series, new label sets are counted under `other` so clients cannot grow it."""
        key = tuple(sorted(labels.items()))
        with self._lock:
            series = self._counters[name]
            if key not in series and len(series) >= max_series:
                key = tuple((k, "other") for k, _ in key)
            self._help[name] = help_text
            series[key] += 1

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


def count_request_notes(metrics: Metrics, face: str, notes: dict[str, Any]) -> None:
    """Count what a face noted about a request: each ignored field, each dropped tool (by type), a
    clamped output budget."""
    for name in notes.get("ignored_fields") or []:
        metrics.inc_capped("harnessrl_gateway_ignored_fields_total",
                           "Request fields accepted but not used for generation, by face and field.", 500,
                           face=face, field=str(name)[:64])  # fmt: skip
    for tool in notes.get("dropped_tools") or []:
        metrics.inc_capped("harnessrl_gateway_dropped_tools_total",
                           "Tools left out of the prompt (hosted by the API provider, unsupported), by type.",
                           200, face=face, type=str(tool.get("type"))[:64])  # fmt: skip
    if notes.get("max_tokens_clamped"):
        metrics.inc("harnessrl_gateway_max_tokens_clamped_total",
                    "Calls whose max_tokens was cut to what the prompt leaves of the context.", face=face)  # fmt: skip
