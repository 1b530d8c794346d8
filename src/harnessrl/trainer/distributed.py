"""Data-parallel PPO update on torch.distributed: `train.world_size` k trainer ranks, DDP (every rank a
full replica) or, with `train.parallel: fsdp`, FSDP2 (parameters, gradients and optimizer state
sharded: `trainer.fsdp`); gloo on CPU, NCCL with one GPU per rank (`LOCAL_RANK`) on CUDA.

Rank 0 is the trainer process of the run (it rolls out, publishes weights, writes checkpoints); ranks
1..k-1 are worker processes it starts (`python -m harnessrl.trainer.rank`), each holding a full
copy of the policy and of the optimizer state (ddp, `trainer.ddp`) or a 1/k shard of them (fsdp, where
the micro-batch loss runs through FSDP instead of DDP; see `trainer.fsdp`). For each update rank 0 broadcasts the batch; every rank
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
written by rank 0 alone (ddp: all ranks hold the same state; fsdp: rank 0 gathers the shards first, and
a resume reshards); after a ddp resume `sync_state` sends rank 0's weights and optimizer state to the
others.

On CPU the ranks split the machine's cores (each gets `threads`, default cores // k). Speed-up needs
more cores than one rank can use: see docs/scale.md for what it gives on 2 cores and the GPU case.

Launch: by default rank 0 starts ranks 1..k-1 itself. Under `torchrun` (or any launcher that sets
RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) the ranks join by that rendezvous instead: rank 0 runs the
loop (`python -m harnessrl.trainer.rank train --config run.yaml ...` runs `harnessrl train`
there), the other ranks only serve updates and receive their settings from rank 0 (`trainer.launch`).
"""

from __future__ import annotations

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
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import LRScheduler

from harnessrl.adapter import Batch
from harnessrl.modeling.causal_lm import CausalLM
from harnessrl.modeling.loading import load_state_dict_file
from harnessrl.trainer import launch
from harnessrl.trainer.checkpoint import (
    load_checkpoint,
    restore_loop_state,
    save_checkpoint,
    training_state_path,
)
from harnessrl.trainer.ddp import divergence, sync_state, wrap
from harnessrl.trainer.fsdp import (
    ShardedLoss,
    fill_shards,
    gather_full,
    load_full,
    load_sharded_reference,
    meta_model,
    micro_batch_slots,
    model_view,
    shard,
    shard_reference,
)
from harnessrl.trainer.ppo import (
    NO_STEP_METRICS,
    PPOConfig,
    row_groups,
    rows_to_run,
    update_epochs,
)
from harnessrl.trainer.precision import MasterAdamW, torch_dtype

log = logging.getLogger("harnessrl.trainer.distributed")  # also when run as __main__ (a worker rank)

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


Root = DDP | ShardedLoss  # the module a rank's micro-batch losses run through


def rank_update(
    root: Root,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    cfg: PPOConfig,
    ref_model: CausalLM | None = None,
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
    shards = shard_rows(batch, run_rows, world)
    if isinstance(root, DDP):  # micro-batches accumulate locally; DDP reduces at the last backward
        policy, no_sync = root.module.policy, root.no_sync
        groups = row_groups(batch, shards[rank], cfg.micro_batch_tokens) or [[]]
    else:  # every rank the same number of micro-batches: each one's collectives are everyone's
        policy, no_sync = root.policy, None
        groups = micro_batch_slots(batch, shards, cfg.micro_batch_tokens, rank)
    metrics = update_epochs(
        policy, optimizer, groups, cfg,
        lambda idx, prox: root(batch, idx, cfg, prox, ref_model, checkpoint_layers),
        progress=progress, no_sync=no_sync, sum_over_ranks=_sum_over_ranks, max_over_ranks=_max_over_ranks,
    )  # fmt: skip
    return {**metrics, "lr": lr, "skipped_zero_adv_rows": skipped, "ranks": float(world),
            "rank_rows_max": float(max(len(s) for s in shards))}  # fmt: skip


def _sum_over_ranks(values: list[float]) -> list[float]:
    """Each value summed over all ranks (in float64, the precision of the Python floats they are; a CPU
    tensor: gloo carries it, also beside NCCL)."""
    summed = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(summed)
    return [float(v) for v in summed.tolist()]


def _max_over_ranks(values: list[float]) -> list[float]:
    """Each value's maximum over all ranks."""
    top = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    return [float(v) for v in top.tolist()]


def optimizer_spec(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What a rank needs to build rank 0's optimizer: its class name and options (`rank_optimizer`)."""
    defaults: dict[str, Any] = {
        k: v for k, v in optimizer.defaults.items() if isinstance(v, int | float | bool | tuple)
    }
    if isinstance(optimizer, MasterAdamW):  # an attribute, not a param-group option
        defaults.update(
            exp_avg_dtype=optimizer.exp_avg_dtype, rounding=optimizer.rounding, seed=optimizer.seed
        )
    return {"optimizer": type(optimizer).__name__, "defaults": defaults}


def rank_optimizer(spec: dict[str, Any], params: Any) -> torch.optim.Optimizer:
    """The optimizer a rank builds over `params`, by the class name and options rank 0 sent
    (`MasterAdamW`: bf16 with master weights)."""
    name = spec["optimizer"]
    cls: Any = MasterAdamW if name == MasterAdamW.__name__ else getattr(torch.optim, name)
    accepted = inspect.signature(cls).parameters
    defaults = {
        k: tuple(v) if isinstance(v, list) else v for k, v in spec["defaults"].items() if k in accepted
    }
    optimizer: torch.optim.Optimizer = cls(params, **defaults)
    return optimizer


class DataParallel:
    """Rank 0's handle on a k-rank data-parallel trainer (`parallel` "ddp": replicas, "fsdp": shards):
    starts ranks 1..k-1 (or joins those a launcher started), runs each update on all ranks, gathers the
    weights for the engine and checkpoints, stops the ranks on `close`. The rank-0 `model` and
    `optimizer` are the run's own (with fsdp, sharded in place)."""

    def __init__(
        self,
        model: CausalLM,
        optimizer: torch.optim.Optimizer,
        model_dir: Path,
        world_size: int,
        *,
        threads: int | None = None,
        matmul: str = "aten",
        kl_coef: float = 0.0,
        log_dir: Path | None = None,
        port: int | None = None,
        parallel: Literal["ddp", "fsdp"] = "ddp",
        dtype: str = "float32",
        ref_model: CausalLM | None = None,
        device: str = "cpu",
    ) -> None:
        if world_size < 2:
            raise ValueError("DataParallel needs world_size >= 2 (1 is the plain single-process update)")
        if dist.is_initialized():
            raise RuntimeError("a torch.distributed process group already exists in this process")
        if type(optimizer) not in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, MasterAdamW):
            raise ValueError(f"data-parallel ranks build AdamW, Adam or SGD, not {type(optimizer).__name__}")
        self.model, self.optimizer, self.world_size, self.parallel = model, optimizer, world_size, parallel
        # fsdp: the KL reference, sharded (the one given, or loaded shard by shard when kl_coef > 0)
        self.ref_model = ref_model
        self.device_kind = device
        self.threads = threads or max(1, (os.cpu_count() or 1) // world_size)
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        spec = {"world_size": world_size, "model_dir": str(model_dir), "threads": self.threads, "matmul": matmul,
                **optimizer_spec(optimizer), "kl_coef": kl_coef,
                "parallel": parallel, "device": device.split(":")[0], "dtype": dtype}  # fmt: skip
        self.procs: list[subprocess.Popen[bytes]] = []
        self._logs: list[Any] = []
        try:
            if launch.launched_by_env():  # torchrun started the ranks: join them, then tell them the spec
                launch.check_env_world(world_size)
                launch.join(None)
                dist.broadcast_object_list([spec], src=0)
            else:
                from harnessrl.services import free_port

                init = spec["init"] = f"tcp://127.0.0.1:{port or free_port()}"
                self._spawn(spec, log_dir)
                launch.join(init, 0, world_size, JOIN_TIMEOUT_S)
            self.root: Root = wrap(model) if parallel == "ddp" else self._shard(model_dir, dtype, kl_coef)
        except BaseException:
            self._kill()
            raise
        log.info("event=data_parallel_started parallel=%s world_size=%d threads_per_rank=%d",
                 parallel, world_size, self.threads)  # fmt: skip

    def _shard(self, model_dir: Path, dtype: str, kl_coef: float) -> ShardedLoss:
        """fsdp: shard the policy (one on the meta device is then filled shard by shard from `model_dir`)
        and build the KL reference sharded the same way (or shard the one given), as every worker does."""
        on_meta = next(self.model.parameters()).is_meta
        device = launch.rank_device(self.device_kind, 0) if on_meta else next(self.model.parameters()).device
        root = shard(self.model, self.optimizer, torch_dtype(dtype), device)
        if on_meta:
            fill_shards(self.model, model_dir, device)
        if self.ref_model is not None:
            shard_reference(self.ref_model)
        elif kl_coef > 0:
            self.ref_model = load_sharded_reference(model_dir, torch_dtype(dtype), device)
        return root

    def _spawn(self, spec: dict[str, Any], log_dir: Path | None) -> None:
        for rank in range(1, self.world_size):
            out: Any = subprocess.DEVNULL
            if log_dir is not None:
                out = open(log_dir / f"trainer-rank{rank}.log", "ab")  # noqa: SIM115 - closed in `_kill`
                self._logs.append(out)
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "harnessrl.trainer.rank", "--rank", str(rank), "--spec", json.dumps(spec)],
                stdout=out, stderr=subprocess.STDOUT,
            ))  # fmt: skip

    def update(
        self,
        batch: Batch,
        cfg: PPOConfig,
        ref_model: CausalLM | None = None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> dict[str, float]:
        """The update on all ranks (as `ppo_update`); rank 0 steps the LR schedule afterwards."""
        self._send(
            {"op": "update", "batch": batch, "cfg": asdict(cfg), "lr": self.optimizer.param_groups[0]["lr"]}
        )
        ref_model = ref_model if ref_model is not None else self.ref_model
        metrics = rank_update(self.root, self.optimizer, batch, cfg, ref_model, progress)
        if scheduler is not None:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
                scheduler.step()
        return metrics

    def full_model(self) -> CausalLM:
        """The whole policy on rank 0, for the engine push: the model itself (ddp), or gathered from the
        shards into one CPU copy on rank 0 alone (fsdp)."""
        if self.parallel == "ddp":
            return self.model
        t0 = time.perf_counter()
        self._send({"op": "gather", "optimizer": False})
        weights, _ = gather_full(self.model, self.optimizer, with_optimizer=False)
        assert weights is not None  # rank 0
        log.info("event=weights_gathered seconds=%.2f", time.perf_counter() - t0)
        return model_view(self.model, weights)

    def save_checkpoint(
        self, ckpt_dir: Path, step: int, state: dict[str, Any], scheduler: LRScheduler | None = None
    ) -> Path:
        """Write an ordinary (single-process format) checkpoint from rank 0: any world size resumes it."""
        if self.parallel == "ddp":  # every rank holds the same state
            return save_checkpoint(ckpt_dir, step, self.model, self.optimizer, state, scheduler)
        self._send({"op": "gather", "optimizer": True})
        weights, osd = gather_full(self.model, self.optimizer, with_optimizer=True)
        assert weights is not None and osd is not None  # rank 0
        return save_checkpoint(ckpt_dir, step, model_view(self.model, weights), osd, state, scheduler)

    def load_checkpoint(self, path: Path, scheduler: LRScheduler | None = None) -> dict[str, Any]:
        """Restore a checkpoint (of any world size) on every rank; returns its loop state (`step`)."""
        if self.parallel == "ddp":  # rank 0 loads, the others take its weights and moments
            state = load_checkpoint(path, self.model, self.optimizer, scheduler)
            self.sync_state()
            return state
        self._send({"op": "load"})
        blob = torch.load(training_state_path(path), weights_only=False)
        load_full(self.model, self.optimizer, load_state_dict_file(path), blob["optimizer"])
        return restore_loop_state(path, blob, scheduler)

    def sync_state(self) -> None:
        """Send rank 0's weights and optimizer state to every rank (ddp, after loading a checkpoint)."""
        self._send({"op": "sync"})
        sync_state(self.model, self.optimizer)

    def divergence(self) -> float:
        """The largest absolute weight difference between any rank and rank 0 (ddp; 0.0: in lockstep)."""
        self._send({"op": "divergence"})
        return divergence(self.model)

    def close(self) -> None:
        """Stop the workers and leave the process group."""
        if not dist.is_initialized():
            return
        try:
            if all(p.poll() is None for p in self.procs):
                dist.broadcast_object_list([{"op": "stop"}], src=0)
        finally:
            # leave the group before waiting: a rank leaving it can wait for its peers to leave too
            dist.destroy_process_group()
            try:
                for p in self.procs:
                    p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                log.warning("event=rank_stop_timeout: killing the ranks still running")
            finally:
                self._kill()
                torch.set_num_threads(self._threads_before)

    def _send(self, msg: dict[str, Any]) -> None:
        """Tell every rank what to do next (after checking that the ranks rank 0 started are alive)."""
        dead = [(r + 1, p.returncode) for r, p in enumerate(self.procs) if p.poll() is not None]
        if dead:
            raise RuntimeError(f"trainer rank(s) exited: {dead} (see logs/trainer-rank*.log)")
        if msg["op"] in ("sync", "divergence") and self.parallel != "ddp":
            raise ValueError(
                f"{msg['op']} compares or copies whole replicas: ddp only (this is {self.parallel})"
            )
        dist.broadcast_object_list([msg], src=0)

    def _kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in self._logs:
            f.close()
        self._logs = []


def worker(rank: int, spec: dict[str, Any]) -> None:
    """Ranks 1..k-1: hold a replica or a shard, run each update's share, until rank 0 says stop."""
    from harnessrl.modeling.loading import load_model
    from harnessrl.modeling.packed import use_onednn_for_training

    torch.set_num_threads(int(spec["threads"]))
    device = launch.rank_device(spec.get("device", "cpu"), rank)
    dtype = torch_dtype(spec.get("dtype", "float32"))
    fsdp = spec.get("parallel", "ddp") == "fsdp"  # fsdp: fp32 shards (the master weights), compute in dtype
    # fsdp: built on the meta device, sharded, then only this rank's rows read (never the whole model)
    model = (
        meta_model(spec["model_dir"])
        if fsdp
        else load_model(spec["model_dir"], dtype=dtype, device=str(device))
    )
    if str(spec["matmul"]).startswith("onednn") and not fsdp:
        use_onednn_for_training(model, "onednn", device)
    elif str(spec["matmul"]).startswith("fp32 products") and not fsdp:  # as rank 0 (modeling/upcast.py)
        use_onednn_for_training(model, "auto", device)
    root: Root = shard(model, dtype=dtype, device=device) if fsdp else wrap(model)
    if fsdp:
        fill_shards(model, spec["model_dir"], device)
    optimizer = rank_optimizer(spec, model.parameters())  # after sharding: over this rank's shards
    ref = None
    if spec["kl_coef"] > 0 and fsdp:  # in the compute dtype, sharded as the policy is
        ref = load_sharded_reference(spec["model_dir"], dtype, device)
    elif spec["kl_coef"] > 0:
        ref = load_model(spec["model_dir"], dtype=dtype, device=str(device)).requires_grad_(False)
    log.info("event=rank_ready rank=%d parallel=%s device=%s", rank, spec.get("parallel", "ddp"), device)
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        msg = box[0]
        if msg["op"] == "update":
            for group in optimizer.param_groups:
                group["lr"] = msg["lr"]
            t0 = time.perf_counter()
            rank_update(root, optimizer, msg["batch"], PPOConfig(**msg["cfg"]), ref)
            log.info("event=rank_update rank=%d seconds=%.2f", rank, time.perf_counter() - t0)
        elif msg["op"] == "gather":
            gather_full(model, optimizer, with_optimizer=bool(msg["optimizer"]))
        elif msg["op"] == "load":
            load_full(model, optimizer, None, None)
        elif msg["op"] == "sync":
            sync_state(model, optimizer)
        elif msg["op"] == "divergence":
            divergence(model)
        elif msg["op"] == "stop":
            break
    dist.destroy_process_group()
    log.info("event=rank_stopped rank=%d", rank)


def serve_from_env() -> None:
    """A rank started by torchrun (not rank 0): join by the environment, take the spec from rank 0, serve."""
    launch.join(None)
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)
    worker(dist.get_rank(), box[0])
