"""Experiment trackers beside `metrics.jsonl`: TensorBoard, Weights & Biases, MLflow (`train.log_to`).

Each tracker gets every step's scalar metrics and, as TRL and verl log them, a table of sample
completions: a few rollouts of the step with their task, reward, advantage, last prompt message and
final answer (`sample_table`). All of them work without a network: TensorBoard writes event files to
`RUN_DIR/tensorboard`; Weights & Biases runs in offline mode by default (`train.wandb_mode`, files in
`RUN_DIR/wandb`, uploaded later with `wandb sync`); MLflow writes to a file store in `RUN_DIR/mlruns`
unless `train.mlflow_tracking_uri` names a server. A tracker that fails while training is reported once
in the log and dropped: the metrics in `metrics.jsonl` are never lost to it.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from harnessrl.adapter import Batch
from harnessrl.schema import RolloutDetail

log = logging.getLogger(__name__)

TRACKERS = ("tensorboard", "wandb", "mlflow")
SAMPLE_COLUMNS = ["step", "rollout_id", "task_id", "reward", "advantage", "calls", "prompt", "completion"]
SAMPLE_TEXT_CHARS = 2000  # prompt and completion cells are cut to this many characters


class TrackerError(RuntimeError):
    """A tracker that cannot start (its package is missing, its store unreachable); the message says how
    to fix it."""


class Tracker(Protocol):
    """Where a step's metrics and sample completions go besides metrics.jsonl."""

    name: str

    def log(self, step: int, scalars: dict[str, float]) -> None:
        """Record the finite scalar metrics of one step."""

    def log_samples(self, step: int, rows: list[list[Any]]) -> None:
        """Record the sample table of one step (rows of `SAMPLE_COLUMNS`)."""

    def close(self) -> None:
        """Flush and finish."""


def scalars(values: dict[str, Any]) -> dict[str, float]:
    """The finite numbers among a step's metrics (booleans and nested values left out)."""
    return {k: float(v) for k, v in values.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}  # fmt: skip


def _text(content: Any) -> str:
    if isinstance(content, list):
        content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content or "")[:SAMPLE_TEXT_CHARS]


def sample_table(step: int, details: list[RolloutDetail], batch: Batch, n: int) -> list[list[Any]]:
    """Up to `n` graded rollouts of a step as table rows: the first of each group first (so the table
    spans tasks), with the last prompt message and the final answer of the rollout's last call."""
    adv: dict[str, float] = {}
    for row, a in zip(batch.rows, batch.advantages, strict=True):
        adv.setdefault(row.rollout_id, a)
    graded = [d for d in details if d.rollout.rollout_id in batch.rewards]
    firsts: dict[str, RolloutDetail] = {}
    for d in graded:
        firsts.setdefault(d.rollout.group_id or d.rollout.rollout_id, d)
    ordered = [*firsts.values(), *(d for d in graded if d not in firsts.values())]
    out = []
    for d in ordered[:n]:
        rid = d.rollout.rollout_id
        prompt, completion = "", ""
        if d.calls:
            messages, _, answer = d.calls[-1].conversation()
            prompt = _text(messages[-1].get("content")) if messages and isinstance(messages[-1], dict) else ""
            completion = _text((answer or {}).get("content"))
            for tc in (answer or {}).get("tool_calls") or []:
                fn = tc.get("function", {}) if isinstance(tc, dict) else {}
                completion += f"\n[tool call] {fn.get('name')}({fn.get('arguments')})"
        out.append(
            [step, rid, d.rollout.task_id, batch.rewards[rid], adv.get(rid), len(d.calls), prompt, completion]
        )
    return out


class TensorBoardTracker:
    """Scalars and a markdown table of samples to `RUN_DIR/tensorboard` (torch's SummaryWriter)."""

    name = "tensorboard"

    def __init__(self, run_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise TrackerError("train.log_to has tensorboard, which needs torch and tensorboard: "
                               "pip install 'harnessrl[train]'") from e  # fmt: skip
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        """Record the finite scalar metrics of one step."""
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def log_samples(self, step: int, rows: list[list[Any]]) -> None:
        """The sample table as markdown text under `samples`."""
        if not rows:
            return
        esc = lambda x: str(x).replace("|", "\\|").replace("\n", " ")  # noqa: E731
        lines = ["| " + " | ".join(SAMPLE_COLUMNS) + " |", "|" + "---|" * len(SAMPLE_COLUMNS)]
        lines += ["| " + " | ".join(esc(x) for x in r) + " |" for r in rows]
        self.writer.add_text("samples", "\n".join(lines), step)
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()


class WandbTracker:
    """A Weights & Biases run (offline by default): scalars, and the samples as a `wandb.Table`."""

    name = "wandb"

    def __init__(self, run_dir: Path, run_id: str, name: str | None, config: dict[str, Any], project: str,
                 mode: str) -> None:  # fmt: skip
        try:
            import wandb
        except ImportError as e:
            raise TrackerError("train.log_to has wandb, but the wandb package is not installed: "
                               "pip install 'harnessrl[trackers]'") from e  # fmt: skip
        os.environ.setdefault("WANDB_SILENT", "true")
        self.wandb = wandb
        self.run = wandb.init(project=project, dir=str(run_dir), mode="online" if mode == "online" else "offline", id=run_id, name=name or run_id,
                              config=config, resume="allow", reinit="finish_previous")  # fmt: skip

    def log(self, step: int, scalars: dict[str, float]) -> None:
        """Record the finite scalar metrics of one step."""
        self.run.log(scalars, step=step)

    def log_samples(self, step: int, rows: list[list[Any]]) -> None:
        """The sample table as `samples` (a wandb.Table), at the step's index."""
        if rows:
            self.run.log(
                {"samples": self.wandb.Table(columns=list[str | int](SAMPLE_COLUMNS), data=rows)}, step=step
            )

    def close(self) -> None:
        """Finish the run (offline: its files stay in RUN_DIR/wandb for `wandb sync`)."""
        self.run.finish()


class MLflowTracker:
    """An MLflow run: params from the config, metrics per step, the samples as a table artifact."""

    name = "mlflow"

    def __init__(self, run_dir: Path, run_id: str, name: str | None, config: dict[str, Any],
                 tracking_uri: str | None) -> None:  # fmt: skip
        if tracking_uri is None:  # a file store in the run directory: no server, no database package
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            tracking_uri = (run_dir / "mlruns").resolve().as_uri()
        try:
            import mlflow
        except ImportError as e:
            raise TrackerError("train.log_to has mlflow, but the mlflow package is not installed: "
                               "pip install 'harnessrl[trackers]'") from e  # fmt: skip
        self.client = mlflow.tracking.MlflowClient(tracking_uri)
        experiment = name or "harnessrl"
        found = self.client.get_experiment_by_name(experiment)
        exp_id = found.experiment_id if found is not None else self.client.create_experiment(experiment)
        runs = self.client.search_runs([exp_id], f"tags.harnessrl_run_id = '{run_id}'", max_results=1)
        if runs:  # a resumed run continues its MLflow run
            self.run_id = runs[0].info.run_id
        else:
            self.run_id = self.client.create_run(
                exp_id, run_name=run_id, tags={"harnessrl_run_id": run_id}
            ).info.run_id
            for k, v in _flat(config).items():
                self.client.log_param(self.run_id, k, str(v)[:500])

    def log(self, step: int, scalars: dict[str, float]) -> None:
        """Record the finite scalar metrics of one step."""
        import time

        from mlflow.entities import Metric

        t = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, t, step) for k, v in scalars.items()])

    def log_samples(self, step: int, rows: list[list[Any]]) -> None:
        """The sample table as the artifact `samples/step-NNNN.json` (MLflow's table format)."""
        if rows:
            data = {c: [r[i] for r in rows] for i, c in enumerate(SAMPLE_COLUMNS)}
            self.client.log_table(self.run_id, data=data, artifact_file=f"samples/step-{step:04d}.json")

    def close(self) -> None:
        """End the run."""
        self.client.set_terminated(self.run_id)


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, f"{key}."))
        else:
            out[key] = v
    return out


def make_trackers(names: Sequence[str], run_dir: Path, run_id: str, name: str | None = None,
                  config: dict[str, Any] | None = None, wandb_project: str = "harnessrl",
                  wandb_mode: str = "offline", mlflow_tracking_uri: str | None = None) -> list[Tracker]:  # fmt: skip
    """The trackers named in `train.log_to`; a `TrackerError` naming the fix when one cannot start."""
    out: list[Tracker] = []
    for n in dict.fromkeys(names):
        if n == "tensorboard":
            try:
                out.append(TensorBoardTracker(run_dir))
            except TrackerError as e:  # the default: a run without the train extra logs metrics.jsonl only
                log.warning("event=tracker_unavailable tracker=tensorboard error=%s", e)
        elif n == "wandb":
            out.append(WandbTracker(run_dir, run_id, name, config or {}, wandb_project, wandb_mode))
        elif n == "mlflow":
            out.append(MLflowTracker(run_dir, run_id, name, config or {}, mlflow_tracking_uri))
        else:
            raise TrackerError(f"unknown tracker {n!r} in train.log_to; choose from {', '.join(TRACKERS)}")
    return out
