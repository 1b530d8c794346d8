"""A controller in its own process, for the kill -9 / restart test: runs N rollouts of a harness that
logs its starts and ends, with a slow grader, against the gateway given on the command line."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from harnessrl.controller import AttemptResult, Controller, HarnessSpec, RolloutRequest
from harnessrl.gateway.client import ControlClient
from harnessrl.schema import RewardIn, Task

HARNESS = r"""
import json, os, subprocess, sys, time
rid = os.environ["HARNESSRL_ROLLOUT_ID"]
task = json.load(open(os.environ["HARNESSRL_TASK"]))
log = task["log"]
first = not os.path.exists(os.path.join(log, "seen-" + rid))
open(os.path.join(log, "seen-" + rid), "a").close()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # a tool process
with open(os.path.join(log, "events.log"), "a") as f:
    f.write(f"start {rid} {os.getpid()} {child.pid}\n")
time.sleep(task["first_s"] if first else 0.2)
json.dump({"answer": 42}, open(os.path.join(os.environ["HARNESSRL_OUTPUT"], "answer.json"), "w"))
with open(os.path.join(log, "events.log"), "a") as f:
    f.write(f"end {rid}\n")
child.kill()
"""


def grader(task: Task, result: AttemptResult) -> RewardIn:
    """Slow (so a kill can land while grading); 1 if the harness wrote its answer."""
    time.sleep(float(task.input["grade_s"]))
    return RewardIn(value=float((result.output_dir / "answer.json").exists()))


async def main(gateway_url: str, admin_key: str, run_dir: Path, log_dir: Path, n: int) -> None:
    """Run rollouts 0..n-1: even ones finish fast and grade slowly, odd ones run long the first time."""
    harness_file = run_dir / "harness.py"
    harness_file.write_text(HARNESS)
    client = ControlClient(gateway_url, admin_key)
    ctl = Controller(client, gateway_url, HarnessSpec([sys.executable, str(harness_file)], timeout_s=120),
                     grader, run_dir, concurrency=n, max_attempts=3, grader_timeout_s=60)  # fmt: skip
    reqs = [
        RolloutRequest(
            Task(
                task_id=f"t{i}",
                input={
                    "log": str(log_dir),
                    "first_s": 0.1 if i % 2 == 0 else 60,
                    "grade_s": 4 if i % 2 == 0 else 0,
                },
            ),
            client_id=f"restart-{i}",
        )
        for i in range(n)
    ]
    outcomes = await ctl.run(reqs)
    await client.aclose()
    print(" ".join(f"{o.rollout_id}={o.state}:{o.reward}" for o in outcomes), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5])))
