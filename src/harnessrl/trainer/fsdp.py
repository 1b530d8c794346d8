"""Sharded data parallelism (`train.parallel: fsdp`): FSDP2 (`torch.distributed.fsdp.fully_shard`) on a
1-D device mesh of the k trainer ranks, so each rank holds 1/k of the parameters, gradients and AdamW
state instead of a full copy (the DDP path of `trainer.distributed`).

Units. Every decoder layer is one FSDP unit; the rest (embeddings, the final norm, the LM head, tied to
the embeddings in SmolLM2) belongs to the root unit, `ShardedLoss`, whose forward is the micro-batch
loss. The trainer's forward (`trainer.forward`) calls a layer's parts directly (its shared-prefix path
runs each layer once for the prefix and once for the rows), so a sharded layer is called through its
`sharded_step`, registered as an FSDP forward method: the layer's weights are all-gathered before it,
freed after it, gathered again in the backward pass and its gradients reduce-scattered. Each rank thus
holds the full weights of the root unit and of one layer at a time, and 1/k of everything else.

Same update as one process. Every collective must be issued by every rank in the same order, so every
rank runs the same number of micro-batches: a rank whose share of the rows has fewer runs an idle
micro-batch (a 1-token forward through every unit whose loss is multiplied by 0) instead. Gradients are
reduced by SUM (`set_gradient_divide_factor(1)`, with sum-only collectives: gloo has no pre-scaled sum):
as with DDP, the batch's loss weights are fixed before the update, so the batch's gradient is the sum
of the ranks' gradients. Each micro-batch's gradients are reduce-scattered as soon as its backward is
done (the shards accumulate): no rank ever holds a whole model's gradient. `clip_grad_norm_` computes
the global norm over the shards; AdamW steps each rank's shard.

Weights out. `gather_full` gives rank 0 the full state dict (tensor by tensor, offloaded to CPU; the
other ranks keep nothing) and, for checkpoints, the full optimizer state in the single-process format
(keyed by parameter index, as `torch.optim.AdamW.state_dict()`), so a checkpoint written by k sharded
ranks is an ordinary checkpoint: 1 rank resumes it, and `load_full` reshards one onto any k.

Devices and precision. CPU ranks use gloo, CUDA ranks `cuda:<LOCAL_RANK>` and NCCL. The precision is
`train.dtype` on every device (never chosen by the device): the sharded parameters are fp32 (the master
weights; AdamW's moments are fp32 too), and with bfloat16 FSDP2's `MixedPrecisionPolicy` all-gathers
them as bf16 for the forward and backward and reduce-scatters the gradients in fp32. The KL reference
is loaded in the compute dtype and sharded the same way (`shard_reference`): no rank holds a whole copy.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from harnessrl.adapter import Batch
from harnessrl.modeling.causal_lm import CausalLM
from harnessrl.modeling.families import model_impl_of
from harnessrl.modeling.loading import read_model_config, resolve_model
from harnessrl.modeling.weight_files import WeightReader
from harnessrl.trainer.ddp import RankLoss
from harnessrl.trainer.forward import SHARDED_STEP, layer_forward, selected_logprobs
from harnessrl.trainer.ppo import row_groups


class ShardedLoss(RankLoss):
    """The FSDP root: the micro-batch loss of its policy; an empty micro-batch is an idle one."""

    def idle(self) -> Tensor:
        """`idle_loss`: every unit joins the micro-batch's collectives."""
        return idle_loss(self.policy)


def idle_loss(policy: CausalLM) -> Tensor:
    """A zero loss whose forward and backward pass through every unit (so this rank joins every
    all-gather and reduce-scatter of a micro-batch) and whose gradients are exactly zero."""
    device = next(policy.parameters()).device
    tokens = torch.zeros((1, 2), dtype=torch.long, device=device)
    select = torch.ones((1, 1), dtype=torch.bool, device=device)
    sel = selected_logprobs(policy, tokens, select, torch.ones(1, device=device), 0, checkpoint_layers=False)
    return sel.logprobs.sum() * 0.0


def mixed_precision(dtype: torch.dtype) -> MixedPrecisionPolicy:
    """The compute precision `dtype` (`train.dtype`) over fp32 shards: bf16 parameters in the forward and
    backward with fp32 gradient reduction, or fp32 throughout (exact: the 1-process update's)."""
    if dtype == torch.float32:
        return MixedPrecisionPolicy()
    # inputs are not cast: the root's include the proximal logprobs (fp32), the layers' are bf16 already
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)


def _mesh(model: nn.Module, device: torch.device | None) -> Any:
    """The 1-D mesh of all ranks on `device`'s type (None: where the model's parameters are)."""
    kind = device.type if device is not None else next(model.parameters()).device.type
    return init_device_mesh(kind, (dist.get_world_size(),))


def _shard_layers(
    model: CausalLM, mp: MixedPrecisionPolicy, device: torch.device | None = None
) -> list[FSDPModule]:
    """Every decoder layer of `model` an FSDP unit, called through its `sharded_step`."""
    mesh = _mesh(model, device)
    units: list[FSDPModule] = []
    for layer in model.model.blocks:
        setattr(layer, SHARDED_STEP, functools.partial(layer_forward, layer))
        units.append(fully_shard(layer, mesh=mesh, mp_policy=mp))
        register_fsdp_forward_method(layer, SHARDED_STEP)
    return units


def shard(
    policy: CausalLM,
    optimizer: torch.optim.Optimizer | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
) -> ShardedLoss:
    """Shard `policy` (fp32) in place over all ranks of the process group (each layer a unit, the rest the
    root), computing in `dtype`, and return the root. An `optimizer` built on the unsharded parameters
    (and not stepped yet) is pointed at the sharded ones. A policy on the meta device (`device`: where its
    shards will live) is sharded as it is, and filled afterwards by `fill_shards`."""
    if not hasattr(FSDPModule, "set_force_sum_reduction_for_comms"):  # added to FSDP2 after torch 2.6
        raise RuntimeError(f"train.parallel: fsdp needs a newer torch than {torch.__version__} (FSDP2's "
                           "set_force_sum_reduction_for_comms); upgrade torch, or use train.parallel: ddp")  # fmt: skip
    if next(policy.parameters()).dtype != torch.float32:
        raise ValueError("FSDP shards fp32 parameters (the master weights); load the policy in float32")
    mesh = _mesh(policy, device)
    mp = mixed_precision(dtype)
    units = _shard_layers(policy, mp, device)
    root = fully_shard(ShardedLoss(policy), mesh=mesh, mp_policy=mp)
    for unit in (*units, root):
        unit.set_gradient_divide_factor(1.0)  # SUM over ranks, not the mean
        unit.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    if optimizer is not None:
        _adopt(optimizer, policy)
    return root  # type: ignore[return-value]


def meta_model(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> CausalLM:
    """The model of a folder built on the meta device (no memory), tied as the folder says: what `shard`
    takes before `fill_shards` gives each rank its rows."""
    folder = resolve_model(model_dir)
    if model_impl_of(folder) == "transformers":
        raise ValueError(f"train.parallel: fsdp shards the builtin families; {folder} takes the transformers "
                         "path: use train.parallel: ddp (or train.world_size: 1)")  # fmt: skip
    with torch.device("meta"):
        model = CausalLM(read_model_config(folder)).to(dtype)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def fill_shards(model: CausalLM, model_dir: str | Path, device: torch.device) -> None:
    """Collective-free: allocate this rank's shards of a model sharded on the meta device and read into
    each one only its rows of the tensor (FSDP2 shards dim 0 in chunks of ceil(n/k) rows), straight from
    the folder's safetensors (`WeightReader`): no rank ever holds the whole model."""
    model.to_empty(device=device)  # FSDP2 keeps ties and re-points its shards (swap_tensors on DTensors)
    rank, world = dist.get_rank(), dist.get_world_size()
    with WeightReader(resolve_model(model_dir)) as reader, torch.no_grad():
        for name, param in model.named_parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            rows = -(-param.shape[0] // world)
            start = min(rank * rows, param.shape[0])
            if local.shape[0]:
                local.copy_(reader.get(name, local.dtype, rows=slice(start, start + local.shape[0])))


def shard_reference(ref: CausalLM, device: torch.device | None = None) -> CausalLM:
    """Shard the frozen KL reference (loaded in the compute dtype) as the policy is sharded: each layer a
    unit gathered when it runs, the rest a root unit that `trainer.ppo` gathers around the reference's
    forward (`FSDPModule.unshard`). Every rank calls it, after `shard`. A reference on the meta device
    (`device`: where its shards will live) is filled by `fill_shards` afterwards."""
    mp = MixedPrecisionPolicy()  # already in the compute dtype
    _shard_layers(ref, mp, device)
    fully_shard(ref, mesh=_mesh(ref, device), mp_policy=mp)
    return ref


def load_sharded_reference(model_dir: str | Path, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """The frozen KL reference in `dtype`, sharded like the policy and filled shard by shard."""
    ref = meta_model(model_dir, dtype).requires_grad_(False)
    shard_reference(ref, device)
    fill_shards(ref, model_dir, device)
    return ref.eval()


def _adopt(optimizer: torch.optim.Optimizer, policy: nn.Module) -> None:
    """Point a fresh single-group optimizer at the policy's (now sharded) parameters."""
    if optimizer.state or len(optimizer.param_groups) != 1:
        raise ValueError("shard the policy before the optimizer's first step, with one parameter group")
    params = list(policy.parameters())
    if len(params) != len(optimizer.param_groups[0]["params"]):
        raise ValueError("the optimizer does not hold exactly the policy's parameters")
    optimizer.param_groups[0]["params"] = params


def micro_batch_slots(batch: Batch, shards: list[list[int]], token_budget: int, rank: int) -> list[list[int]]:
    """This rank's micro-batches, padded with idle ones ([]) to the largest count of any rank (each
    rank computes every rank's count from the same batch: no communication)."""
    groups = [row_groups(batch, rows, token_budget) for rows in shards]
    n = max(1, *(len(g) for g in groups))
    return groups[rank] + [[] for _ in range(n - len(groups[rank]))]


def _names(policy: nn.Module) -> list[str]:
    """Parameter names in `parameters()` order (a tied weight once): the single-process optimizer's ids."""
    return [name for name, _ in policy.named_parameters()]


def gather_full(
    policy: CausalLM, optimizer: torch.optim.Optimizer, with_optimizer: bool
) -> tuple[dict[str, Tensor] | None, dict[str, Any] | None]:
    """Collective: rank 0 gets the full model state dict (and the optimizer's, in the single-process
    format) on CPU; the other ranks get (None, None). One full tensor at a time is in flight."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = cast("dict[str, Tensor]", get_model_state_dict(policy, options=opts))
    osd = get_optimizer_state_dict(policy, optimizer, options=opts) if with_optimizer else None
    if dist.get_rank() != 0:
        return None, None
    if policy.config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    return weights, None if osd is None else to_index_form(osd, _names(policy))


def to_index_form(osd: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter name -> keyed by index, as `Optimizer.state_dict()`."""
    index = {name: i for i, name in enumerate(names)}
    state = {index[n]: v for n, v in osd["state"].items() if n in index}
    groups = [
        {**g, "params": sorted(index[n] for n in g["params"] if n in index)} for g in osd["param_groups"]
    ]
    return {"state": state, "param_groups": groups}


def to_name_form(osd: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The inverse of `to_index_form`."""
    state = {names[int(i)]: v for i, v in osd["state"].items()}
    groups = [{**g, "params": [names[int(i)] for i in g["params"]]} for g in osd["param_groups"]]
    return {"state": state, "param_groups": groups}


def load_full(
    policy: CausalLM,
    optimizer: torch.optim.Optimizer,
    weights: dict[str, Tensor] | None,
    osd: dict[str, Any] | None,
) -> None:
    """Collective: rank 0's full state (as read from a checkpoint: weights and the single-process
    optimizer state) is broadcast and resharded onto every rank's shards; the others pass None."""
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    model_sd: dict[str, Tensor] = {}
    optim_sd: dict[str, Any] = {}
    if dist.get_rank() == 0:
        if weights is None or osd is None:
            raise ValueError("rank 0 must pass the checkpoint's weights and optimizer state")
        model_sd = dict(weights)
        if policy.config.tie_word_embeddings:
            model_sd["lm_head.weight"] = model_sd["model.embed_tokens.weight"]
        optim_sd = to_name_form(osd, _names(policy))
    set_model_state_dict(policy, cast("dict[str, Any]", model_sd), options=opts)
    set_optimizer_state_dict(policy, optimizer, optim_sd, options=opts)


def model_view(config_of: CausalLM, weights: dict[str, Tensor]) -> CausalLM:
    """A plain (unsharded) policy whose parameters are the gathered tensors themselves (no copy): what
    `save_model`, `publish_weights` and `save_checkpoint` take."""
    with torch.device("meta"):
        view = CausalLM(config_of.config)
    state = dict(weights)
    if view.config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    view.load_state_dict(state, assign=True, strict=True)
    if view.config.tie_word_embeddings:
        view.lm_head.weight = view.model.embed_tokens.weight
    return view.eval()


def local_state_bytes(policy: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds of parameters, gradients and optimizer state (a sharded tensor counts its
    local shard; a tied weight once)."""

    def size(t: Tensor) -> int:
        local = t.to_local() if isinstance(t, DTensor) else t
        return local.numel() * local.element_size()

    params = list(policy.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, Tensor)]
    return {
        "params": sum(size(p) for p in params),
        "grads": sum(size(g) for g in grads),
        "optimizer": sum(size(v) for v in states),
    }
