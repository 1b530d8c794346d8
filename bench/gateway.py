"""`make bench-gateway`: merge the merge-rate and overhead results into `bench/results/gateway.json`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def main() -> int:
    """Combine the two result files into the summary the gateway issue asks for."""
    merge = json.loads((RESULTS / "gateway_merge.json").read_text())
    overhead = json.loads((RESULTS / "gateway_overhead.json").read_text())
    keys = ("added_p50_ms", "added_p99_ms", "throughput_vs_direct", "throughput_vs_agentlightning", "throughput_vs_litellm",
            "rps_harnessrl", "rps_agentlightning", "rps_litellm", "cpu_ms_per_request_harnessrl",
            "added_p99_ms_rounds", "baseline_rev", "added_p50_ms_baseline", "added_p99_ms_baseline",
            "added_p99_ms_baseline_rounds", "rps_baseline", "throughput_vs_baseline")  # fmt: skip
    raw = overhead["raw"]["harnessrl"]
    out = {
        "merge_rate_tito": merge["merge_rate_tito"],
        "merge_rate_passthrough": merge["merge_rate_passthrough"],
        "concurrency": {c: {k: row.get(k) for k in keys} for c, row in overhead["per_concurrency"].items()},
        "memory_rss_mb": [raw["memory"]["rss_mb_before"], raw["memory"]["rss_mb_after"]],
        "memory_calls": raw["memory"]["calls"],
        "calls_answered": raw.get("calls_answered"),
        "calls_stored": raw.get("calls_stored"),
    }
    (RESULTS / "gateway.json").write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
