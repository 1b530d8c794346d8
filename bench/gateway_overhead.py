"""What the gateway costs in the path: latency added and throughput against a fast stub engine, beside
Agent Lightning's proxy and LiteLLM's proxy, in one run; then resident memory over many calls.

Load comes from `wrk -t1` (Debian package `wrk`) with a Lua script for the POST body. Each system
forwards the same chat request to the same stub (`bench/stub_upstream.py`, ~5 KB vLLM-style answers
with token IDs and logprobs). Baselines run from their own virtual environments (Agent Lightning
1.0.2 needs Python >= 3.12); a baseline whose environment is missing is reported as skipped.

    python bench/gateway_overhead.py --seconds 10 \\
        --agentlightning-python /path/to/venv-al/bin/python --litellm-bin /path/to/venv-litellm/bin/litellm

Writes `bench/results/gateway_overhead.json`; `bench/gateway.py` merges it with the merge-rate run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).parent
BODY = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 40}


def free_port() -> int:
    """A free loopback port."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout_s: float = 120.0, ok: tuple[int, ...] = (200,)) -> None:
    """Poll `url` until it answers with one of `ok`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code in ok:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{url} did not come up")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (and its children that have been waited for), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    """Resident memory of a process in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4}
ANSWERED: dict[str, int] = {}  # 2xx answers per URL over every wrk run (warm-ups included)


def _ms(text: str) -> float:
    m = re.match(r"([\d.]+)(us|ms|s|m)$", text.strip())
    if m is None:
        raise ValueError(f"cannot read latency {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def run_wrk(
    url: str, headers: dict[str, str], body: dict[str, Any], conns: int, seconds: float, work: Path
) -> dict[str, float]:
    """One wrk run; returns p50/p99 (ms), req/s, completed requests and non-2xx count."""
    lua = work / "post.lua"
    lines = ['wrk.method = "POST"', f"wrk.body = {json.dumps(json.dumps(body))}"]
    lines += [
        f'wrk.headers["{k}"] = "{v}"' for k, v in {"Content-Type": "application/json", **headers}.items()
    ]
    lua.write_text("\n".join(lines) + "\n")
    out = subprocess.run(
        ["wrk", "-t1", f"-c{conns}", f"-d{max(1, round(seconds))}s", "--latency", "-s", str(lua), url],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    get = lambda pat: re.search(pat, out)  # noqa: E731
    p50, p99 = get(r"\s50%\s+(\S+)"), get(r"\s99%\s+(\S+)")
    rps, total = get(r"Requests/sec:\s+([\d.]+)"), get(r"(\d+) requests in")
    bad = get(r"Non-2xx or 3xx responses: (\d+)")
    assert p50 and p99 and rps and total, out
    ANSWERED[url] = ANSWERED.get(url, 0) + int(total.group(1)) - (int(bad.group(1)) if bad else 0)
    return {"p50_ms": _ms(p50.group(1)), "p99_ms": _ms(p99.group(1)), "rps": float(rps.group(1)),
            "requests": int(total.group(1)), "non_2xx": int(bad.group(1)) if bad else 0}  # fmt: skip


class Proc:
    """A server process started for the benchmark."""

    def __init__(
        self, args: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> None:
        self.log = log
        with log.open("wb") as f:
            self.p = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                      cwd=cwd, start_new_session=True)  # fmt: skip

    def stop(self) -> None:
        """Kill the process group."""
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.p.wait()


def measure(name: str, url: str, headers: dict[str, str], body: dict[str, Any], pid: int | None,
            levels: list[int], seconds: float, work: Path) -> dict[str, Any]:  # fmt: skip
    """Warm up, then one wrk run per concurrency level, with CPU per request when `pid` is known."""
    run_wrk(url, headers, body, 4, 2, work)
    results: dict[str, Any] = {}
    for c in levels:
        cpu0 = cpu_seconds(pid) if pid else 0.0
        r = run_wrk(url, headers, body, c, seconds, work)
        if pid:
            r["cpu_ms_per_request"] = 1e3 * (cpu_seconds(pid) - cpu0) / max(r["requests"], 1)
        results[str(c)] = r
        print(f"{name:<16} c={c:<3} p50 {r['p50_ms']:8.2f} ms  p99 {r['p99_ms']:8.2f} ms  {r['rps']:9.1f} req/s"
              f"  non-2xx {r['non_2xx']}", flush=True)  # fmt: skip
    return results


def harnessrl(stub: str, levels: list[int], seconds: float, work: Path, memory_calls: int) -> dict[str, Any]:
    """The gateway (passthrough, SQLite store) in front of the stub; then RSS over `memory_calls` calls."""
    port, admin = free_port(), secrets.token_hex(16)
    store = work / "harnessrl.sqlite"
    proc = Proc([sys.executable, "-m", "harnessrl.gateway", "--store", str(store), "--upstream", stub, "--port", str(port)],
                work / "harnessrl.log", env={"HARNESSRL_ADMIN_KEY": admin})  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(f"{base}/health")
        key = httpx.post(f"{base}/control/rollouts", headers={"Authorization": f"Bearer {admin}"},
                         json={"client_id": "bench", "task_id": "t"}).json()["api_key"]  # fmt: skip
        headers = {"Authorization": f"Bearer {key}"}
        out: dict[str, Any] = {"levels": measure("harnessrl", f"{base}/v1/chat/completions", headers, BODY,
                                                 proc.p.pid, levels, seconds, work)}  # fmt: skip
        out["memory"] = memory_run(f"{base}/v1/chat/completions", headers, proc.p.pid, memory_calls, work)
        proc.stop()
        stored = sqlite3.connect(store).execute("SELECT COUNT(*) FROM calls").fetchone()[0]
        out["calls_stored"], out["calls_answered"] = stored, ANSWERED[f"{base}/v1/chat/completions"]
        print(
            f"harnessrl: {out['calls_answered']} answers delivered, {stored} calls in the store", flush=True
        )
        return out
    finally:
        proc.stop()


def memory_run(url: str, headers: dict[str, str], pid: int, calls: int, work: Path) -> dict[str, float]:
    """RSS after a warm-up and after `calls` more calls at concurrency 16."""
    run_wrk(url, headers, BODY, 16, 5, work)
    before, done, t0 = rss_mb(pid), 0, time.monotonic()
    while done < calls:
        done += run_wrk(url, headers, BODY, 16, 10, work)["requests"]
    after = rss_mb(pid)
    print(
        f"harnessrl memory: {before:.1f} MB -> {after:.1f} MB over {done} calls ({time.monotonic() - t0:.0f} s)",
        flush=True,
    )
    return {"rss_mb_before": before, "rss_mb_after": after, "calls": done}


def agentlightning(python: str, stub: str, levels: list[int], seconds: float, work: Path) -> dict[str, Any]:
    """Agent Lightning 1.0.2's server proxy in front of the stub (set up as in BENCH-NOTES)."""
    port, key = free_port(), secrets.token_hex(8)
    proc = Proc([python, "-m", "agentlightning.server", f"port={port}", f"key={key}", "default_proxy.model_name=m"],
                work / "agentlightning.log", cwd=work)  # fmt: skip
    try:
        base, auth = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {key}"}
        wait_http(f"{base}/api/rollouts", ok=(200, 401, 405))
        httpx.post(
            f"{base}/api/models", headers=auth, json=[{"model": "m", "endpoint": f"{stub}/v1"}]
        ).raise_for_status()
        httpx.post(
            f"{base}/api/rollouts", headers=auth, json=[{"input": {}, "rollout_id": "r1"}]
        ).raise_for_status()
        url = f"{base}/proxy/rollout/r1/attempt/0/mode/train/openai/v1/chat/completions"
        return {"levels": measure("agentlightning", url, auth, BODY, proc.p.pid, levels, seconds, work)}
    finally:
        proc.stop()


def litellm(binary: str, stub: str, levels: list[int], seconds: float, work: Path) -> dict[str, Any]:
    """LiteLLM's proxy with one `openai/` model pointing at the stub."""
    port, master = free_port(), "sk-" + secrets.token_hex(16)
    cfg = work / "litellm.yaml"
    cfg.write_text(json.dumps({"model_list": [{"model_name": "m", "litellm_params": {
        "model": "openai/stub", "api_base": f"{stub}/v1", "api_key": "sk-stub"}}]}))  # fmt: skip
    proc = Proc([binary, "--config", str(cfg), "--port", str(port), "--telemetry", "False"], work / "litellm.log",
                env={"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_MASTER_KEY": master})  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(f"{base}/health/liveliness", timeout_s=300)
        return {"levels": measure("litellm", f"{base}/v1/chat/completions", {"Authorization": f"Bearer {master}"},
                                  BODY, proc.p.pid, levels, seconds, work)}  # fmt: skip
    finally:
        proc.stop()


def summarise(results: dict[str, Any], levels: list[int]) -> dict[str, Any]:
    """Per concurrency: added latency and throughput ratios against each baseline."""
    out: dict[str, Any] = {}
    for c in map(str, levels):
        direct, ours = results["direct"]["levels"][c], results["harnessrl"]["levels"][c]
        row = {
            "added_p50_ms": ours["p50_ms"] - direct["p50_ms"],
            "added_p99_ms": ours["p99_ms"] - direct["p99_ms"],
            "rps_harnessrl": ours["rps"],
            "cpu_ms_per_request_harnessrl": ours.get("cpu_ms_per_request"),
            "throughput_vs_direct": ours["rps"] / direct["rps"],
        }
        for base in ("agentlightning", "litellm"):
            if base in results:
                row[f"rps_{base}"] = results[base]["levels"][c]["rps"]
                row[f"throughput_vs_{base}"] = ours["rps"] / results[base]["levels"][c]["rps"]
                row[f"cpu_ms_per_request_{base}"] = results[base]["levels"][c].get("cpu_ms_per_request")
        out[c] = row
    return out


def main(argv: list[str] | None = None) -> int:
    """Run every system and write the results."""
    p = argparse.ArgumentParser(prog="python bench/gateway_overhead.py")
    p.add_argument("--seconds", type=float, default=10)
    p.add_argument("--levels", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--memory-calls", type=int, default=100_000)
    p.add_argument(
        "--agentlightning-python", help="python of a venv with agentlightning==1.0.2 (Python >= 3.12)"
    )
    p.add_argument(
        "--litellm-bin", help="the `litellm` executable of a venv with LiteLLM's proxy dependencies"
    )
    p.add_argument("--out", type=Path, default=HERE / "results" / "gateway_overhead.json")
    args = p.parse_args(argv)
    if args.agentlightning_python:
        args.agentlightning_python = str(Path(args.agentlightning_python).absolute())
    if args.litellm_bin:
        args.litellm_bin = str(Path(args.litellm_bin).absolute())
    if shutil.which("wrk") is None:
        print("error: wrk is needed (Debian: apt-get install wrk)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        port = free_port()
        stub_proc = Proc([sys.executable, str(HERE / "stub_upstream.py"), str(port)], work / "stub.log")
        stub = f"http://127.0.0.1:{port}"
        try:
            wait_http(f"{stub}/health")
            results: dict[str, Any] = {"direct": {"levels": measure(
                "direct", f"{stub}/v1/chat/completions", {}, BODY, None, args.levels, args.seconds, work)}}  # fmt: skip
            results["harnessrl"] = harnessrl(stub, args.levels, args.seconds, work, args.memory_calls)
            if args.agentlightning_python:
                results["agentlightning"] = agentlightning(
                    args.agentlightning_python, stub, args.levels, args.seconds, work
                )
            if args.litellm_bin:
                results["litellm"] = litellm(args.litellm_bin, stub, args.levels, args.seconds, work)
        finally:
            stub_proc.stop()
    summary = {"per_concurrency": summarise(results, args.levels), "raw": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary["per_concurrency"], indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
