"""Step rewards end to end: a real harness process makes two model calls through the gateway (a real
engine serving a tiny model), annotates its first call with its rollout key over HTTP, a grader returns
step rewards, and the rollouts read back over the control API become rows with per-token advantages."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import httpx

from harnessrl.adapter import Credit, Estimator, build_batch
from harnessrl.controller import Controller, HarnessSpec, RolloutRequest
from harnessrl.controller.runner import AttemptResult
from harnessrl.gateway.client import ControlClient
from harnessrl.schema import RewardIn, SamplingOverrides, StepReward, Task
from tests.support.gateway import GatewayHandle

HARNESS = r"""
import json, os, urllib.request
base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
task = json.load(open(os.environ["HARNESSRL_TASK"]))

def post(path, body):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": "Bearer " + key, "Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req))

messages = [{"role": "user", "content": "count"}]
for _ in range(2):
    answer = post("/chat/completions", {"model": "gpt-4o", "messages": messages, "max_tokens": 4})
    messages += [answer["choices"][0]["message"], {"role": "user", "content": "more"}]
post("/harnessrl/annotations", {"call": 0, "value": task["note"], "label": "first"})
"""


def grader(task: Task, result: AttemptResult) -> RewardIn:
    """Rollout reward from the task; a step reward on the second call."""
    return RewardIn(value=task.reference["reward"], steps=[StepReward(call=1, value=task.reference["step"])])


async def test_grader_steps_and_allowed_annotations_reach_the_rows(
    make_gateway: Callable[..., GatewayHandle], tmp_path: Path
) -> None:
    gw = make_gateway()
    client = ControlClient(gw.url, gw.admin_key)
    ctl = Controller(client, gw.url, HarnessSpec([sys.executable, "-c", HARNESS], timeout_s=60), grader,
                     tmp_path / "run", concurrency=4)  # fmt: skip

    def request(
        name: str, group: str, reward: float, step: float, note: float, allow: bool
    ) -> RolloutRequest:
        task = Task(task_id=group, input={"note": note}, reference={"reward": reward, "step": step},
                    allow_annotation_rewards=allow)  # fmt: skip
        return RolloutRequest(task, name, group_id=group, sampling=SamplingOverrides(temperature=1.0, seed=1))

    try:
        outcomes = await ctl.run([
            request("a", "allowed", 1.0, 2.0, 1.0, True), request("b", "allowed", 0.0, 0.0, 0.0, True),
            request("c", "data-only", 1.0, 2.0, 1.0, False), request("d", "data-only", 0.0, 0.0, 0.0, False),
        ])  # fmt: skip
        details = [await client.rollout(o.rollout_id) for o in outcomes]
    finally:
        await client.aclose()
    assert [len(d.calls) for d in details] == [2, 2, 2, 2]
    assert all(d.reward is not None and len(d.reward.steps) == 1 for d in details)
    assert [(d.annotations[0].label, d.annotations[0].value) for d in details] == [
        ("first", 1.0),
        ("first", 0.0),
        ("first", 1.0),
        ("first", 0.0),
    ]
    batch = build_batch(details, estimator=Estimator.DR_GRPO, credit=Credit.STEP)
    assert batch.token_advantages is not None
    rid = {o.rollout_id: name for o, name in zip(outcomes, "abcd", strict=True)}
    expected = {  # Dr.GRPO A = ±0.5; step 1 terms ±1 (grader); step 0 terms ±0.5 only where allowed
        "a": (0.5 + 0.5, 0.5 + 1.0), "b": (-0.5 - 0.5, -0.5 - 1.0),
        "c": (0.5, 0.5 + 1.0), "d": (-0.5, -0.5 - 1.0),
    }  # fmt: skip
    for i, row in enumerate(batch.rows):
        d = next(d for d in details if d.rollout.rollout_id == row.rollout_id)
        c0, c1 = d.calls
        assert len(row.call_ids) == 2  # the two calls merged into one row
        toks = batch.token_advantages[i]
        first = toks[len(c0.prompt_ids) : len(c0.prompt_ids) + len(c0.completion_ids)]
        second = toks[len(c1.prompt_ids) : len(c1.prompt_ids) + len(c1.completion_ids)]
        want0, want1 = expected[rid[row.rollout_id]]
        assert set(first) == {want0} and set(second) == {want1}
    assert batch.steps.ignored_annotations == 2 and batch.steps.from_annotations == 2


def test_annotation_errors_name_the_field(make_gateway: Callable[..., GatewayHandle]) -> None:
    gw = make_gateway()
    rid, key = gw.new_rollout()
    with httpx.Client(base_url=gw.url, headers={"Authorization": f"Bearer {key}"}) as c:
        r = c.post("/v1/harnessrl/annotations", json={"call": 0, "label": "x"})
        assert r.status_code == 400 and "call" in r.text and "0 calls" in r.text
        r = c.post("/v1/harnessrl/annotations", json={"call": 0, "tool_call_id": "t", "value": 1})
        assert r.status_code == 400 and "exactly one" in r.text
        r = c.post(
            f"/r/{rid}/v1/harnessrl/annotations", json={"tool_call_id": "t", "value": 1, "label": "ok"}
        )
        assert r.status_code == 200 and r.json()["tool_call_id"] == "t"
        r = c.post("/v1/harnessrl/annotations", content=b'{"tool_call_id": "t", "value": 1e999}')
        assert r.status_code == 400
    r = httpx.post(f"{gw.url}/v1/harnessrl/annotations", json={"tool_call_id": "t"},
                   headers={"Authorization": "Bearer wrong"})  # fmt: skip
    assert r.status_code == 401
    assert [a.label for a in gw.store.annotations(rid)] == ["ok"]
    assert json.loads(gw.store.annotations(rid)[0].model_dump_json())["rollout_id"] == rid
