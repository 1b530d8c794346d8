"""The whole loop on the scale-out pieces: 2 gateway replicas on a PostgreSQL store (`store:
postgresql://…`, `gateway.replicas: 2`) and the update on 2 data-parallel trainer ranks
(`train.world_size: 2`), then a resume with 2 ranks."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import pytest

from harnessrl.config import load_config
from harnessrl.examples import get_example
from harnessrl.runs.flow import run
from harnessrl.services import free_port, start_gateway
from harnessrl.store.postgres import PostgresStore


@pytest.mark.slow  # about 1.5 minutes: pytest -m slow tests/e2e/test_scale_e2e.py
def test_demo_loop_on_postgres_with_two_gateway_replicas_and_two_trainer_ranks(
    tiny_model_dir: Path, tmp_path: Path, pg_url: str
) -> None:
    overrides = [
        f"run_dir={tmp_path / 'run'}", f"engine.model={tiny_model_dir}", f"store={pg_url}",
        "engine.max_batch=8", "engine.max_model_len=2048", "engine.threads=1",
        "train.steps=1", "train.batch_groups=2", "train.group_size=3", "train.checkpoint_every=1",
        "train.lr=1e-3", "train.world_size=2", "train.threads=1", "controller.concurrency=6",
        "eval.n_heldout=2", "data.n_train=30", "gateway.default_max_tokens=16", "gateway.replicas=2",
    ]  # fmt: skip
    cfg = load_config(get_example("calc").config_path, overrides)
    summary = run(cfg, fresh=True)
    run_dir = tmp_path / "run"
    assert summary["train_steps"] == 1 and not (run_dir / "store.sqlite").exists()
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert (
        records[0]["ranks"] == 2 and records[0]["rollouts_failed"] == 0 and records[0]["weight_version"] == 1
    )
    assert "event=rank_update rank=1" in (run_dir / "logs" / "trainer-rank1.log").read_text()
    assert (run_dir / "logs" / "gateway.log").exists() and (run_dir / "logs" / "gateway1.log").exists()
    store = PostgresStore(pg_url)  # the calls are in the database, with the weight version that served them
    try:
        trained = [ro for ro in store.list_rollouts(limit=1000)[0] if "step" in ro.metadata]
        assert len(trained) == 6
        assert all(c.weight_version == 0 for ro in trained for c in store.calls(ro.rollout_id))
        assert sum(store.count_calls(ro.rollout_id) for ro in trained) >= 6
    finally:
        store.close()

    cfg2 = load_config(get_example("calc").config_path, [*overrides, "train.steps=2"])
    seen: list[int] = []
    summary2 = run(cfg2, resume=True, on_step=lambda step, m: seen.append(step))
    assert seen == [2] and summary2["train_steps"] == 2
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and records[-1]["ranks"] == 2


@pytest.mark.slow  # about 1.5 minutes: pytest -m slow tests/e2e/test_scale_e2e.py
def test_a_run_on_gateways_it_did_not_start(
    tiny_model_dir: Path, tmp_path: Path, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`gateway.urls`: two gateways started outside the run (as a Kubernetes StatefulSet would), in front
    of the engine the run starts on a fixed port (`engine.port`) with the engine key they were started
    with ($HARNESSRL_ENGINE_KEY in theirs and the run's environment)."""
    admin, engine_key, port = secrets.token_hex(16), secrets.token_hex(16), free_port()
    upstream = f"http://127.0.0.1:{port}"
    gws = [start_gateway(pg_url, upstream, free_port(), admin, tmp_path / "gw-logs", 16, name=f"gateway{i}",
                         upstream_key=engine_key) for i in range(2)]  # fmt: skip
    try:
        for g in gws:
            g.wait_healthy(60)
        monkeypatch.setenv("HARNESSRL_ADMIN_KEY", admin)
        monkeypatch.setenv("HARNESSRL_ENGINE_KEY", engine_key)
        overrides = [
            f"run_dir={tmp_path / 'run'}", f"engine.model={tiny_model_dir}", f"store={pg_url}",
            f"engine.port={port}", "engine.max_batch=8", "engine.threads=1", "train.lr=1e-3",
            f"gateway.urls=[{gws[0].url}, {gws[1].url}]", "train.steps=1", "train.batch_groups=2",
            "train.group_size=3", "controller.concurrency=6", "eval.n_heldout=2", "data.n_train=30",
            "eval.extra_temperatures=[]",
        ]  # fmt: skip
        summary = run(load_config(get_example("calc").config_path, overrides), fresh=True)
        assert summary["train_steps"] == 1 and summary["rollouts_failed_total"] == 0
        records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert records[0]["weight_version"] == 1  # pause, publish, resume went through the two gateways
        assert not (tmp_path / "run" / "logs" / "gateway.log").exists()  # the run started no gateway
    finally:
        for g in gws:
            g.stop()
