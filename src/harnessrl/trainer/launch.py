"""How trainer ranks find each other: started by the run's rank 0 (a TCP address on loopback) or by a
launcher such as `torchrun` (its environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK),
on CPU (gloo) or with one GPU per rank (NCCL).

A torchrun launch on two machines, one rank each (node 0 runs the loop; node 1 only updates):

    torchrun --nnodes 2 --nproc-per-node 1 --node-rank 0 --master-addr HOST0 --master-port 29500 \\
        -m harnessrl.trainer.rank train --config run.yaml train.world_size=2 train.parallel=fsdp
    torchrun --nnodes 2 --nproc-per-node 1 --node-rank 1 --master-addr HOST0 --master-port 29500 \\
        -m harnessrl.trainer.rank

(`--rdzv-backend c10d --rdzv-endpoint HOST0:29500` works the same.) Ranks other than 0 get their settings
(model folder, optimizer, ...) from rank 0 once the group is joined, so their command line is the same
everywhere.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

ENV_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# How long a collective may wait: ranks 1..k-1 wait in one for rank 0's next order during a whole
# rollout phase; a longer phase between two updates fails the ranks (raise it here if yours are longer).
COLLECTIVE_TIMEOUT = timedelta(hours=6)


def launched_by_env() -> bool:
    """Whether this process is a rank started by torchrun (or another launcher setting ENV_KEYS)."""
    return all(k in os.environ for k in ENV_KEYS)


def backend() -> str:
    """gloo for CPU tensors, plus NCCL for CUDA tensors where CUDA is present (the same on every rank)."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def rank_device(device: str, rank: int) -> torch.device:
    """This rank's device for `train.device`: the CPU, or `cuda:<LOCAL_RANK>` (one GPU per rank)."""
    if not device.startswith("cuda"):
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", rank))
    if local >= torch.cuda.device_count():
        raise ValueError(
            f"rank {rank} wants cuda:{local} but this machine has {torch.cuda.device_count()} GPU(s): "
            "start at most one rank per GPU (torchrun --nproc-per-node)"
        )
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def join(init: str | None, rank: int = -1, world_size: int = -1, join_timeout_s: float = 120.0) -> None:
    """Join the process group: by `init` (tcp://host:port; rank 0 serves the rendezvous store there) with
    an explicit rank and size, or, with `init` None, by the launcher's environment (env://).

    Two timeouts: joining gives up after `join_timeout_s` (a rank that never starts fails the run
    quickly), while a collective may wait `COLLECTIVE_TIMEOUT`: the other ranks wait in one for rank 0's
    next order while it rolls out, and a rank may spend minutes loading its model on a busy machine."""
    if init is None:
        dist.init_process_group(backend(), init_method="env://", timeout=COLLECTIVE_TIMEOUT)
        return
    host, port = init.removeprefix("tcp://").rsplit(":", 1)
    store = dist.TCPStore(
        host, int(port), world_size, is_master=rank == 0, timeout=timedelta(seconds=join_timeout_s)
    )
    dist.init_process_group(
        backend(), store=store, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT
    )


def check_env_world(world_size: int) -> None:
    """Refuse a launcher environment that disagrees with `train.world_size` or is not rank 0."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != world_size:
        raise ValueError(
            f"the launcher started {world} ranks (WORLD_SIZE) but train.world_size is {world_size}: "
            "set them equal"
        )
    if rank != 0:
        raise ValueError(
            f"this process is rank {rank}: only rank 0 runs the training loop; start the other ranks "
            "with `python -m harnessrl.trainer.rank` (no arguments)"
        )
