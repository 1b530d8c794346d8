"""Probing the current model on tasks: K rollouts per task through the real harness, gateway and
grader (the controller machinery of an evaluation), counting the solved ones (reward 1.0).

`probe_with_gateway` needs a running gateway; `probe_solve_counts` starts the engine and gateway of a
run config (as `harnessrl train` does), probes, and stops them."""

from __future__ import annotations

import asyncio
import secrets
from collections import Counter
from pathlib import Path

from harnessrl.controller import Controller, HarnessSpec, sibling_requests
from harnessrl.controller.factory import make_runner
from harnessrl.controller.runner import Runner
from harnessrl.gateway.client import ControlClient
from harnessrl.schema import GuardPolicy, SamplingOverrides, Task

SOLVED = 1.0


async def probe_with_gateway(
    tasks: list[Task],
    k: int,
    gateway_url: str,
    admin_key: str,
    run_dir: Path,
    runner: Runner | None = None,
    temperature: float = 1.0,
    concurrency: int = 4,
    timeout_s: float = 600.0,
    max_tokens: int | None = None,
    guard: GuardPolicy | None = None,
) -> dict[str, int]:
    """{task id: how many of its `k` rollouts scored 1.0} with the coding harness and grader (under
    the run's `guard`, the config's `RunConfig.guard()`)."""
    from harnessrl.examples import get_example

    example = get_example("coding")
    client = ControlClient(gateway_url, admin_key)
    tag = secrets.token_hex(4)
    sampling = SamplingOverrides(temperature=temperature, max_tokens=max_tokens)
    requests = [r for t in tasks for r in sibling_requests(t, f"probe-{tag}", k, sampling, {"probe": tag})]
    try:
        controller = Controller(client, gateway_url, HarnessSpec(example.harness_command, timeout_s=timeout_s),
                                example.grader, run_dir, concurrency=concurrency, runner=runner,
                                guard=guard)  # fmt: skip
        outcomes = await controller.run(requests)
    finally:
        await client.aclose()
    solved = Counter(o.task_id for o in outcomes if o.reward is not None and o.reward >= SOLVED)
    return {t.task_id: solved.get(t.task_id, 0) for t in tasks}


def probe_solve_counts(
    tasks: list[Task], config_path: Path, k: int, run_dir: Path | None = None
) -> dict[str, int]:
    """Start the engine and gateway of the run config at `config_path`, probe `k` times per task
    with its controller settings (sandbox included), stop them; returns the solve counts."""
    from harnessrl.config import load_config
    from harnessrl.modeling.loading import resolve_model
    from harnessrl.services.stack import start_services

    cfg = load_config(config_path)
    run_dir = (run_dir or Path(cfg.run_dir) / "probe").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    admin_key = secrets.token_hex(16)
    stack = start_services(cfg, run_dir, resolve_model(cfg.engine.model), admin_key)
    gateway_url = stack.gateway_urls[0]  # the first replica serves every request here
    runner = make_runner(cfg.controller)
    try:
        return asyncio.run(
            probe_with_gateway(
                tasks,
                k,
                gateway_url,
                admin_key,
                run_dir,
                runner=runner,
                temperature=cfg.train.temperature,
                concurrency=cfg.controller.concurrency,
                timeout_s=cfg.controller.harness_timeout_s,
                guard=cfg.guard(),
            )
        )
    finally:
        runner.close()
        stack.stop()
