"""The DDP flavour of data parallelism (`train.parallel: ddp`, used by `trainer.distributed`): every rank
a full replica of the policy inside DistributedDataParallel, gradients all-reduced by SUM at the last
micro-batch's backward; and the helpers that copy and compare whole replicas."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP

from harnessrl.adapter import Batch
from harnessrl.modeling.causal_lm import CausalLM
from harnessrl.trainer.ppo import _MAX_KEYS, _STAT_KEYS, PPOConfig, micro_batch_loss


def _sum_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """DDP communication hook: all-reduce SUM (DDP's own hook divides by the world size)."""
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()  # type: ignore[union-attr]
    return fut.then(lambda f: f.value()[0])


# DDP checks the hook's annotations as objects (this module's are strings: `from __future__ import annotations`)
_sum_hook.__annotations__.update({"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]})


class RankLoss(nn.Module):
    """The micro-batch loss as a module, so DDP (and FSDP, `trainer.fsdp.ShardedLoss`) sees the forward
    pass it synchronises; an empty micro-batch gives `idle()`'s loss."""

    def __init__(self, policy: CausalLM) -> None:
        super().__init__()
        self.policy = policy

    def forward(
        self,
        batch: Batch,
        idx: list[int],
        cfg: PPOConfig,
        prox: Tensor | None,
        ref_model: CausalLM | None,
        checkpoint_layers: bool | None,
    ) -> tuple[Tensor, dict[str, float], Tensor | None]:
        if not idx:
            return self.idle(), dict.fromkeys((*_STAT_KEYS, *_MAX_KEYS), 0.0), None
        return micro_batch_loss(self.policy, batch, idx, cfg, prox, ref_model, checkpoint_layers)

    def idle(self) -> Tensor:
        """A rank without rows still joins the all-reduce, with zero gradients."""
        return sum((p.sum() * 0.0 for p in self.policy.parameters()), torch.zeros(()))


def wrap(model: CausalLM) -> DDP:
    """The policy inside DDP (parameters broadcast from rank 0 here), gradients reduced by SUM."""
    ddp = DDP(RankLoss(model), find_unused_parameters=False)
    ddp.register_comm_hook(None, _sum_hook)
    return ddp


def _flat_params(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])


def sync_state(model: CausalLM, optimizer: torch.optim.Optimizer) -> None:
    """Every rank takes rank 0's weights and optimizer state (after a resume on rank 0)."""
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
    box = [optimizer.state_dict() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    if dist.get_rank() != 0:
        optimizer.load_state_dict(box[0])  # type: ignore[arg-type]


def divergence(model: nn.Module) -> float:
    """The largest absolute difference between any rank's weights and rank 0's."""
    mine = _flat_params(model)
    ref = mine.clone()
    dist.broadcast(ref, src=0)
    gap = (mine - ref).abs().max().reshape(1).double()
    dist.all_reduce(gap, op=dist.ReduceOp.MAX)
    return float(gap[0])
