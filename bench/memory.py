"""`make bench-memory`: resident memory of the CPU demo, per process, before and after the memory work.

Runs the demo's workload (the calc example's config, a few steps: `train.steps=2 eval.n_heldout=8` by
default) in this process through `harnessrl.runs.flow.run`, while a sampler thread reads /proc every 0.2 s for
this process and all its descendants, identified by command line and parentage:

- trainer: this process (it hosts the run and the PPO update);
- engine: `python -m harnessrl.engine ...`; gateway: `python -m harnessrl.gateway ...`;
- fork_server: the fork server (`fork_zygote.py`) started by the controller; harness: everything below
  it or otherwise started for an attempt (forked harnesses, sandboxes, graders).

Per process: peak RSS (the larger of the samples and the kernel's VmHWM), steady RSS (median of the
samples in the last half of the process's life), peak PSS (proportional set size: shared pages split
between the processes sharing them, so PSS adds up over forked harnesses where RSS counts a page once
per process). Over the run: the largest process's peak RSS, and the peak of the simultaneous sums of
RSS and of PSS over all processes. Around every PPO update of the trainer: RSS before, peak during (VmHWM
reset before the update) and after, update seconds, and PyTorch's view: bytes of parameters, gradients,
optimizer state and packed oneDNN copies held after the update, and the activation bytes autograd
saved per micro-batch (saved-tensor hooks; tensors kept by a checkpointed region count by its inputs).

    python bench/memory.py --label after                          # this tree
    python bench/memory.py --baseline-ref 5a4d0e4 --label after   # also the tree at 5a4d0e4, as "before"
    python bench/memory.py --label make-demo --no-update-profile --summary runs/demo/summary.json \
        --command .venv/bin/harnessrl demo                        # `make demo` itself

With `--command` the given program is started as a child and sampled with its descendants (it is the
"trainer" role: `harnessrl demo` hosts the run and the update); the held-out figures are read from
`--summary` after it exits. Per-update figures need the in-process workload (not recorded then).

Each measurement then runs `bench/memory_update.py` (the PPO update alone on a fixed demo-shaped batch,
in a fresh process) for the same tree. Results merge into `bench/results/memory.json` under the label
(`runs`, `update_profile`); the top-level figures are the `after` label's (else the latest). A baseline
runs this same script against a `git worktree` of the ref (PYTHONPATH pointing at its `src/`, so the
run's engine and gateway processes are that tree's too).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memory_update import saved_activations, torch_view

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "bench" / "results" / "memory.json"
# the demo with 2 steps and 8 held-out tasks; a longer harness timeout so a loaded machine still trains
DEFAULT_OVERRIDES = ["train.steps=2", "eval.n_heldout=8", "controller.harness_timeout_s=1800"]
MB = 1024 * 1024
log = logging.getLogger("bench.memory")


def _status_kb(pid: int | str, *keys: str) -> dict[str, int]:
    """Fields of /proc/PID/status in kB (missing: absent from the result)."""
    out: dict[str, int] = {}
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in keys:
                out[name] = int(rest.split()[0])
    return out


def _pss_kb(pid: int) -> int | None:
    with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    return None


def _cmdline(pid: int) -> str:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    return ""


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process visible in /proc."""
    out: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{entry}/stat") as f:
                out[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
    return out


@dataclass
class Proc:
    """One sampled process."""

    pid: int
    role: str
    cmdline: str
    first_s: float
    last_s: float = 0.0
    hwm_kb: int = 0
    rss_kb: list[tuple[float, int]] = field(default_factory=list)
    pss_max_kb: int = 0

    def summary(self) -> dict[str, Any]:
        """Peak, steady and PSS figures in MB."""
        values = [r for _, r in self.rss_kb]
        mid = self.first_s + (self.last_s - self.first_s) / 2
        late = [r for t, r in self.rss_kb if t >= mid] or values
        return {
            "pid": self.pid,
            "role": self.role,
            "cmdline": self.cmdline[:160],
            "lifetime_s": round(self.last_s - self.first_s, 1),
            "peak_rss_mb": round(max([self.hwm_kb, *values]) / 1024, 1),
            "steady_rss_mb": round(statistics.median(late) / 1024, 1) if late else None,
            "peak_pss_mb": round(self.pss_max_kb / 1024, 1),
        }


class Sampler:
    """Samples RSS/PSS of `root` and its descendants every `interval_s` on a daemon thread."""

    def __init__(self, root: int, interval_s: float = 0.2) -> None:
        self.root, self.interval_s = root, interval_s
        self.t0 = time.monotonic()
        self.procs: dict[tuple[int, str], Proc] = {}
        self.sums: list[tuple[float, int, int]] = []  # (t, Σ RSS kB, Σ PSS kB)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="memory-sampler", daemon=True)
        self.lock = threading.Lock()

    def start(self) -> Sampler:
        """Start sampling."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sampling (one last sample is taken)."""
        self._stop.set()
        self._thread.join()

    def note_peak(self, pid: int, hwm_kb: int) -> None:
        """Record a VmHWM read just before someone resets it (`clear_refs`)."""
        with self.lock:
            for (p, _), proc in self.procs.items():
                if p == pid:
                    proc.hwm_kb = max(proc.hwm_kb, hwm_kb)

    def _role(self, pid: int, parents: dict[int, int], cmd: str) -> str:
        if pid == self.root or any(f"harnessrl {c}" in cmd for c in ("demo", "train")):
            return "trainer"
        if "harnessrl.engine" in cmd:
            return "engine"
        if "harnessrl.gateway" in cmd:
            return "gateway"
        if "fork_zygote" in cmd and "fork_zygote" not in _cmdline(parents.get(pid, 0)):
            return "fork_server"
        return "harness"

    def _descendants(self, parents: dict[int, int]) -> list[int]:
        children: dict[int, list[int]] = {}
        for pid, ppid in parents.items():
            children.setdefault(ppid, []).append(pid)
        out, todo = [], [self.root]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo.extend(children.get(pid, []))
        return out

    def sample(self) -> None:
        """Take one sample of every process of the tree."""
        now = time.monotonic() - self.t0
        parents = _parents()
        total_rss = total_pss = 0
        for pid in self._descendants(parents):
            st = _status_kb(pid, "VmRSS", "VmHWM")
            if "VmRSS" not in st:
                continue  # gone, or a kernel thread
            cmd = _cmdline(pid)
            pss = _pss_kb(pid)
            with self.lock:
                key = (pid, cmd)
                proc = self.procs.get(key)
                if proc is None:
                    proc = self.procs[key] = Proc(pid, self._role(pid, parents, cmd), cmd, now)
                proc.last_s = now
                proc.rss_kb.append((now, st["VmRSS"]))
                proc.hwm_kb = max(proc.hwm_kb, st.get("VmHWM", 0))
                proc.pss_max_kb = max(proc.pss_max_kb, pss or 0)
            total_rss += st["VmRSS"]
            total_pss += pss if pss is not None else st["VmRSS"]
        self.sums.append((now, total_rss, total_pss))

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)
        self.sample()

    def report(self) -> dict[str, Any]:
        """The figures of memory.json: per process and role, the run's peaks."""
        procs = [p.summary() for p in self.procs.values() if p.rss_kb]
        roles: dict[str, dict[str, Any]] = {}
        for role in ("trainer", "engine", "gateway", "fork_server", "harness"):
            mine = [p for p in procs if p["role"] == role]
            if not mine:
                continue
            if role == "harness":
                roles[role] = {
                    "processes": len(mine),
                    "peak_rss_mb": max(p["peak_rss_mb"] for p in mine),
                    "peak_pss_mb": max(p["peak_pss_mb"] for p in mine),
                    "steady_rss_mb": statistics.median(p["steady_rss_mb"] for p in mine),
                }
            else:
                roles[role] = max(mine, key=lambda p: p["peak_rss_mb"])
        return {
            "peak_rss_mb_largest_process": max(p["peak_rss_mb"] for p in procs),
            "peak_rss_mb_sum": round(max(s[1] for s in self.sums) / 1024, 1),
            "peak_pss_mb_sum": round(max(s[2] for s in self.sums) / 1024, 1),
            "per_process": roles,
            "processes_seen": len(procs),
        }


def clear_hwm(sampler: Sampler) -> None:
    """Reset this process's VmHWM (clear_refs 5), handing the old value to the sampler first."""
    sampler.note_peak(os.getpid(), _status_kb("self", "VmHWM").get("VmHWM", 0))
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def instrument_updates(sampler: Sampler, updates: list[dict[str, Any]]) -> None:
    """Wrap the trainer's `ppo_update` (as the loop calls it) and `micro_batch_loss` to record memory."""
    from harnessrl.trainer import loop, ppo

    orig_update: Callable[..., Any] = loop.ppo_update
    orig_loss: Callable[..., Any] = ppo.micro_batch_loss
    acts: list[float] = []
    exclude: set[int] = set()

    def loss(model: Any, *args: Any, **kwargs: Any) -> Any:
        with saved_activations(acts, exclude):
            return orig_loss(model, *args, **kwargs)

    def update(model: Any, optimizer: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        exclude.clear()
        exclude.update(p.untyped_storage().data_ptr() for p in model.parameters())
        acts.clear()
        clear_hwm(sampler)
        before = _status_kb("self", "VmRSS")["VmRSS"]
        t0 = time.perf_counter()
        out = orig_update(model, optimizer, batch, *args, **kwargs)
        seconds = time.perf_counter() - t0
        st = _status_kb("self", "VmRSS", "VmHWM")
        sampler.note_peak(os.getpid(), st["VmHWM"])
        updates.append({
            "rows": len(batch.rows), "tokens": sum(len(r.tokens) for r in batch.rows),
            "trainable_tokens": batch.n_trainable_tokens, "micro_batches": len(acts),
            "seconds": round(seconds, 1), "rss_before_mb": round(before / 1024, 1),
            "rss_peak_mb": round(st["VmHWM"] / 1024, 1), "rss_after_mb": round(st["VmRSS"] / 1024, 1),
            "saved_activations_mb_max": max(acts, default=0.0), "torch_after": torch_view(model, optimizer),
        })  # fmt: skip
        log.info("event=update_memory %s", updates[-1])
        return out

    loop.ppo_update = update  # type: ignore[assignment]
    ppo.micro_batch_loss = loss  # type: ignore[assignment]


def measure(overrides: list[str], run_dir: Path) -> dict[str, Any]:
    """Run the calc example with `overrides` under the sampler; the measurement's figures."""
    import harnessrl
    from harnessrl.config import load_config
    from harnessrl.examples import example_config
    from harnessrl.runs.flow import run
    from harnessrl.runs.rundir import Mode

    cfg = load_config(example_config("calc"), [*overrides, f"run_dir={run_dir}"])
    sampler = Sampler(os.getpid()).start()
    updates: list[dict[str, Any]] = []
    instrument_updates(sampler, updates)
    t0 = time.monotonic()
    try:
        summary = run(cfg, mode=Mode.REPLACE)
    finally:
        sampler.stop()
    return {
        **sampler.report(),
        "updates": updates,
        "wall_s": round(time.monotonic() - t0, 1),
        "heldout": {k: v for k, v in summary.items() if k.startswith("heldout_reward")},
        "harnessrl_src": str(Path(harnessrl.__file__).parent),
    }


def measure_command(command: list[str], summary: Path | None) -> dict[str, Any]:
    """Run `command` as a child process under the sampler (the child is the "trainer" role)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(command)
    sampler = Sampler(proc.pid).start()
    try:
        rc = proc.wait()
    finally:
        sampler.stop()
    if rc != 0:
        raise SystemExit(f"{' '.join(command)} exited with {rc}")
    data = json.loads(summary.read_text()) if summary is not None else {}
    return {
        **sampler.report(),
        "command": command,
        "wall_s": round(time.monotonic() - t0, 1),
        "heldout": {k: v for k, v in data.items() if k.startswith("heldout_reward")},
    }


def _commit(tree: Path) -> str:
    out = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--", "src"], capture_output=True, text=True)  # fmt: skip
    return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def run_baseline(ref: str, out: Path, overrides: list[str]) -> None:
    """This script against a worktree of `ref`, labelled "before"."""
    with tempfile.TemporaryDirectory(prefix="harnessrl-memory-base-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), ref], check=True)
        try:
            env = {**os.environ, "PYTHONPATH": str(tree / "src")}
            cmd = [sys.executable, __file__, "--label", "before", "--out", str(out), "--commit-of", str(tree)]
            subprocess.run([*cmd, "--", *overrides], check=True, env=env, cwd=tmp)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)


def write_result(out: Path, label: str, result: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Merge `result` under `label` into `out`; the top level repeats the newest label's figures."""
    data: dict[str, Any] = json.loads(out.read_text()) if out.is_file() else {}
    runs = data.get("runs", {})
    runs[label] = result
    data.setdefault("note", "RSS/PSS in MB per process of the demo's workload (bench/memory.py); TRL's "
                    "GRPOTrainer peak on the same task and machine class: 8 GB (issue 23)")  # fmt: skip
    data.setdefault("workload", {"config": "calc example", "overrides": overrides})
    data.update({
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        **{k: result[k] for k in ("peak_rss_mb_largest_process", "peak_rss_mb_sum", "peak_pss_mb_sum", "per_process")},
        "runs": runs,
    })  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2) + "\n")
    return data


def table(data: dict[str, Any]) -> str:
    """A markdown table of peak (steady) RSS per role and label."""
    labels = list(data["runs"])
    lines = ["| process | " + " | ".join(f"{lb} peak (steady) MB" for lb in labels) + " |",
             "|---|" + "---|" * len(labels)]  # fmt: skip
    for role in ("trainer", "engine", "gateway", "fork_server", "harness"):
        cells = []
        for lb in labels:
            p = data["runs"][lb]["per_process"].get(role)
            cells.append(f"{p['peak_rss_mb']:,.0f} ({p['steady_rss_mb']:,.0f})" if p else "–")
        lines.append(f"| {role} | " + " | ".join(cells) + " |")
    for key in ("peak_rss_mb_largest_process", "peak_rss_mb_sum", "peak_pss_mb_sum"):
        lines.append(f"| {key} | " + " | ".join(f"{data['runs'][lb][key]:,.0f}" for lb in labels) + " |")
    profiles = data.get("update_profile", {})
    for i in range(max((len(p["updates"]) for p in profiles.values()), default=0)):
        cells = []
        for lb in labels:
            u = profiles.get(lb, {}).get("updates", [])
            cells.append(f"{u[i]['rss_peak_mb']:,.0f} ({u[i]['rss_after_mb']:,.0f})" if i < len(u) else "–")
        lines.append(f"| update {i + 1} alone, peak (after) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command line: see the module docstring."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--label", default="after")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--baseline-ref", help="also measure the tree at this git ref, labelled 'before'")
    p.add_argument("--baseline-only", action="store_true", help="measure only the baseline")
    p.add_argument("--no-update-profile", action="store_true", help="skip bench/memory_update.py")
    p.add_argument("--commit-of", type=Path, default=REPO, help=argparse.SUPPRESS)
    p.add_argument("--command", nargs=argparse.REMAINDER, help="sample this program instead (last option)")
    p.add_argument(
        "--summary", type=Path, help="with --command: the run's summary.json, for held-out figures"
    )
    p.add_argument("overrides", nargs="*", default=DEFAULT_OVERRIDES, help="dotted config overrides")
    args = p.parse_args(argv)
    if args.command is not None and not args.command:
        p.error("--command needs a program")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.baseline_ref:
        run_baseline(args.baseline_ref, args.out.resolve(), args.overrides)
        if args.baseline_only:
            return 0
    if args.command:
        result = measure_command(args.command, args.summary)
    else:
        with tempfile.TemporaryDirectory(prefix="harnessrl-memory-") as tmp:
            result = measure(args.overrides, Path(tmp) / "run")
    result["commit"] = _commit(args.commit_of)
    data = write_result(args.out, args.label, result, args.overrides)
    if not args.no_update_profile:  # a fresh process, so its figures start from an empty heap
        script = Path(__file__).with_name("memory_update.py")
        subprocess.run(
            [sys.executable, str(script), "--out", str(args.out), "--label", args.label], check=True
        )
        data = json.loads(args.out.read_text())
    sys.stdout.write(table(data) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
