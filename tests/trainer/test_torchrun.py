"""Ranks started by torchrun instead of by the run: two torchrun launches on this machine, one rank
each, rendezvous over loopback as two nodes would; rank 0 runs one sharded update (bench/torchrun_update.py)
and rank 1 is `python -m harnessrl.trainer.rank` with no arguments. Real subprocesses, real gloo."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harnessrl.services import free_port

ROOT = Path(__file__).resolve().parents[2]


def _torchrun(node_rank: int, port: int, *command: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--node-rank", str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
            *command]  # fmt: skip


@pytest.mark.parametrize("parallel", ["fsdp"])
def test_two_torchrun_nodes_complete_a_sharded_update(
    tiny_model_dir: Path, tmp_path: Path, parallel: str
) -> None:
    port = free_port()
    with open(tmp_path / "node1.log", "wb") as log1:
        node1 = subprocess.Popen(_torchrun(1, port, "-m", "harnessrl.trainer.rank"), cwd=ROOT,
                                 stdout=log1, stderr=subprocess.STDOUT)  # fmt: skip
        try:
            node0 = subprocess.run(
                _torchrun(0, port, str(ROOT / "bench" / "torchrun_update.py"), "--model-dir", str(tiny_model_dir),
                          "--parallel", parallel),
                cwd=ROOT, capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            rc1 = node1.wait(timeout=60)
        finally:
            if node1.poll() is None:
                node1.kill()
                node1.wait()
    tail = node0.stdout[-2000:] + node0.stderr[-3000:] + (tmp_path / "node1.log").read_text()[-2000:]
    assert node0.returncode == 0 and rc1 == 0, tail
    result = json.loads([line for line in node0.stdout.splitlines() if line.startswith("{")][-1])
    print(result)
    assert result["ranks"] == 2.0 and result["parallel"] == parallel
    assert (
        result["max_weight_diff"] <= 1e-5 and result["weight_change"] > 1e-4
    )  # the update moved the weights
    assert result["loss"] == pytest.approx(result["loss_1rank"], rel=1e-5)  # the whole batch's, not a rank's


@pytest.mark.slow  # about 3 minutes: pytest -m slow tests/trainer/test_torchrun.py
def test_a_run_whose_trainer_ranks_torchrun_started(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The documented 2-node command: node 0 runs `harnessrl train` as rank 0 through
    `python -m harnessrl.trainer.rank train --config ...`, node 1 only updates."""
    from harnessrl.examples import get_example

    port, run_dir = free_port(), tmp_path / "run"
    overrides = [
        f"run_dir={run_dir}", f"engine.model={tiny_model_dir}", "engine.max_batch=8", "engine.threads=1",
        "train.steps=1", "train.batch_groups=2", "train.group_size=3", "train.lr=1e-3", "train.world_size=2",
        "train.parallel=fsdp", "train.threads=1", "controller.concurrency=6", "eval.n_heldout=2",
        "data.n_train=30", "gateway.default_max_tokens=16", "eval.extra_temperatures=[]",
    ]  # fmt: skip
    train = ["-m", "harnessrl.trainer.rank", "train", "--config", str(get_example("calc").config_path)]
    with open(tmp_path / "node1.log", "wb") as log1:
        node1 = subprocess.Popen(_torchrun(1, port, "-m", "harnessrl.trainer.rank"), cwd=ROOT,
                                 stdout=log1, stderr=subprocess.STDOUT)  # fmt: skip
        try:
            node0 = subprocess.run(_torchrun(0, port, *train, *overrides, "--fresh"), cwd=ROOT,
                                   capture_output=True, text=True, timeout=900)  # fmt: skip
            rc1 = node1.wait(timeout=60)
        finally:
            if node1.poll() is None:
                node1.kill()
                node1.wait()
    node1_log = (tmp_path / "node1.log").read_text()
    assert node0.returncode == 0 and rc1 == 0, node0.stdout[-2000:] + node0.stderr[-3000:] + node1_log[-2000:]
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["ranks"] == 2 and records[0]["weight_version"] == 1
    assert "parallel=fsdp" in node1_log and "event=rank_update rank=1" in node1_log
