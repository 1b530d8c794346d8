"""`train.log_to`: TensorBoard, Weights & Biases (offline mode) and MLflow (a file store) get each step's
metrics and a table of sample completions, written by the real libraries and read back from the files
they leave: TensorBoard's event file, the W&B offline run's record log (its protobuf records), MLflow's
store through MLflow's own client. A failing tracker never costs metrics.jsonl a line."""

from __future__ import annotations

import glob
import json
import math
import struct
from pathlib import Path
from typing import Any

import pytest

from harnessrl.adapter import build_batch
from harnessrl.config import ConfigError, load_config
from harnessrl.store import SQLiteStore
from harnessrl.trainer.metrics import MetricsLogger
from harnessrl.trainer.trackers import SAMPLE_COLUMNS, TrackerError, make_trackers, sample_table
from tests.support.run_fixtures import Fixture

pytest.importorskip("wandb")
pytest.importorskip("mlflow")


def _samples(fixture_run: Fixture) -> list[list[Any]]:
    store = SQLiteStore(fixture_run.run_dir / "store.sqlite")
    try:
        details = [store.detail(r) for r in ("roaaaa1111", "roaaaa2222", "robbbb3333")]
    finally:
        store.close()
    return sample_table(1, details, build_batch(details), n=2)


def wandb_history(run_file: Path) -> list[dict[str, Any]]:
    """The history records of a W&B offline run file (`run-ID.wandb`): a 7-byte header, then LevelDB
    log records (32 KiB blocks, 7-byte record headers) holding `wandb_internal_pb2.Record` messages."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    pos, pending, records = 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            records.append(pending)
    out = []
    for raw in records:
        r = pb.Record()
        r.ParseFromString(raw)
        if r.WhichOneof("record_type") == "history":
            out.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item})
    return out


def test_trackers_write_their_files_offline(fixture_run: Fixture, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = _samples(fixture_run)
    assert [r[1] for r in rows] == ["roaaaa1111", "roaaaa2222"]  # one group: the first rollout, then in order
    assert all(len(r) == len(SAMPLE_COLUMNS) for r in rows)
    run_dir = tmp_path / "run"
    config = {"name": "calc", "train": {"lr": 2e-5, "steps": 2}}
    logger = MetricsLogger(
        run_dir, make_trackers(["tensorboard", "wandb", "mlflow"], run_dir, "runx1", "calc", config)
    )
    logger.log(1, {"reward": 0.25, "loss": 0.5, "kl": float("nan"), "breaks": {"retokenized": 1}, "ok": True})
    logger.log_samples(1, rows)
    logger.log(2, {"reward": 0.75, "loss": 0.25})
    logger.close()
    assert [json.loads(x)["reward"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [
        0.25,
        0.75,
    ]

    tb = EventAccumulator(str(run_dir / "tensorboard"))
    tb.Reload()
    assert [(e.step, e.value) for e in tb.Scalars("reward")] == [(1, 0.25), (2, 0.75)]
    assert "kl" not in tb.Tags()["scalars"]  # NaN is not a value

    (run_file,) = glob.glob(str(run_dir / "wandb" / "offline-run-*-runx1" / "run-runx1.wandb"))
    history = wandb_history(Path(run_file))
    steps = [(h["_step"], h.get("reward"), h.get("loss")) for h in history if "reward" in h]
    assert steps == [(1, 0.25, 0.5), (2, 0.75, 0.25)]
    (table,) = glob.glob(str(Path(run_file).parent / "files" / "media" / "table" / "samples_*.table.json"))
    saved = json.loads(Path(table).read_text())
    assert saved["columns"] == SAMPLE_COLUMNS and [r[1] for r in saved["data"]] == [r[1] for r in rows]

    client = MlflowClient((run_dir / "mlruns").resolve().as_uri())
    (exp,) = [e for e in client.search_experiments() if e.name == "calc"]
    (run,) = client.search_runs([exp.experiment_id])
    assert run.data.tags["harnessrl_run_id"] == "runx1" and run.data.params["train.lr"] == "2e-05"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "reward")] == [
        (1, 0.25),
        (2, 0.75),
    ]
    assert run.info.status == "FINISHED"
    artifact = Path(client.download_artifacts(run.info.run_id, "samples/step-0001.json", str(tmp_path)))
    table = json.loads(artifact.read_text())
    assert table["columns"] == SAMPLE_COLUMNS and [r[1] for r in table["data"]] == [r[1] for r in rows]

    again = make_trackers(["mlflow"], run_dir, "runx1", "calc", config)  # a resumed run: the same MLflow run
    assert again[0].run_id == run.info.run_id  # type: ignore[attr-defined]
    again[0].close()


def test_sample_table_spans_groups_and_carries_answers(fixture_run: Fixture) -> None:
    rows = _samples(fixture_run)
    by_id = {r[1]: dict(zip(SAMPLE_COLUMNS, r, strict=True)) for r in rows}
    a = by_id["roaaaa1111"]
    assert (a["step"], a["task_id"], a["reward"], a["calls"]) == (1, "add", 1.0, 3)
    assert math.isfinite(a["advantage"]) and a["advantage"] > 0
    assert a["completion"] == "The answer is 5." and a["prompt"] == "Summary: 2+3 is 5. Say it."


class Broken:
    name = "broken"

    def log(self, step: int, scalars: dict[str, float]) -> None:
        raise ConnectionError("tracker server gone")

    def log_samples(self, step: int, rows: list[list[Any]]) -> None:
        raise AssertionError("dropped trackers are not called again")

    def close(self) -> None:
        raise AssertionError("dropped trackers are not called again")


def test_a_failing_tracker_is_dropped_and_metrics_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    logger = MetricsLogger(tmp_path, [Broken()])
    logger.log(1, {"reward": 1.0})
    logger.log_samples(1, [])
    logger.log(2, {"reward": 0.5})
    logger.close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    assert "tracker_failed tracker=broken" in caplog.text and caplog.text.count("tracker_failed") == 1


def test_log_to_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from harnessrl.examples import example_config

    path = example_config("calc")
    assert load_config(path, ["train.log_to=[tensorboard,wandb,mlflow]"]).train.log_to == [
        "tensorboard",
        "wandb",
        "mlflow",
    ]
    assert load_config(path, []).train.log_to == ["tensorboard"]
    with pytest.raises(ConfigError, match="log_to"):
        load_config(path, ["train.log_to=[comet]"])
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a))
    with pytest.raises(
        ConfigError, match=r"wandb package is not installed: pip install 'harnessrl\[trackers\]'"
    ):
        load_config(path, ["train.log_to=[wandb]"])
    with pytest.raises(TrackerError, match="unknown tracker 'comet'"):
        make_trackers(["comet"], tmp_path, "r")


@pytest.mark.slow
def test_a_training_run_logs_to_all_three(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A real 1-step run (tiny model, the scaffold's harness) with `train.log_to` = all three."""
    import yaml

    import harnessrl
    from harnessrl.runs.scaffold import init_project

    init_project(tmp_path / "agent")
    run_dir = tmp_path / "run"
    small = {"engine.max_batch": 8, "engine.threads": 1, "gateway.default_max_tokens": 16, "controller.concurrency": 2,
             "controller.fork_server": False, "train.batch_groups": 2, "train.group_size": 2, "eval.n_heldout": 2,
             "train.steps": 1, "train.log_to": ["tensorboard", "wandb", "mlflow"]}  # fmt: skip
    harnessrl.train(tmp_path / "agent" / "config.yaml", engine={"model": str(tiny_model_dir)}, run_dir=str(run_dir),
                    **{k: yaml.safe_load(json.dumps(v)) for k, v in small.items()})  # fmt: skip
    (run_file,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert [h["_step"] for h in wandb_history(Path(run_file)) if "loss" in h] == [1]
    assert glob.glob(str(run_dir / "mlruns" / "*" / "*" / "metrics" / "loss"))
    assert glob.glob(str(run_dir / "mlruns" / "*" / "*" / "artifacts" / "samples" / "step-0001.json"))
    assert glob.glob(str(run_dir / "tensorboard" / "events.out.tfevents.*"))
