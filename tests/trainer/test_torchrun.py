"""Ranks started by torchrun instead of by the run: two torchrun launches on this machine, one rank
each, rendezvous over loopback as two nodes would; rank 0 runs one sharded update (bench/torchrun_update.py)
and rank 1 is `python -m harnessrl.trainer.distributed` with no arguments. Real subprocesses, real gloo."""

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
        node1 = subprocess.Popen(_torchrun(1, port, "-m", "harnessrl.trainer.distributed"), cwd=ROOT,
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
