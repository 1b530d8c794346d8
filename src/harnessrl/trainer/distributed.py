"""Data-parallel PPO update on torch.distributed: `train.world_size` k trainer ranks, DDP over gloo.

Rank 0 is the trainer process of the run (it rolls out, publishes weights, writes checkpoints); ranks
1..k-1 are worker processes it starts (`python -m harnessrl.trainer.distributed`), each holding a full
copy of the policy and of the optimizer state. For each update rank 0 broadcasts the batch; every rank
takes its share of the rows (`shard_rows`: contiguous runs of the rows in token order, so siblings that
share a prompt stay together, cut at equal token counts) and runs the single-process update's own epoch
loop (`trainer.ppo.update_epochs`) on it, with the ordinary micro-batch loss inside DDP; DDP all-reduces
the gradients at the last micro-batch's backward pass. The reduction is a SUM, not DDP's default mean:
the adapter's loss weights are fixed for the whole batch before the update (rollout-token-mean
normalisation uses the batch's token counts), so the whole batch's gradient is exactly the sum of the
ranks' gradients. Every rank then clips the same gradient to the same norm and takes the same AdamW
step: the replicas stay identical, and the update equals the single-process one up to float summation
order (tests/trainer/test_distributed.py measures it).

The learning rate comes from rank 0 with each update (its LR schedule is the only one); checkpoints are
written by rank 0 alone (all ranks hold the same state); after a resume `sync_state` sends rank 0's
weights and optimizer state to the others.

On CPU the ranks split the machine's cores (each gets `threads`, default cores // k). Speed-up needs
more cores than one rank can use: see docs/scale.md for what it gives on 2 cores and the GPU case.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP

from harnessrl.adapter import Batch
from harnessrl.modeling.llama import LlamaForCausalLM
from harnessrl.trainer.ppo import (
    _STAT_KEYS,
    NO_STEP_METRICS,
    PPOConfig,
    micro_batch_loss,
    row_groups,
    rows_to_run,
    update_epochs,
)

log = logging.getLogger("harnessrl.trainer.distributed")  # also when run as __main__ (a worker rank)

COLLECTIVE_TIMEOUT = timedelta(hours=2)  # one update (a collective waits for the slowest rank's share)
JOIN_TIMEOUT_S = 120.0  # workers to start and join the process group


def shard_rows(batch: Batch, rows: list[int], world_size: int) -> list[list[int]]:
    """Split row indices `rows` over `world_size` ranks by token budget: rows in token order (as
    `micro_batches` orders them, so rows sharing a prefix are neighbours), cut into contiguous runs of
    about total/k tokens each (a row goes to the rank its middle token falls in)."""
    order = sorted(rows, key=lambda i: batch.rows[i].tokens)
    total = sum(len(batch.rows[i].tokens) for i in order)
    shards: list[list[int]] = [[] for _ in range(world_size)]
    seen = 0
    for i in order:
        n = len(batch.rows[i].tokens)
        rank = min(int((seen + (n - 1) / 2) * world_size / max(total, 1)), world_size - 1)
        shards[rank].append(i)
        seen += n
    return shards


def _sum_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """DDP communication hook: all-reduce SUM (DDP's own hook divides by the world size)."""
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()  # type: ignore[union-attr]
    return fut.then(lambda f: f.value()[0])


# DDP checks the hook's annotations as objects (this module's are strings: `from __future__ import annotations`)
_sum_hook.__annotations__.update({"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]})


class _Loss(nn.Module):
    """The micro-batch loss as a module, so DDP sees the forward pass it synchronises."""

    def __init__(self, policy: LlamaForCausalLM) -> None:
        super().__init__()
        self.policy = policy

    def forward(
        self,
        batch: Batch,
        idx: list[int],
        cfg: PPOConfig,
        prox: Tensor | None,
        ref_model: LlamaForCausalLM | None,
        checkpoint_layers: bool | None,
    ) -> tuple[Tensor, dict[str, float], Tensor | None]:
        if not idx:  # a rank without rows still joins the all-reduce, with zero gradients
            zero = sum((p.sum() * 0.0 for p in self.policy.parameters()), torch.zeros(()))
            return zero, dict.fromkeys(_STAT_KEYS, 0.0), None
        return micro_batch_loss(self.policy, batch, idx, cfg, prox, ref_model, checkpoint_layers)


def wrap(model: LlamaForCausalLM) -> DDP:
    """The policy inside DDP (parameters broadcast from rank 0 here), gradients reduced by SUM."""
    ddp = DDP(_Loss(model), find_unused_parameters=False)
    ddp.register_comm_hook(None, _sum_hook)
    return ddp


def rank_update(
    ddp: DDP,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    cfg: PPOConfig,
    ref_model: LlamaForCausalLM | None = None,
    progress: Callable[[int, int], None] | None = None,
    checkpoint_layers: bool | None = None,
) -> dict[str, float]:
    """This rank's part of the data-parallel update (every rank calls it with the same batch); returns
    the whole batch's metrics, as `ppo_update` does. The LR schedule is the caller's (rank 0)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    lr = optimizer.param_groups[0]["lr"]
    run_rows = rows_to_run(batch, cfg)
    skipped = float(len(batch.rows) - len(run_rows))
    if not run_rows or batch.n_trainable_tokens == 0:  # the same decision on every rank
        return {**NO_STEP_METRICS, "lr": lr, "skipped_zero_adv_rows": skipped, "ranks": float(world),
                "rank_rows_max": 0.0}  # fmt: skip
    mine = shard_rows(batch, run_rows, world)[rank]
    groups = row_groups(batch, mine, cfg.micro_batch_tokens) or [[]]
    metrics = update_epochs(
        ddp.module.policy, optimizer, groups, cfg,
        lambda idx, prox: ddp(batch, idx, cfg, prox, ref_model, checkpoint_layers),
        progress=progress, no_sync=ddp.no_sync, sum_over_ranks=_sum_over_ranks,
    )  # fmt: skip
    return {**metrics, "lr": lr, "skipped_zero_adv_rows": skipped, "ranks": float(world),
            "rank_rows_max": float(len(mine))}  # fmt: skip


def _sum_over_ranks(values: list[float]) -> list[float]:
    """Each value summed over all ranks (in float64, the precision of the Python floats they are)."""
    summed = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(summed)
    return [float(v) for v in summed.tolist()]


def _flat_params(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])


def _sync_state(model: LlamaForCausalLM, optimizer: torch.optim.Optimizer) -> None:
    """Every rank takes rank 0's weights and optimizer state (after a resume on rank 0)."""
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
    box = [optimizer.state_dict() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    if dist.get_rank() != 0:
        optimizer.load_state_dict(box[0])  # type: ignore[arg-type]


def _divergence(model: nn.Module) -> float:
    """The largest absolute difference between any rank's weights and rank 0's."""
    mine = _flat_params(model)
    ref = mine.clone()
    dist.broadcast(ref, src=0)
    gap = (mine - ref).abs().max().reshape(1).double()
    dist.all_reduce(gap, op=dist.ReduceOp.MAX)
    return float(gap[0])


class DataParallel:
    """Rank 0's handle on a k-rank data-parallel trainer: starts ranks 1..k-1, runs each update on all
    ranks, stops them on `close`. The rank-0 `model` and `optimizer` are the run's own."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        optimizer: torch.optim.Optimizer,
        model_dir: Path,
        world_size: int,
        *,
        threads: int | None = None,
        matmul: str = "aten",
        kl_coef: float = 0.0,
        log_dir: Path | None = None,
        port: int | None = None,
    ) -> None:
        if world_size < 2:
            raise ValueError("DataParallel needs world_size >= 2 (1 is the plain single-process update)")
        if next(model.parameters()).device.type != "cpu":
            raise ValueError("data-parallel training runs on CPU ranks (gloo) only so far")
        if dist.is_initialized():
            raise RuntimeError("a torch.distributed process group already exists in this process")
        from harnessrl.services import free_port

        self.model, self.optimizer, self.world_size = model, optimizer, world_size
        self.threads = threads or max(1, (os.cpu_count() or 1) // world_size)
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        init = f"tcp://127.0.0.1:{port or free_port()}"
        if type(optimizer) not in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD):
            raise ValueError(f"data-parallel ranks build AdamW, Adam or SGD, not {type(optimizer).__name__}")
        defaults = {k: v for k, v in optimizer.defaults.items() if isinstance(v, int | float | bool | tuple)}
        spec = {"init": init, "world_size": world_size, "model_dir": str(model_dir), "threads": self.threads,
                "matmul": matmul, "optimizer": type(optimizer).__name__, "defaults": defaults,
                "kl_coef": kl_coef}  # fmt: skip
        self.procs: list[subprocess.Popen[bytes]] = []
        self._logs: list[Any] = []
        for rank in range(1, world_size):
            out: Any = subprocess.DEVNULL
            if log_dir is not None:
                out = open(log_dir / f"trainer-rank{rank}.log", "ab")  # noqa: SIM115 - closed in `_kill`
                self._logs.append(out)
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "harnessrl.trainer.distributed", "--rank", str(rank), "--spec", json.dumps(spec)],
                stdout=out, stderr=subprocess.STDOUT,
            ))  # fmt: skip
        try:
            dist.init_process_group("gloo", init_method=init, rank=0, world_size=world_size,
                                    timeout=timedelta(seconds=JOIN_TIMEOUT_S))  # fmt: skip
            self.ddp = wrap(model)
        except BaseException:
            self._kill()
            raise
        log.info("event=data_parallel_started world_size=%d threads_per_rank=%d", world_size, self.threads)

    def update(
        self,
        batch: Batch,
        cfg: PPOConfig,
        ref_model: LlamaForCausalLM | None = None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> dict[str, float]:
        """The update on all ranks (as `ppo_update`); rank 0 steps the LR schedule afterwards."""
        self._check_alive()
        lr = self.optimizer.param_groups[0]["lr"]
        dist.broadcast_object_list([{"op": "update", "batch": batch, "cfg": asdict(cfg), "lr": lr}], src=0)
        metrics = rank_update(self.ddp, self.optimizer, batch, cfg, ref_model, progress)
        if scheduler is not None:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
                scheduler.step()
        return metrics

    def sync_state(self) -> None:
        """Send rank 0's weights and optimizer state to every rank (after loading a checkpoint)."""
        self._check_alive()
        dist.broadcast_object_list([{"op": "sync"}], src=0)
        _sync_state(self.model, self.optimizer)

    def divergence(self) -> float:
        """The largest absolute weight difference between any rank and rank 0 (0.0: in lockstep)."""
        self._check_alive()
        dist.broadcast_object_list([{"op": "divergence"}], src=0)
        return _divergence(self.model)

    def close(self) -> None:
        """Stop the workers and leave the process group."""
        if not dist.is_initialized():
            return
        try:
            if all(p.poll() is None for p in self.procs):
                dist.broadcast_object_list([{"op": "stop"}], src=0)
                for p in self.procs:
                    p.wait(timeout=60)
        finally:
            self._kill()
            dist.destroy_process_group()
            torch.set_num_threads(self._threads_before)

    def _check_alive(self) -> None:
        dead = [(r + 1, p.returncode) for r, p in enumerate(self.procs) if p.poll() is not None]
        if dead:
            raise RuntimeError(f"trainer rank(s) exited: {dead} (see logs/trainer-rank*.log)")

    def _kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in self._logs:
            f.close()
        self._logs = []


def _worker(rank: int, spec: dict[str, Any]) -> None:
    """Ranks 1..k-1: hold a replica, run each update's share, until rank 0 says stop."""
    from harnessrl.modeling.loading import load_model
    from harnessrl.modeling.packed import use_onednn_for_training

    torch.set_num_threads(int(spec["threads"]))
    dist.init_process_group("gloo", init_method=spec["init"], rank=rank, world_size=int(spec["world_size"]),
                            timeout=timedelta(seconds=JOIN_TIMEOUT_S))  # fmt: skip
    model = load_model(spec["model_dir"])
    if str(spec["matmul"]).startswith("onednn"):
        use_onednn_for_training(model, "onednn", torch.device("cpu"))
    cls = getattr(torch.optim, spec["optimizer"])
    accepted = inspect.signature(cls).parameters
    defaults = {
        k: tuple(v) if isinstance(v, list) else v for k, v in spec["defaults"].items() if k in accepted
    }
    optimizer = cls(model.parameters(), **defaults)
    ref = load_model(spec["model_dir"]).requires_grad_(False) if spec["kl_coef"] > 0 else None
    ddp = wrap(model)
    log.info("event=rank_ready rank=%d", rank)
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        msg = box[0]
        if msg["op"] == "update":
            for group in optimizer.param_groups:
                group["lr"] = msg["lr"]
            t0 = time.perf_counter()
            rank_update(ddp, optimizer, msg["batch"], PPOConfig(**msg["cfg"]), ref)
            log.info("event=rank_update rank=%d seconds=%.2f", rank, time.perf_counter() - t0)
        elif msg["op"] == "sync":
            _sync_state(model, optimizer)
        elif msg["op"] == "divergence":
            _divergence(model)
        elif msg["op"] == "stop":
            break
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Entry point of a worker rank (started by `DataParallel`)."""
    p = argparse.ArgumentParser(prog="python -m harnessrl.trainer.distributed")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--spec", required=True, help="JSON settings from rank 0")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    _worker(args.rank, json.loads(args.spec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
