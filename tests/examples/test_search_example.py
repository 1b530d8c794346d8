"""The `search` example: the generated knowledge base and questions, BM25, the grader, and one real
episode of the harness through a real gateway and engine (tiny random model, real tokenizer)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from harnessrl.controller.runner import AttemptResult
from harnessrl.examples import get_example
from harnessrl.examples.search.bm25 import BM25, tokenize
from harnessrl.examples.search.corpus import RELATIONS, RESERVED_WORDS, build_kb, follow
from harnessrl.examples.search.harness import Searcher, final_answer, run_tool
from harnessrl.examples.search.task import build_splits, exact_match, make_grader, token_f1
from harnessrl.schema import RolloutState, Task
from tests.support.gateway import GatewayHandle, run_example_episode


def test_generation_is_deterministic_and_splits_are_disjoint() -> None:
    train, held = build_splits(400, 60, seed=0)
    train2, held2 = build_splits(400, 60, seed=0)
    assert [t.model_dump() for t in train + held] == [t.model_dump() for t in train2 + held2]
    assert len(train) == 400 and len(held) == 60
    _, held_small = build_splits(10, 60, seed=0)
    assert [t.input for t in held_small] == [t.input for t in held]  # held-out does not depend on n_train
    train_q, held_q = [t.input["question"] for t in train], [t.input["question"] for t in held]
    assert len(set(train_q)) == len(train_q) and len(set(held_q)) == len(held_q)
    assert not set(train_q) & set(held_q)
    assert all("answer" not in t.input for t in train + held)  # the harness never sees the answer
    assert {t.reference["hops"] for t in train} == {1, 2, 3, 4}
    assert build_kb(1).documents() != build_kb(0).documents()


def test_every_question_is_answerable_by_following_its_hops_through_bm25() -> None:
    """A reference solver: search each hop's entity by name, read the next name from the top document."""
    kb = build_kb(0)
    search = Searcher(kb_seed=0, top_k=1)
    train, held = build_splits(300, 60, seed=0)
    for t in train + held:
        chain = t.reference["chain"]
        current = chain[0][0]
        assert current in t.input["question"]
        for name, relation in chain:
            assert name == current
            ((title, text),) = search(current)
            assert title == current  # the search finds the entity's own document
            current = follow(kb, current, [relation])
            assert current in text  # the document states the hop (a name or a value)
        assert current == t.reference["answer"]
        assert current not in t.input["question"]


def test_names_are_invented_and_bm25_ranks_each_entitys_own_document_first() -> None:
    kb = build_kb(0)
    docs = kb.documents()
    index = BM25([text for _, text in docs])
    for i, (title, _) in enumerate(docs):
        assert index.search(title, k=1)[0][0] == i, title
    words = {w for title, _ in docs for w in tokenize(title)}
    assert not words & RESERVED_WORDS  # the harness's worked examples never name a real entity
    assert len({t for t, _ in docs}) == len(docs)
    assert index.search("zzzz qqqq") == []
    assert {e.kind for e in kb.entities.values()} == {r.source for r in RELATIONS.values()} | {"sea"}


def test_bm25_prefers_rare_terms_and_short_documents() -> None:
    index = BM25(["apple banana", "apple apple cherry date elder fig", "banana banana", "cherry"])
    assert [i for i, _ in index.search("apple", k=4)] == [0, 1]
    assert index.search("cherry", k=1)[0][0] == 3  # same term count, shorter document wins
    assert index.search("Banana!", k=1)[0][0] == 2


def _result(tmp_path: Path, answer: object) -> AttemptResult:
    out = tmp_path / "output"
    out.mkdir(exist_ok=True)
    (out / "answer.json").unlink(missing_ok=True)
    if answer is not None:
        (out / "answer.json").write_text(json.dumps({"answer": answer, "tool_calls": 2}))
    return AttemptResult(exit_code=0, timed_out=False, output_dir=out, stdout_tail="", stderr_tail="")


def test_grader_on_known_good_and_bad_answers(tmp_path: Path) -> None:
    task = Task(task_id="t", input={"question": "q"}, reference={"answer": "Ravel River", "hops": 2})
    f1, exact = make_grader("f1"), make_grader("exact")
    for good in ("Ravel River", "the Ravel River.", "ravel"):
        assert f1(task, _result(tmp_path, good)).value == 1.0 == exact(task, _result(tmp_path, good)).value
    for bad in ("Belmora", "", 42, None):
        assert f1(task, _result(tmp_path, bad)).value == 0.0 == exact(task, _result(tmp_path, bad)).value
    person = Task(task_id="p", input={"question": "q"}, reference={"answer": "Tamar Okelu", "hops": 1})
    partial = f1(person, _result(tmp_path, "Tamar Vint"))
    assert partial.value == pytest.approx(0.5) and exact(person, _result(tmp_path, "Tamar Vint")).value == 0.0
    assert (
        partial.details["hops"] == 1
        and partial.details["tool_calls"] == 2
        and partial.details["exact"] == 0.0
    )
    assert token_f1("Tamar Okelu was born here", "Tamar Okelu") == pytest.approx(
        2 * 0.4 / 1.4
    )  # precision 2/5, recall 1
    assert exact_match("THE answer", "answer") == 1.0
    with pytest.raises(ValueError, match="metric"):
        make_grader("bleu")  # type: ignore[arg-type]


def test_harness_tool_and_answer_parsing() -> None:
    search = Searcher(kb_seed=0, top_k=2)
    title = next(iter(build_kb(0).entities))
    result, query = run_tool(search, "search", json.dumps({"query": title}))
    assert query == title and result.startswith(f"[1] {title}: ")
    assert run_tool(search, "search", "not json")[0].startswith("error:")
    assert run_tool(search, "browse", "{}")[0].startswith("error: unknown tool")
    assert run_tool(search, "search", '{"query": "qqqq"}')[0] == "No results."
    assert final_answer("Moro Vint was born in Quarl. The answer is Quarl.") == "Quarl"
    assert final_answer("Answer: Frenn Labs\nmore") == "Frenn Labs"
    assert final_answer("Quarl") == "Quarl" and final_answer("  ") is None and final_answer(None) is None


async def test_harness_runs_one_real_episode(
    make_gateway: Callable[..., GatewayHandle], tmp_path: Path
) -> None:
    """The real harness as a subprocess, through a real gateway to the engine's tiny random model."""
    gw = make_gateway()
    _, held = get_example("search").build_splits(0, 1, 0)
    outcome, answer = await run_example_episode("search", gw, held[0], "search-e2e", tmp_path / "run")
    assert outcome.state == RolloutState.SUCCEEDED and outcome.reward is not None
    assert {"answer", "tool_calls", "queries", "stop"} <= set(answer)
    calls = gw.store.calls(outcome.rollout_id)
    assert len(calls) >= 1 and all(c.completion_ids for c in calls)
    reward = gw.store.get_reward(outcome.rollout_id)
    assert reward is not None and reward.details["hops"] == held[0].reference["hops"]
