"""`make bench-controller`: attempts started and graded per second at concurrency 64, plain
subprocesses (LocalRunner) against bubblewrap sandboxes (SandboxRunner) and forks of a fork server
(ForkServerRunner), in one run; the plain runner as root with and without a uid of its own per attempt
(with an interpreter other uids can run, when there is one); then a harness that imports the `openai`
SDK (as the examples' do): plain, forked from a fork server that preloaded it, sandboxed (a bwrap, an
interpreter and an import per attempt), and forked from a zygote inside one sandbox (the examples'
`fork_server: true` under the default `controller.sandbox: auto`: SandboxedForkServerRunner).

A real gateway process over a real SQLite store, the real Controller (create rollout, start attempt,
run the harness, finish the attempt, grade, write the reward, set the state), and a trivial harness
(`python -c` writing answer.json; it makes no model call, so no engine runs). The per-attempt sandbox
overhead is the difference of median attempt latencies run one at a time (the cost one attempt pays);
the saturated figure (1000/rate_sandbox - 1000/rate_plain) is reported beside it, and so is the rate of
the control path alone (a runner that writes the answer without starting any process).

    python bench/controller.py --attempts 256 --concurrency 64 --out bench/results/controller.json
    python bench/controller.py --openai-only --attempts 64 --concurrency 16 --rounds 5 \
        --out bench/results/controller_openai.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import logging
import os
import platform
import resource
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harnessrl.controller import (
    AttemptResult,
    AttemptSpec,
    Controller,
    ForkServerRunner,
    HarnessSpec,
    LocalRunner,
    RolloutRequest,
    Runner,
    SandboxedForkServerRunner,
    SandboxRunner,
)
from harnessrl.controller.isolation import unreachable
from harnessrl.controller.runner import RunnerBase, prepare_workdir
from harnessrl.gateway.client import ControlClient
from harnessrl.schema import RolloutState, Task
from harnessrl.services import free_port, start_gateway

HARNESS = "import json, os; json.dump({'answer': 1}, open(os.path.join(os.environ['HARNESSRL_OUTPUT'], 'answer.json'), 'w'))"  # fmt: skip
OPENAI_HARNESS = "import openai; " + HARNESS  # the SDK import is most of a real harness's start-up
log = logging.getLogger("bench.controller")


class Timed(RunnerBase):
    """Wraps a runner and records how long each attempt took, in seconds."""

    def __init__(self, inner: Runner) -> None:
        self.inner = inner
        self.seconds: list[float] = []

    async def run(self, spec: AttemptSpec, harness: HarnessSpec) -> AttemptResult:
        """Run the attempt with the wrapped runner, timing it."""
        t0 = time.perf_counter()
        result = await self.inner.run(spec, harness)
        self.seconds.append(time.perf_counter() - t0)
        return result


class NoHarness(RunnerBase):
    """Writes the answer itself instead of starting a process: the ceiling of the control path."""

    async def run(self, spec: AttemptSpec, harness: HarnessSpec) -> AttemptResult:
        """Create the attempt's files and its answer; exit code 0."""
        output_dir, _ = prepare_workdir(spec)
        (output_dir / "answer.json").write_text('{"answer": 1}')
        return AttemptResult(0, False, output_dir, "", "")


def grader(task: Task, result: AttemptResult) -> float:
    """1.0 when the harness wrote its answer."""
    path = result.output_dir / "answer.json"
    return float(path.exists() and json.loads(path.read_text()).get("answer") == 1)


async def measure(
    name: str,
    runner: Runner,
    gw_url: str,
    admin: str,
    work: Path,
    n: int,
    concurrency: int,
    code: str = HARNESS,
    python: str = sys.executable,
) -> dict[str, Any]:
    """Run `n` rollouts of the harness `python -c code` at `concurrency`; attempts per second and
    attempt latencies (ms)."""
    timed = Timed(runner)
    client = ControlClient(gw_url, admin)
    harness = HarnessSpec([python, "-c", code], timeout_s=120)
    ctl = Controller(client, gw_url, harness, grader, work / name, concurrency=concurrency, runner=timed)
    tag = secrets.token_hex(4)
    reqs = [RolloutRequest(Task(task_id=f"t{i}", input={}), client_id=f"{name}-{tag}-{i}") for i in range(n)]
    try:
        t0, cpu0 = time.perf_counter(), cpu_seconds(runner)
        outcomes = await ctl.run(reqs)
        wall, cpu = time.perf_counter() - t0, cpu_seconds(runner) - cpu0
    finally:
        await client.aclose()
    graded = sum(o.state == RolloutState.SUCCEEDED and o.reward == 1.0 for o in outcomes)
    if graded != n:
        errors = {o.error for o in outcomes if o.error}
        raise RuntimeError(f"{name}: {n - graded} of {n} rollouts were not graded 1.0: {errors}")
    ms = sorted(1e3 * s for s in timed.seconds)
    return {"attempts": n, "concurrency": concurrency, "wall_s": wall, "attempts_per_s": n / wall,
            "latency_p50_ms": statistics.median(ms), "latency_p90_ms": ms[int(0.9 * (len(ms) - 1))],
            "cpu_ms_per_attempt": 1e3 * cpu / n}  # fmt: skip


def become_subreaper() -> None:
    """Make this process the reaper of its orphaned descendants (Linux PR_SET_CHILD_SUBREAPER): bwrap's
    monitor exits without waiting for the sandbox's init, whose CPU time would otherwise go uncounted."""
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)


def reap_orphans() -> None:
    """Collect the exited orphans handed to this process (called between measurements, when no attempt
    runs: every child that asyncio waits for has been waited for), adding their CPU to RUSAGE_CHILDREN."""
    time.sleep(0.3)  # a sandbox's init dies just after bwrap's monitor (--die-with-parent)
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def cpu_seconds(runner: Runner) -> float:
    """CPU time (user + system) of this process and of every process of the attempts so far: ended
    children and what they waited for, and a fork server's zygote with its harnesses. The gateway's
    is left out (the same work for every runner). Unlike wall time, this hardly moves with the load
    other work puts on the machine."""
    reap_orphans()
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
    proc = getattr(runner, "_proc", None)  # ForkServerRunner's zygote: its harnesses are its children
    roots = [proc.pid] if proc is not None else list(getattr(runner, "pids", []))  # sandboxed: bwrap
    return total + sum(tree_cpu_seconds(pid) for pid in roots)


def tree_cpu_seconds(root: int) -> float:
    """CPU time of a live process and all its live descendants, each with what it has waited for
    (utime stime cutime cstime: the ended attempts of a zygote are in its own cutime/cstime)."""
    stats: dict[int, tuple[int, float]] = {}  # pid -> (parent, seconds)
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                fields = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, ValueError):
                continue
            stats[int(name)] = (int(fields[1]), sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK"))
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += stats.get(pid, (0, 0.0))[1]
        todo += [child for child, (parent, _) in stats.items() if parent == pid]
    return total


async def bench(n: int, concurrency: int, sequential: int, work: Path) -> dict[str, Any]:
    """Start the gateway; measure the runners saturated, then one attempt at a time, then the openai
    harness plain and forked."""
    port, admin = free_port(), secrets.token_hex(16)
    gw = start_gateway(work / "store.sqlite", "http://127.0.0.1:9", port, admin, work / "logs", 16)
    try:
        gw.wait_healthy(60)
        fork = ForkServerRunner(["openai"], own_uid="never")
        runners: dict[str, Runner] = {"plain": LocalRunner(own_uid="never"), "sandbox": SandboxRunner(), "fork": fork}  # fmt: skip
        for name, runner in runners.items():  # warm-up: imports, page cache, the store's first writes
            await measure(f"warm-{name}", runner, gw.url, admin, work, 8, 8)
        out: dict[str, Any] = {"saturated": {}, "sequential": {}}
        for name, runner in runners.items():
            out["saturated"][name] = r = await measure(name, runner, gw.url, admin, work, n, concurrency)
            log.info("saturated runner=%s attempts_per_s=%.1f", name, r["attempts_per_s"])
        out["saturated"]["no-harness"] = await measure(
            "none", NoHarness(), gw.url, admin, work, n, concurrency
        )
        for name, runner in runners.items():
            out["sequential"][name] = await measure(f"seq-{name}", runner, gw.url, admin, work, sequential, 1)
        out["uid"] = await bench_uid(gw.url, admin, work, n, concurrency)
        out["openai"] = await bench_openai(gw.url, admin, work, n // 4, concurrency, runners)
        out["openai"].pop("fork_rounds")  # one round here
        return out
    finally:
        fork.close()
        gw.stop()


async def bench_openai(gw_url: str, admin: str, work: Path, n: int, concurrency: int,
                       runners: dict[str, Runner] | None = None, rounds: int = 1) -> dict[str, Any]:  # fmt: skip
    """The harness importing `openai`: plain, forked, sandboxed (exec) and forked inside the sandbox
    (both fork servers preload `openai`, as the examples' `harnessrl.preload.openai` does); with
    `rounds` > 1, the two fork servers `rounds - 1` more times each, alternating (`fork_rounds`)."""
    runners = dict(runners or {"plain": LocalRunner(own_uid="never"), "sandbox": SandboxRunner(),
                               "fork": ForkServerRunner(["openai"], own_uid="never")})  # fmt: skip
    runners["sandbox-fork"] = SandboxedForkServerRunner(preload=["openai"])
    out: dict[str, Any] = {}
    try:
        for name in ("fork", "sandbox-fork"):  # warm-up: the zygotes start (not counted)
            # in the measured run's own folder: a sandboxed zygote serves one run's `rollouts/` (a run
            # starts it once), so a warm-up elsewhere would leave its start to be counted per attempt
            await measure(f"openai-{name}", runners[name], gw_url, admin, work, 4, 4, OPENAI_HARNESS)
        for name in ("plain", "fork", "sandbox", "sandbox-fork"):
            out[name] = r = await measure(f"openai-{name}", runners[name], gw_url, admin, work, n, concurrency,
                                          OPENAI_HARNESS)  # fmt: skip
            log.info("openai harness runner=%s attempts_per_s=%.1f", name, r["attempts_per_s"])
        out["fork_rounds"] = {name: [out[name]["cpu_ms_per_attempt"]] for name in ("fork", "sandbox-fork")}
        for _ in range(rounds - 1):
            for name in ("fork", "sandbox-fork"):
                r = await measure(f"openai-{name}", runners[name], gw_url, admin, work, n, concurrency, OPENAI_HARNESS)  # fmt: skip
                out["fork_rounds"][name].append(r["cpu_ms_per_attempt"])
    finally:
        for runner in runners.values():
            runner.close()
    return out


async def openai_only(n: int, concurrency: int, work: Path, rounds: int = 1) -> dict[str, Any]:
    """Only the `openai` harness's runners (a quicker run on a shared machine)."""
    port, admin = free_port(), secrets.token_hex(16)
    gw = start_gateway(work / "store.sqlite", "http://127.0.0.1:9", port, admin, work / "logs", 16)
    try:
        gw.wait_healthy(60)
        return await bench_openai(gw.url, admin, work, n, concurrency, rounds=rounds)
    finally:
        gw.stop()


async def bench_uid(gw_url: str, admin: str, work: Path, n: int, concurrency: int) -> dict[str, Any]:
    """The plain runner as root with a uid of its own per attempt against the same runner as root,
    both with an interpreter other uids can run ({} when not root or there is none)."""
    python = next((p for p in (sys.executable, "/usr/bin/python3") if unreachable(p, os.X_OK) is None), None)
    if os.geteuid() != 0 or python is None:
        return {}
    work = work / "uid"
    work.mkdir(mode=0o711)  # the attempts' uids must reach their folders
    work.chmod(0o711)
    runners = {"root": LocalRunner(own_uid="never"), "own-uid": LocalRunner(own_uid="required")}
    out: dict[str, Any] = {"python": python}
    for name, runner in runners.items():
        await measure(f"warm-uid-{name}", runner, gw_url, admin, work, 8, 8, python=python)
    for name, runner in runners.items():
        out[name] = await measure(f"uid-{name}", runner, gw_url, admin, work, n, concurrency, python=python)
        log.info("plain runner user=%s attempts_per_s=%.1f", name, out[name]["attempts_per_s"])
    return out


def main() -> int:
    """Run the benchmark, print a table, write the JSON summary."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attempts", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--sequential", type=int, default=30, help="attempts run one at a time per runner")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "controller.json")
    p.add_argument("--openai-only", action="store_true",
                   help="only the harness importing openai (--attempts of them): plain, fork, sandbox, sandbox-fork")  # fmt: skip
    p.add_argument("--rounds", type=int, default=1,
                   help="with --openai-only: rounds of the two fork servers, alternating (a median ratio)")  # fmt: skip
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    load_before = os.getloadavg()[0]
    become_subreaper()
    if args.openai_only:
        return report_openai_only(args, load_before)
    with tempfile.TemporaryDirectory(prefix="bench-controller-") as tmp:
        os.chmod(tmp, 0o711)  # the plain runner's attempt uids must reach their folders
        raw = asyncio.run(bench(args.attempts, args.concurrency, args.sequential, Path(tmp)))
    sat, seq = raw["saturated"], raw["sequential"]
    plain, sandbox = sat["plain"]["attempts_per_s"], sat["sandbox"]["attempts_per_s"]
    summary = {
        "attempts_per_s_plain": round(plain, 2),
        "attempts_per_s_sandbox": round(sandbox, 2),
        "sandbox_overhead_ms": round(seq["sandbox"]["latency_p50_ms"] - seq["plain"]["latency_p50_ms"], 1),
        "sandbox_overhead_ms_saturated": round(1e3 / sandbox - 1e3 / plain, 2),
        "throughput_ratio_sandbox_vs_plain": round(sandbox / plain, 3),
        "attempts_per_s_fork": round(sat["fork"]["attempts_per_s"], 2),
        "cpu_ms_per_attempt": {k: round(v["cpu_ms_per_attempt"], 1) for k, v in sat.items()},
        "openai_harness_cpu_ms_per_attempt": {
            k: round(v["cpu_ms_per_attempt"], 1) for k, v in raw["openai"].items()
        },
        "plain_own_uid_cpu_ms_per_attempt": {
            k: round(v["cpu_ms_per_attempt"], 1) for k, v in raw["uid"].items() if isinstance(v, dict)
        },
        "attempts_per_s_no_harness": round(sat["no-harness"]["attempts_per_s"], 2),  # control path alone
        "openai_harness_attempts_per_s_plain": round(raw["openai"]["plain"]["attempts_per_s"], 2),
        "openai_harness_attempts_per_s_fork": round(raw["openai"]["fork"]["attempts_per_s"], 2),
        "openai_harness_ratio_fork_vs_plain": round(
            raw["openai"]["fork"]["attempts_per_s"] / raw["openai"]["plain"]["attempts_per_s"], 2
        ),
        "openai_harness_attempts_per_s_sandbox": round(raw["openai"]["sandbox"]["attempts_per_s"], 2),
        "openai_harness_cpu_ratio_sandbox_fork_vs_fork": round(
            raw["openai"]["sandbox-fork"]["cpu_ms_per_attempt"] / raw["openai"]["fork"]["cpu_ms_per_attempt"],
            2,
        ),
        "openai_harness_ratio_sandbox_vs_fork": round(
            raw["openai"]["sandbox"]["attempts_per_s"] / raw["openai"]["fork"]["attempts_per_s"], 3
        ),
        "attempts_per_s_plain_own_uid": round(raw["uid"]["own-uid"]["attempts_per_s"], 2)
        if raw["uid"]
        else None,
        "attempts_per_s_plain_root_same_python": round(raw["uid"]["root"]["attempts_per_s"], 2)
        if raw["uid"]
        else None,
        "concurrency": args.concurrency,
        "attempts": args.attempts,
        "machine": f"{platform.machine()}, {platform.system()} {platform.release()}, {len(os.sched_getaffinity(0))} CPUs",
        "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],  # before, after: others' work
        "command": "make bench-controller",
        "raw": raw,
    }
    print(
        f"{'runner':<10}{'attempts/s @' + str(args.concurrency):>18}{'p50 ms @1':>12}{'p50 ms @' + str(args.concurrency):>14}"
    )
    for name in ("plain", "sandbox", "fork"):
        print(f"{name:<10}{sat[name]['attempts_per_s']:>18.1f}{seq[name]['latency_p50_ms']:>12.1f}"
              f"{sat[name]['latency_p50_ms']:>14.1f}")  # fmt: skip
    print(f"CPU per attempt (ms): {summary['cpu_ms_per_attempt']}; harness importing openai: "
          f"{summary['openai_harness_cpu_ms_per_attempt']}; plain as root / own uid: "
          f"{summary['plain_own_uid_cpu_ms_per_attempt']}")  # fmt: skip
    print(f"sandbox overhead per attempt: {summary['sandbox_overhead_ms']} ms alone, "
          f"{summary['sandbox_overhead_ms_saturated']} ms of wall time per attempt at saturation; "
          f"throughput ratio {summary['throughput_ratio_sandbox_vs_plain']}; the control path alone (no harness "
          f"process) does {summary['attempts_per_s_no_harness']} attempts/s")  # fmt: skip
    print(f"harness importing openai: plain {summary['openai_harness_attempts_per_s_plain']} attempts/s, "
          f"fork server {summary['openai_harness_attempts_per_s_fork']} attempts/s "
          f"({summary['openai_harness_ratio_fork_vs_plain']}x), sandboxed "
          f"{summary['openai_harness_attempts_per_s_sandbox']} attempts/s")  # fmt: skip
    if raw["uid"]:
        print(f"plain runner as root ({raw['uid']['python']}): {summary['attempts_per_s_plain_root_same_python']} "
              f"attempts/s as root, {summary['attempts_per_s_plain_own_uid']} with a uid of its own per attempt")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


def report_openai_only(args: argparse.Namespace, load_before: float) -> int:
    """`--openai-only`: CPU per attempt and attempts/s of the openai harness per runner, printed and
    written as JSON."""
    with tempfile.TemporaryDirectory(prefix="bench-controller-") as tmp:
        os.chmod(tmp, 0o711)
        raw = asyncio.run(openai_only(args.attempts, args.concurrency, Path(tmp), args.rounds))
    rounds = raw.pop("fork_rounds")
    cpu = {k: round(v["cpu_ms_per_attempt"], 1) for k, v in raw.items()}
    ratios = [s / f for f, s in zip(rounds["fork"], rounds["sandbox-fork"], strict=True)]
    summary = {
        "openai_harness_cpu_ms_per_attempt": cpu,
        "openai_harness_attempts_per_s": {k: round(v["attempts_per_s"], 2) for k, v in raw.items()},
        "openai_harness_cpu_ratio_sandbox_fork_vs_fork": round(cpu["sandbox-fork"] / cpu["fork"], 2),
        "fork_rounds_cpu_ms_per_attempt": {k: [round(v, 1) for v in vs] for k, vs in rounds.items()},
        "fork_rounds_ratio_sandbox_fork_vs_fork": [round(r, 2) for r in ratios],
        "fork_rounds_ratio_median": round(statistics.median(ratios), 2),
        "attempts": args.attempts,
        "concurrency": args.concurrency,
        "rounds": args.rounds,
        "machine": f"{platform.machine()}, {platform.system()} {platform.release()}, {len(os.sched_getaffinity(0))} CPUs",
        "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "command": f"python bench/controller.py --openai-only --attempts {args.attempts} --concurrency {args.concurrency} --rounds {args.rounds}",
        "raw": raw,
    }
    print(f"{'runner':<14}{'CPU ms/attempt':>16}{'attempts/s':>12}")
    for name in raw:
        print(f"{name:<14}{cpu[name]:>16.1f}{summary['openai_harness_attempts_per_s'][name]:>12.2f}")
    print(
        f"sandboxed fork / fork CPU per attempt: {summary['openai_harness_cpu_ratio_sandbox_fork_vs_fork']}x"
        f" (rounds: {summary['fork_rounds_ratio_sandbox_fork_vs_fork']}, median {summary['fork_rounds_ratio_median']}x)"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
