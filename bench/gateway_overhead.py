"""What the gateway costs in the path: latency added and throughput against a fast stub engine, beside
Agent Lightning's proxy and LiteLLM's proxy, in one run; then resident memory over many calls.

Load comes from `wrk -t1` (Debian package `wrk`) with a Lua script for the POST body. Each system
forwards the same chat request to the same stub (`bench/stub_upstream.py`, ~5 KB vLLM-style answers
with token IDs and logprobs). Baselines run from their own virtual environments (Agent Lightning
1.0.2 needs Python >= 3.12); a baseline whose environment is missing is reported as skipped.

    python bench/gateway_overhead.py --seconds 10 \\
        --agentlightning-python /path/to/venv-al/bin/python --litellm-bin /path/to/venv-litellm/bin/litellm

`--baseline-rev REV` also runs the gateway of another commit (a git worktree of REV made for the run)
in the same run, against the same stub, each wrk run of it right beside the same run of this tree's
gateway; `--rounds N` repeats the direct, this tree and the baseline N times, interleaved (the order
flips every round), and reports medians with the spread: a tail latency on a shared machine moves by
several times between runs, so only a paired run compares two commits.

    python bench/gateway_overhead.py --levels 1 64 --rounds 5 --baseline-rev be86533 --memory-calls 0

Writes `bench/results/gateway_overhead.json`; `bench/gateway.py` merges it with the merge-rate run. A paired
run with `--baseline-rev REV` and neither Agent Lightning nor LiteLLM writes `bench/results/gateway_vs_REV.json`
instead, so it does not replace the file of the full comparison (`--out` chooses).
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
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).parent
ROOT = HERE.parent
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


def timed_run(url: str, headers: dict[str, str], body: dict[str, Any], pid: int | None, conns: int,
              seconds: float, work: Path) -> dict[str, float]:  # fmt: skip
    """One wrk run, with the CPU per request of process `pid` when it is known."""
    cpu0 = cpu_seconds(pid) if pid else 0.0
    r = run_wrk(url, headers, body, conns, seconds, work)
    if pid:
        r["cpu_ms_per_request"] = 1e3 * (cpu_seconds(pid) - cpu0) / max(r["requests"], 1)
    return r


def show(name: str, c: int, r: dict[str, float]) -> None:
    """One line of the live table."""
    print(f"{name:<16} c={c:<3} p50 {r['p50_ms']:8.2f} ms  p99 {r['p99_ms']:8.2f} ms  {r['rps']:9.1f} req/s"
          f"  non-2xx {r['non_2xx']}", flush=True)  # fmt: skip


def measure(name: str, url: str, headers: dict[str, str], body: dict[str, Any], pid: int | None,
            levels: list[int], seconds: float, work: Path) -> dict[str, Any]:  # fmt: skip
    """Warm up, then one wrk run per concurrency level, with CPU per request when `pid` is known."""
    run_wrk(url, headers, body, 4, 2, work)
    results: dict[str, Any] = {}
    for c in levels:
        results[str(c)] = r = timed_run(url, headers, body, pid, c, seconds, work)
        show(name, c, r)
    return results


class Gateway:
    """A harnessrl gateway (passthrough, SQLite store) of the source tree `src`, in front of the stub,
    with a rollout's key."""

    def __init__(self, name: str, src: Path, stub: str, work: Path) -> None:
        port, admin = free_port(), secrets.token_hex(16)
        self.name, self.store = name, work / f"{name}.sqlite"
        self.proc = Proc([sys.executable, "-m", "harnessrl.gateway", "--store", str(self.store), "--upstream", stub,
                          "--port", str(port)], work / f"{name}.log",
                         env={"HARNESSRL_ADMIN_KEY": admin, "PYTHONPATH": str(src)})  # fmt: skip
        base = f"http://127.0.0.1:{port}"
        wait_http(f"{base}/health")
        key = httpx.post(f"{base}/control/rollouts", headers={"Authorization": f"Bearer {admin}"},
                         json={"client_id": "bench", "task_id": "t"}).json()["api_key"]  # fmt: skip
        self.url, self.headers, self.pid = (
            f"{base}/v1/chat/completions",
            {"Authorization": f"Bearer {key}"},
            self.proc.p.pid,
        )

    def calls_stored(self) -> int:
        """Calls in its store (after `stop`)."""
        return int(sqlite3.connect(self.store).execute("SELECT COUNT(*) FROM calls").fetchone()[0])


@contextmanager
def worktree(rev: str, work: Path) -> Iterator[tuple[Path, str]]:
    """A detached git worktree of `rev` for this run (its `src` and commit); removed afterwards."""
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{rev}^{{commit}}"],
                         capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    path = work / "baseline-tree"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(path), sha], check=True
    )
    try:
        yield path / "src", sha
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], check=False)


def paired(systems: list[tuple[str, str, dict[str, str], int | None]], levels: list[int], seconds: float,
           rounds: int, work: Path) -> dict[str, dict[str, list[dict[str, float]]]]:  # fmt: skip
    """`rounds` rounds of every level; within a level, each system's wrk run right after the other's,
    the order flipped every round. Returns each system's runs per level, in round order."""
    for _, url, headers, _ in systems:
        run_wrk(url, headers, BODY, 4, 2, work)  # warm-up
    out: dict[str, dict[str, list[dict[str, float]]]] = {
        name: {str(c): [] for c in levels} for name, *_ in systems
    }
    for r in range(rounds):
        for c in levels:
            for name, url, headers, pid in systems if r % 2 == 0 else systems[::-1]:
                out[name][str(c)].append(run := timed_run(url, headers, BODY, pid, c, seconds, work))
                show(name if rounds == 1 else f"{name} r{r + 1}", c, run)
    return out


def medians(runs: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per level, the median over rounds of each figure of a run."""
    return {c: {k: statistics.median(run[k] for run in rs) for k in rs[0]} for c, rs in runs.items()}


def harnessrl(stub: str, levels: list[int], seconds: float, work: Path, memory_calls: int, rounds: int = 1,
              baseline_rev: str | None = None) -> dict[str, Any]:  # fmt: skip
    """The direct stub, this tree's gateway and (with `baseline_rev`) another commit's, paired over
    `rounds`; then RSS of this tree's gateway over `memory_calls` calls and its stored calls."""
    with ExitStack() as stack:
        gateways = [Gateway("harnessrl", ROOT / "src", stub, work)]
        stack.callback(gateways[0].proc.stop)
        if baseline_rev:
            src, sha = stack.enter_context(worktree(baseline_rev, work))
            gateways.append(Gateway("baseline", src, stub, work))
            stack.callback(gateways[1].proc.stop)
        systems = [("direct", f"{stub}/v1/chat/completions", {}, None)]
        systems += [(g.name, g.url, g.headers, g.pid) for g in gateways]
        runs = paired(systems, levels, seconds, rounds, work)
        results: dict[str, Any] = {name: {"levels": medians(rs), "rounds": rs} for name, rs in runs.items()}
        if baseline_rev:
            results["baseline"].update(rev=baseline_rev, commit=sha)
            gateways[1].proc.stop()
        ours = gateways[0]
        results["harnessrl"]["memory"] = memory_run(ours.url, ours.headers, ours.pid, memory_calls, work)
        ours.proc.stop()
        out = results["harnessrl"]
        out["calls_stored"], out["calls_answered"] = ours.calls_stored(), ANSWERED[ours.url]
        print(
            f"harnessrl: {out['calls_answered']} answers delivered, {out['calls_stored']} calls in the store"
        )
        return results


def memory_run(url: str, headers: dict[str, str], pid: int, calls: int, work: Path) -> dict[str, float]:
    """RSS after a warm-up and after `calls` more calls at concurrency 16 (none: no memory run)."""
    if calls <= 0:
        return {"rss_mb_before": rss_mb(pid), "rss_mb_after": rss_mb(pid), "calls": 0}
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


def added(results: dict[str, Any], name: str, c: str, key: str) -> list[float]:
    """Per round, `name`'s figure `key` less the direct stub's in the same round."""
    return [
        run[key] - d[key]
        for run, d in zip(results[name]["rounds"][c], results["direct"]["rounds"][c], strict=True)
    ]


def paired_row(results: dict[str, Any], c: str) -> dict[str, Any]:
    """This tree's gateway at concurrency `c`, and the baseline commit's beside it when it ran: added
    latency and throughput as medians over rounds, with every round's figure."""
    ours, rps = results["harnessrl"]["levels"][c], [r["rps"] for r in results["harnessrl"]["rounds"][c]]
    row: dict[str, Any] = {
        "added_p50_ms": statistics.median(added(results, "harnessrl", c, "p50_ms")),
        "added_p99_ms": statistics.median(p99 := added(results, "harnessrl", c, "p99_ms")),
        "rps_harnessrl": ours["rps"],
        "cpu_ms_per_request_harnessrl": ours.get("cpu_ms_per_request"),
        "throughput_vs_direct": ours["rps"] / results["direct"]["levels"][c]["rps"],
        "added_p99_ms_rounds": p99, "rps_harnessrl_rounds": rps,
    }  # fmt: skip
    if "baseline" in results:
        base = results["baseline"]
        base_p99, base_rps = added(results, "baseline", c, "p99_ms"), [r["rps"] for r in base["rounds"][c]]
        row.update({
            "baseline_rev": base["rev"], "baseline_commit": base["commit"],
            "added_p50_ms_baseline": statistics.median(added(results, "baseline", c, "p50_ms")),
            "added_p99_ms_baseline": statistics.median(base_p99), "added_p99_ms_baseline_rounds": base_p99,
            "rps_baseline": base["levels"][c]["rps"], "rps_baseline_rounds": base_rps,
            "cpu_ms_per_request_baseline": base["levels"][c].get("cpu_ms_per_request"),
            "throughput_vs_baseline": statistics.median(a / b for a, b in zip(rps, base_rps, strict=True)),
        })  # fmt: skip
    return row


def summarise(results: dict[str, Any], levels: list[int]) -> dict[str, Any]:
    """Per concurrency: added latency and throughput ratios against each baseline."""
    out: dict[str, Any] = {}
    for c in map(str, levels):
        row = paired_row(results, c)
        for base in ("agentlightning", "litellm"):
            if base in results:
                row[f"rps_{base}"] = results[base]["levels"][c]["rps"]
                row[f"throughput_vs_{base}"] = row["rps_harnessrl"] / results[base]["levels"][c]["rps"]
                row[f"cpu_ms_per_request_{base}"] = results[base]["levels"][c].get("cpu_ms_per_request")
        out[c] = row
    return out


def report(summary: dict[str, Any]) -> None:
    """Added latency and throughput of this tree beside the baseline commit's, per level."""
    for c, row in summary.items():
        line = f"c={c:<3} added p50 / p99 {row['added_p50_ms']:.2f} / {row['added_p99_ms']:.2f} ms"
        line += f" (p99 rounds {_spread(row['added_p99_ms_rounds'])})  {row['rps_harnessrl']:.0f} req/s"
        if "baseline_rev" in row:
            line += (f"  | {row['baseline_rev']}: {row['added_p50_ms_baseline']:.2f} / {row['added_p99_ms_baseline']:.2f} ms"
                     f" (p99 rounds {_spread(row['added_p99_ms_baseline_rounds'])})  {row['rps_baseline']:.0f} req/s,"
                     f" throughput ratio {row['throughput_vs_baseline']:.2f}")  # fmt: skip
        print(line, flush=True)


def _spread(values: list[float]) -> str:
    return f"{min(values):.2f}–{max(values):.2f}" if len(values) > 1 else "one"


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
    p.add_argument("--rounds", type=int, default=1, help="paired rounds of direct / this tree / baseline")
    p.add_argument("--baseline-rev", help="also run this commit's gateway (a git worktree of it), paired")
    p.add_argument("--out", type=Path, help="default: results/gateway_overhead.json; a paired run against "
                   "--baseline-rev with neither AL nor LiteLLM: results/gateway_vs_REV.json")  # fmt: skip
    args = p.parse_args(argv)
    if args.out is None:
        alone = args.baseline_rev and not (args.agentlightning_python or args.litellm_bin)
        name = (
            f"gateway_vs_{re.sub(r'[^A-Za-z0-9_.-]', '_', args.baseline_rev)}.json"
            if alone
            else "gateway_overhead.json"
        )
        args.out = HERE / "results" / name
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
            results = harnessrl(
                stub, args.levels, args.seconds, work, args.memory_calls, args.rounds, args.baseline_rev
            )
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
    report(summary["per_concurrency"])
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
