"""The instruct example: each checker on known-good and known-bad texts, the generator's determinism and
split, the grader's fraction, the TRL-facing functions, and one real episode of the harness end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harnessrl.controller import AttemptResult
from harnessrl.examples import get_example
from harnessrl.examples.instruct import checkers, task
from harnessrl.examples.instruct.checkers import KINDS, check, compatible, count_sentences, describe
from harnessrl.schema import RolloutState, Task
from tests.support.gateway import GatewayHandle, run_example_episode

# (constraint, a text that meets it, a text that does not)
CASES: list[tuple[dict[str, object], str, str]] = [
    ({"kind": "words_max", "n": 5}, "Four words right here.", "This answer has far more than five words."),
    ({"kind": "words_min", "n": 5}, "This answer has at least five words.", "Too short."),
    ({"kind": "sentences_max", "n": 2}, "One sentence. Two sentences!", "One. Two. Three?"),
    ({"kind": "keywords_include", "words": ["water", "salt"]}, "Salt the water first.", "Boil the pot."),
    ({"kind": "keywords_exclude", "words": ["rain"]}, "Terrain is fine; rainy too.", "I like the Rain."),
    ({"kind": "bullets", "n": 3}, "* one\n* two\n* three", "* one\n* two\n* three\n* four"),
    ({"kind": "json_keys", "keys": ["mood", "title"]}, '```json\n{"title": "x", "mood": 1}\n```', '{"title": "x"}'),
    ({"kind": "sections", "n": 2}, "SECTION 1\nfirst\nSECTION 2\nsecond", "Section one\nfirst\nsecond"),
    ({"kind": "lowercase"}, "all quiet on the river, 3 boats.", "All quiet on the river."),
    ({"kind": "uppercase"}, "ALL QUIET ON THE RIVER, 3 BOATS.", "ALL QUIET on THE RIVER."),
    ({"kind": "end_phrase", "phrase": "That is all."}, "Trains are fast. that is all.", "That is all. Bye."),
    ({"kind": "no_commas"}, "No commas here.", "Well, one comma."),
    ({"kind": "title"}, "<<Morning Coffee>>\nIt is hot.", "Morning Coffee\nIt is hot."),
    ({"kind": "postscript", "marker": "P.S."}, "Bye.\n\nP.S. Water the plants.", "Bye. PS water the plants."),
    ({"kind": "start_word", "word": "Honestly"}, '"Honestly, dogs are great."', "Dogs are honestly great."),
]  # fmt: skip


def test_every_kind_has_a_known_good_and_bad_case() -> None:
    assert {str(c["kind"]) for c, _, _ in CASES} == set(KINDS)


@pytest.mark.parametrize(("constraint", "good", "bad"), CASES, ids=[str(c[0]["kind"]) for c in CASES])
def test_checker_on_known_good_and_bad_texts(constraint: dict[str, object], good: str, bad: str) -> None:
    assert check(good, constraint) is True
    assert check(bad, constraint) is False
    assert describe(constraint).endswith((".", '"'))


def test_checker_sources_are_as_documented() -> None:
    own = {k for k, v in KINDS.items() if v.source == checkers.OWN}
    assert own == {"sentences_max", "lowercase", "uppercase", "json_keys", "start_word"}
    for name in KINDS:
        assert f"`{name}`" in (checkers.__doc__ or "")
    with pytest.raises(ValueError, match="unknown constraint kind 'rhyme'"):
        check("x", {"kind": "rhyme"})


words = st.lists(st.from_regex(r"[a-z]{1,8}", fullmatch=True), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(st.lists(words, min_size=1, max_size=6), st.sampled_from([". ", "! ", "? ", ".\n"]))
def test_sentence_count_and_word_count(sentences: list[list[str]], sep: str) -> None:
    text = sep.join(" ".join(s) for s in sentences) + "."
    assert count_sentences(text) == len(sentences)
    n_words = sum(len(s) for s in sentences)
    assert check(text, {"kind": "words_max", "n": n_words + 1}) and not check(
        text, {"kind": "words_max", "n": n_words}
    )
    assert check(text, {"kind": "words_min", "n": n_words}) and not check(
        text, {"kind": "words_min", "n": n_words + 1}
    )
    assert check(text, {"kind": "lowercase"}) and not check(text, {"kind": "uppercase"})
    assert check(text.upper(), {"kind": "uppercase"}) and not check(text.upper(), {"kind": "lowercase"})
    assert check(text, {"kind": "sentences_max", "n": len(sentences)})


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.sampled_from(task.JSON_KEYS), st.text(max_size=10) | st.integers(), min_size=1))
def test_json_object_with_its_keys_passes_and_other_shapes_fail(obj: dict[str, object]) -> None:
    c = {"kind": "json_keys", "keys": sorted(obj)}
    assert check(json.dumps(obj), c) and check(f"```json\n{json.dumps(obj, indent=2)}\n```", c)
    assert not check(json.dumps([obj]), c)  # a list, not an object
    assert not check(json.dumps(obj) + " I hope this helps.", c)
    assert not check(json.dumps(obj), {"kind": "json_keys", "keys": [*sorted(obj), "zzz"]})


def test_compatibility_is_symmetric_and_excludes_contradictions() -> None:
    for a in KINDS:
        for b in KINDS:
            assert compatible(a, b) == compatible(b, a)
    assert not compatible("lowercase", "uppercase") and not compatible("bullets", "json_keys")
    assert not compatible("words_max", "words_min") and not compatible("json_keys", "no_commas")
    assert compatible("keywords_include", "keywords_exclude")


def test_splits_are_deterministic_disjoint_and_prefix_stable() -> None:
    train, held = task.build_splits(400, 60, seed=0)
    train2, held2 = task.build_splits(400, 60, seed=0)
    assert [(t.input, t.reference) for t in train + held] == [(t.input, t.reference) for t in train2 + held2]
    assert len(train) == 400 and len(held) == 60
    assert len({t.input["prompt"] for t in train}) == 400  # no duplicate prompts within a split
    assert not {t.input["prompt"] for t in train} & {t.input["prompt"] for t in held}
    bases = {t.input["prompt"].split(". ")[0] for t in train}
    assert not bases & {t.input["prompt"].split(". ")[0] for t in held}  # not even a base request shared
    small_train, small_held = task.build_splits(50, 10, seed=0)
    assert [t.input for t in small_train] == [t.input for t in train[:50]]
    assert [t.input for t in small_held] == [t.input for t in held[:10]]
    other, _ = task.build_splits(50, 0, seed=1)
    assert [t.input for t in other] != [t.input for t in small_train]


def test_generated_constraints_are_stated_compatible_and_varied() -> None:
    train, held = task.build_splits(500, 50, seed=0)
    seen: set[str] = set()
    for t in train + held:
        cs = t.reference["constraints"]
        assert 1 <= len(cs) <= 3 and "constraints" not in t.input  # the harness never sees the checkers
        kinds = [c["kind"] for c in cs]
        assert all(compatible(a, b) for i, a in enumerate(kinds) for b in kinds[i + 1 :])
        for c in cs:
            assert describe(c) in t.input["prompt"]
        included = {w for c in cs for w in c.get("words", []) if c["kind"] == "keywords_include"}
        excluded = {w for c in cs for w in c.get("words", []) if c["kind"] == "keywords_exclude"}
        assert not included & excluded
        seen.update(kinds)
    assert seen == set(KINDS)


def _result(tmp_path: Path, answer: dict[str, object] | None) -> AttemptResult:
    out = tmp_path / "output"
    out.mkdir(exist_ok=True)
    if answer is not None:
        (out / "answer.json").write_text(json.dumps(answer))
    return AttemptResult(exit_code=0, timed_out=False, output_dir=out, stdout_tail="", stderr_tail="")


def test_grader_reward_is_the_fraction_of_constraints_met(tmp_path: Path) -> None:
    constraints = [
        {"kind": "no_commas"},
        {"kind": "start_word", "word": "Yes"},
        {"kind": "keywords_include", "words": ["lantern"]},
    ]
    t = Task(task_id="t", input={"prompt": "p"}, reference={"constraints": constraints})
    reward = task.grade(t, _result(tmp_path, {"text": "Yes the moon is bright."}))
    assert reward.value == pytest.approx(2 / 3)
    assert [(c["kind"], c["passed"]) for c in reward.details["constraints"]] == [
        ("no_commas", True),
        ("start_word", True),
        ("keywords_include", False),
    ]
    assert reward.details["passed"] == 2 and reward.details["total"] == 3
    assert {c["source"] for c in reward.details["constraints"]} == {"own", "if-verifiable"}
    assert task.grade(t, _result(tmp_path, {"text": "Yes a lantern glows."})).value == 1.0
    assert task.grade(t, _result(tmp_path, {"text": "No, none."})).value == 0.0
    assert task.grade(t, _result(tmp_path, {"text": None})).value == 0.0
    (tmp_path / "output" / "answer.json").unlink()
    assert task.grade(t, _result(tmp_path, None)).details["reason"] == "no answer.json written"


def test_trl_functions_give_the_same_tasks_and_rewards_as_the_harness_path(tmp_path: Path) -> None:
    train, held = task.build_splits(20, 5, seed=3)
    rows = task.trl_dataset(20, seed=3)
    assert [r["prompt"] for r in rows] == [task.messages(t.input["prompt"]) for t in train]
    assert [r["constraints"] for r in rows] == [t.reference["constraints"] for t in train]
    assert [r["constraints"] for r in task.trl_dataset(5, seed=3, split="heldout")] == [
        t.reference["constraints"] for t in held
    ]
    texts = ["Yes, the sun is warm.", "<<Title>>\n* a\n* b", 'SECTION 1\n{"title": "x"}']
    for row, t, text in zip(rows, train, texts * 7, strict=False):
        graded = task.grade(t, _result(tmp_path, {"text": text})).value
        assert task.reward_text(row, text) == graded == task.reward_text(t.reference, text)
    as_chat = [[{"role": "assistant", "content": x}] for x in texts]
    cols = [r["constraints"] for r in rows[:3]]
    assert (
        task.grpo_reward(as_chat, cols)
        == task.grpo_reward(texts, cols)
        == [task.reward_text(r, x) for r, x in zip(rows, texts, strict=False)]
    )
    with pytest.raises(ValueError, match="split must be"):
        task.trl_dataset(1, split="test")


def test_harness_without_the_contract_env_says_so() -> None:
    harness = get_example("instruct").harness_command
    proc = subprocess.run(harness, capture_output=True, text=True, env={"PATH": "/usr/bin"}, timeout=60)
    assert proc.returncode == 2 and "HARNESSRL_TASK" in proc.stderr
    assert harness[0] == sys.executable


async def test_harness_runs_one_real_episode_end_to_end(
    make_gateway: Callable[..., GatewayHandle], tmp_path: Path
) -> None:
    example = get_example("instruct")
    assert example.config_path.is_file()
    gw = make_gateway(default_max_tokens=24)
    _, (t,) = example.build_splits(0, 1, 0)
    outcome, answer = await run_example_episode("instruct", gw, t, "instruct-e2e", tmp_path / "run")
    assert outcome.state == RolloutState.SUCCEEDED and outcome.reward is not None
    assert isinstance(answer["text"], str) and answer["finish_reason"] in ("stop", "length")
    assert outcome.reward == task.reward_text(t.reference, answer["text"])
    (call,) = gw.store.calls(outcome.rollout_id)  # single-turn: one call, with the TRL prompt's messages
    assert call.request["messages"] == task.messages(t.input["prompt"])
    assert call.completion_ids and len(call.completion_ids) <= 24


def test_cpu_and_gpu_configs_load() -> None:
    from harnessrl.config import load_config

    cpu = load_config(get_example("instruct").config_path, [])
    gpu = load_config(get_example("instruct").config_path.with_name("config_gpu.yaml"), [])
    assert cpu.name == gpu.name == "instruct"
    assert (cpu.engine.model, cpu.engine.kind, gpu.engine.kind) == ("smollm2", "builtin", "vllm")
    assert 128 <= cpu.gateway.default_max_tokens <= 200
