"""Real clients against the gateway (tiny model, real tokenizer): the openai SDK (async), LiteLLM,
langchain-openai and the OpenAI Agents SDK (Responses and Chat Completions models). Each test checks
that every call was recorded with token IDs that decode to what the client received."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
from openai import AsyncOpenAI

from tests.support.compat_helpers import assert_tokens_match_answers
from tests.support.gateway import GatewayHandle

TOOL = {"type": "function", "function": {"name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}  # fmt: skip


async def test_openai_async_client_concurrent_calls(
    make_gateway: Callable[..., GatewayHandle], tiny_model_dir: Path
) -> None:
    gw = make_gateway()
    rid, key = gw.new_rollout()
    client = AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)
    replies = await asyncio.gather(*(
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"q{i}"}], tools=[TOOL],  # type: ignore[list-item]
                                       max_tokens=6)
        for i in range(4)
    ))  # fmt: skip
    calls = gw.store.calls(rid)
    assert len(calls) == 4 and {c.response["id"] for c in calls} == {r.id for r in replies}  # type: ignore[index]
    assert_tokens_match_answers(calls, tiny_model_dir)
    await client.close()


def test_litellm(make_gateway: Callable[..., GatewayHandle], tiny_model_dir: Path) -> None:
    litellm = pytest.importorskip("litellm")
    gw = make_gateway()
    rid, key = gw.new_rollout()
    resp = litellm.completion(model="openai/gpt-4o-mini", api_base=f"{gw.url}/v1", api_key=key,
                              messages=[{"role": "user", "content": "hello"}], tools=[TOOL], max_tokens=6)  # fmt: skip
    calls = gw.store.calls(rid)
    assert len(calls) == 1 and (resp.choices[0].message.content or "") == (
        calls[0].chat["answer"]["content"] or ""
    )  # type: ignore[index]
    assert_tokens_match_answers(calls, tiny_model_dir)


def test_langchain_openai(make_gateway: Callable[..., GatewayHandle], tiny_model_dir: Path) -> None:
    lc = pytest.importorskip("langchain_openai")
    gw = make_gateway()
    rid, key = gw.new_rollout()
    llm = lc.ChatOpenAI(model="gpt-4o", base_url=f"{gw.url}/v1", api_key=key, max_tokens=6, max_retries=0)
    msg = llm.bind_tools([TOOL]).invoke("What is 2 + 3?")
    chunks = list(llm.stream("Say hi"))
    calls = gw.store.calls(rid)
    assert len(calls) == 2
    assert msg.content == (calls[0].chat["answer"]["content"] or "")  # type: ignore[index]
    assert "".join(str(c.content) for c in chunks) == (calls[1].chat["answer"]["content"] or "")  # type: ignore[index]
    assert_tokens_match_answers(calls, tiny_model_dir)


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
async def test_openai_agents_sdk(
    make_gateway: Callable[..., GatewayHandle], tiny_model_dir: Path, api: str
) -> None:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    gw = make_gateway()
    # the random tiny model rarely ends a turn: stop strings end it, so responses complete
    rid, key = gw.new_rollout(sampling={"max_tokens": 32, "stop": [" ", "\n", "e", "a", "o", "t", "i"]})
    client = AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)
    model_cls = agents.OpenAIResponsesModel if api == "responses" else agents.OpenAIChatCompletionsModel

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    agent = agents.Agent(name="calc", instructions="Use the add tool.", tools=[add],
                         model=model_cls(model="gpt-4.1", openai_client=client))  # fmt: skip
    result = await agents.Runner.run(agent, "What is 2 + 3?", max_turns=3)
    calls = gw.store.calls(rid)
    assert calls and all(c.face == f"openai.{'responses' if api == 'responses' else 'chat'}" for c in calls)
    assert str(result.final_output) == (calls[-1].chat["answer"]["content"] or "")  # type: ignore[index]
    assert_tokens_match_answers(calls, tiny_model_dir)
    await client.close()


async def test_mini_swe_agent_runs_its_own_loop_through_the_controller(
    make_gateway: Callable[..., GatewayHandle], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The real `mini` CLI as the harness: its own agent loop, pointed at the gateway by the contract's
    base URL and key (LiteLLM underneath), in a temp work directory."""
    pytest.importorskip("minisweagent")
    import sys

    from harnessrl.controller import AttemptResult, Controller, HarnessSpec, RolloutRequest
    from harnessrl.gateway.client import ControlClient
    from harnessrl.schema import RewardIn, RolloutState, SamplingOverrides, Task

    gw = make_gateway()
    env = {"MSWEA_CONFIGURED": "true", "MSWEA_COST_TRACKING": "ignore_errors", "MSWEA_SILENT_STARTUP": "1",
           "MSWEA_GLOBAL_CONFIG_DIR": str(tmp_path / "mswea"), "LITELLM_LOCAL_MODEL_COST_MAP": "True"}  # fmt: skip
    command = [sys.executable, "-m", "minisweagent.run.mini", "-m", "openai/gpt-4o-mini", "-y", "--exit-immediately",
               "-l", "0", "-c", "mini.yaml", "-c", "agent.step_limit=3", "-o", "traj.json",
               "-t", "Create a file hello.txt that contains the word hello."]  # fmt: skip

    def grade(task: Task, result: AttemptResult) -> RewardIn:
        hello = result.output_dir.parent / "hello.txt"
        return RewardIn(value=float(hello.exists() and "hello" in hello.read_text()))

    client = ControlClient(gw.url, gw.admin_key)
    ctl = Controller(client, gw.url, HarnessSpec(command, timeout_s=300, env=env), grade, tmp_path / "run")
    request = RolloutRequest(Task(task_id="hello", input={}), client_id="mswea-1",
                             sampling=SamplingOverrides(max_tokens=24))  # fmt: skip
    (outcome,) = await ctl.run([request])
    await client.aclose()
    assert outcome.state == RolloutState.SUCCEEDED and outcome.reward == 0.0  # a random model writes no file
    calls = gw.store.calls(outcome.rollout_id)
    assert len(calls) >= 2, "mini-swe-agent should have retried after format errors"
    assert all(c.chat is not None and c.chat["tools"] for c in calls)  # its bash tool reached the model
    attempt_dir = tmp_path / "run" / "rollouts" / outcome.rollout_id / "attempt-0"
    assert (attempt_dir / "home" / "traj.json").exists()  # its own trajectory, in its working directory
    assert_tokens_match_answers(calls, tiny_model_dir)
