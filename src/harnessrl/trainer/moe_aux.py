"""The MoE load-balancing (router auxiliary) loss in the RL update, as `train.moe_aux_loss_coef` sets it.

Off by default (0): the RL objective alone, as the peers train MoE models with RL (the experts the
engine sampled with are the ones the update scores; pushing the router towards balance moves routing
away from what the rollouts used). With a coefficient c > 0, on a transformers-path MoE model
(modeling/hf_generic.py), each micro-batch's loss gets

    c · aux(micro-batch) · Σ w_t (the micro-batch's share of the update's token weights)

where `aux` is the model's own load-balancing function (transformers' `load_balancing_loss_func` of
the model's module: Switch Transformer's E · Σ_e f_e · P_e over the routers of every layer) on the
router logits of the same forward that produced the logprobs, over the rows' real tokens (padding
masked out). Weighted by Σ w_t, the micro-batches' terms add up to c times the token-weighted mean of
`aux` over the update, whatever the micro-batching, as the PPO term does.

The router logits are taken with forward hooks on the modules the model itself records them from
(`_can_record_outputs["router_logits"]`: its router class and output index), only during the training
forward (removed before the backward, so recomputation under checkpointing records nothing).
With a coefficient the micro-batch runs padded (`aux_pack_rows`): the loss is defined over the padded
rows' real tokens, which packed rows (cut at their last trained token) do not all run.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor


class RouterAux:
    """Router logits recorded during one forward, and the weighted aux loss they give."""

    def __init__(self, model: Any, coef: float, lengths: list[int]) -> None:
        self.model, self.coef, self.lengths = model, coef, lengths
        self.logits: list[Tensor] = []

    def loss(self, weight: Tensor) -> Tensor | float:
        """`coef · aux · weight` (0.0 when the coefficient is 0)."""
        if self.coef == 0:
            return 0.0
        if not self.logits:
            raise RuntimeError("no router logits were recorded during the forward (is this an MoE model?)")
        fn, experts, top_k = _balancing(self.model)
        mask = torch.zeros(len(self.lengths), max(self.lengths), device=self.logits[0].device)
        for i, n in enumerate(self.lengths):
            mask[i, :n] = 1.0
        aux = fn(tuple(self.logits), experts, top_k, mask)
        return self.coef * aux * weight


def _router_recorder(model: Any) -> tuple[type[torch.nn.Module], int]:
    spec = (getattr(model.model, "_can_record_outputs", None) or {}).get("router_logits")
    if spec is None:
        raise ValueError(
            f"train.moe_aux_loss_coef > 0, but {model.config.architecture} records no router logits "
            "(not an MoE model of transformers); set train.moe_aux_loss_coef: 0"
        )
    if isinstance(spec, type):
        return spec, 0
    return spec.target_class, int(spec.index or 0)


def _balancing(model: Any) -> tuple[Any, int, int]:
    """The model module's load-balancing function, its expert count and top-k."""
    fn = getattr(sys.modules[type(model.full).__module__], "load_balancing_loss_func", None)
    text = model.model.config
    experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    top_k = getattr(text, "num_experts_per_tok", None) or getattr(text, "top_k_experts", None)
    if fn is None or not experts or not top_k:
        raise ValueError(
            f"train.moe_aux_loss_coef > 0: transformers has no load-balancing loss for "
            f"{model.config.architecture}; set train.moe_aux_loss_coef: 0"
        )
    return fn, int(experts), int(top_k)


def check_moe_aux(model: Any, coef: float, pack_rows: str = "auto") -> None:
    """Refuse `train.moe_aux_loss_coef` > 0 for a model without a router and a transformers
    load-balancing loss, or with `train.pack_rows: on`, when the trainer loads it (not at the first update)."""
    if coef > 0:
        if not getattr(model, "generic", False):
            raise ValueError(_DENSE)
        _router_recorder(model)
        _balancing(model)
        aux_pack_rows(pack_rows, coef)


def aux_pack_rows(pack_rows: str, coef: float) -> str:
    """`train.pack_rows` for a micro-batch whose router loss has coefficient `coef`: as set when 0, else
    padded ("off"; `on` is refused): the loss covers every real token of the padded rows."""
    if coef == 0:
        return pack_rows
    if pack_rows == "on":
        raise ValueError(
            f"train.pack_rows: on with train.moe_aux_loss_coef: {coef:g}: the router loss is taken over the "
            "rows run padded; set train.pack_rows: auto (runs padded) or off"
        )
    return "off"


_DENSE = (
    "train.moe_aux_loss_coef > 0 needs an MoE model on the transformers path; the builtin families are "
    "dense (set train.moe_aux_loss_coef: 0)"
)


@contextmanager
def router_aux(model: Any, coef: float, lengths: list[int]) -> Iterator[RouterAux]:
    """Record the router logits of the forward run inside (when `coef` > 0) for `RouterAux.loss`;
    `lengths`: the real token count of each right-padded row of the micro-batch."""
    rec = RouterAux(model, coef, lengths)
    if coef == 0:
        yield rec
        return
    if not getattr(model, "generic", False):
        raise ValueError(_DENSE)
    cls, index = _router_recorder(model)
    hooks = [
        m.register_forward_hook(
            lambda _m, _a, out: rec.logits.append(out[index] if isinstance(out, tuple) else out)
        )
        for m in model.model.modules()
        if isinstance(m, cls)
    ]
    try:
        yield rec
    finally:
        for h in hooks:
            h.remove()
