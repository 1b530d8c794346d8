"""Training precision (`train.dtype`): float32, or bfloat16 with exact fp32 master weights.

bfloat16 (one process, DDP). The model's parameters are bf16: the forward, the backward and the
gradients run in bf16, and the KL reference is loaded in bf16 too (same precision as the policy, so
k3 is exactly 0 at step 0). The optimizer (`MasterAdamW`) keeps for every bf16 parameter the 16 bits
that fp32 has beyond bf16, so the master weight is an exact fp32 number held as

    master_bits = (bf16_bits << 16) + low        (int32 bit patterns; low ∈ [-2^15, 2^15) an int16)

where the bf16 half is the master rounded to nearest (ties away from zero). Each step rebuilds one
parameter's fp32 master at a time, runs torch's own AdamW arithmetic on it with the gradient in fp32
and fp32 moments, and splits it again. So the update is bit-identical to fp32 AdamW on the master
weights given the same gradients, while the resident state is 2 (bf16 weight) + 2 (low half) + 2 (bf16
gradient) + 8 (fp32 moments) = 14 bytes a parameter instead of fp32's 16, and activations are halved.
Gradients of several micro-batches add up in bf16 (the one place precision is given up).
Parameters that are not bf16 (a LoRA adapter's fp32 A and B over a bf16 base) step as plain AdamW.

`train.exp_avg_dtype: bfloat16` (Megatron's name) stores the first moment `exp_avg` of every bf16
parameter in bf16: the resident state is 2 + 2 + 2 + 2 (bf16 `exp_avg`) + 4 (fp32 `exp_avg_sq`) = 12
bytes a parameter; weight and optimizer state alone 10 against fp32 AdamW's 12. Each chunk's fp32
`exp_avg` is rebuilt, stepped by the same AdamW arithmetic and rounded back to the nearest bf16 (ties to
even), so the step equals fp32 AdamW whose `exp_avg` is rounded to bf16 after every step
(`tests/trainer/test_precision.py`). The cost: each rounding is at most 2^-8 of |exp_avg|, and with
β1 = 0.9 every past rounding decays by 0.9 a step, so the first moment, and with it the update (linear
in it for a given second moment), is off by at most 2^-8 / (1 − β1) ≈ 4 % of its largest recent value,
well under 1 % in practice (docs/scale.md). The second moment stays fp32: with β2 = 0.999 a step
changes `exp_avg_sq` by 10^-3·(g² − it), and half a bf16 step is 2^-9 to 2^-8 of it, so a bf16 second
moment would never decay and would grow only where g² is over 3 to 5 times it: it would stagnate.
Only `train.dtype: bfloat16` in one process or DDP has bf16 parameters to apply it to; the config
refuses it with fp32 training, FSDP (fp32 shards) and LoRA (fp32 adapters).

`train.bf16_rounding: stochastic` changes how the bf16 weights (what the forward, the backward and the
engine see) are taken from the exact masters after each step. Rounded to nearest, a weight moves only
once its master has moved half a bf16 step away, 2^-9 of its magnitude: at a learning rate of 2e-5, one
Adam step (about lr per weight) moves 4 % of SmolLM2's weights and ten steps in one direction 31 %; after
the bf16 demo's 14 steps 16 % of the weights had changed and the change the model ran with was 0.64 of the
masters' in norm, at a cosine of 0.50 to it (docs/scale.md). The policy lags its own updates. Rounded
stochastically (up with the probability of the dropped fraction, from a generator seeded by the step, so
DDP ranks draw alike and a resume draws as the run would have), each weight is its master in expectation:
the policy follows the updates at the cost of rounding noise of the same size as nearest's. The low half
then needs 17 bits: it is kept as int32, 2 bytes a parameter more (16 resident, 14 with a bf16 first
moment). The masters, and so the update given the same gradients, are the same bits either way.

FSDP (`train.parallel: fsdp`) keeps its sharded parameters fp32 (they are the master weights) and
computes in bf16 through FSDP2's `MixedPrecisionPolicy` (`trainer.fsdp.mixed_precision`): the choice
follows `train.dtype` on every device, never the device alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim.adamw import adamw

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LOW_KEY = "master_low"  # the int16 low half of a bf16 parameter's fp32 master weight (optimizer state)
MOMENTS = ("exp_avg", "exp_avg_sq")
ROUNDINGS = (
    "nearest",
    "stochastic",
)  # `train.bf16_rounding`: how the bf16 weights are taken from the masters
EXP_AVG_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # `train.exp_avg_dtype`
CHUNK = 1 << 20  # elements of a bf16 parameter stepped at a time (`MasterAdamW._step_bf16`)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a `train.dtype` name."""
    if name not in DTYPES:
        raise ValueError(f"train.dtype must be one of {sorted(DTYPES)}, not {name!r}")
    return DTYPES[name]


def split_master(master: Tensor) -> tuple[Tensor, Tensor]:
    """An fp32 tensor -> (its bf16 rounding to nearest, the int16 low half) with `join_master` exact."""
    bits = master.contiguous().view(torch.int32).to(torch.int64)
    high = (bits + 0x8000) >> 16  # floor shift: rounds the magnitude to nearest, ties away from zero
    low = (bits - (high << 16)).to(torch.int16)  # in [-2^15, 2^15)
    return high.to(torch.int32).to(torch.int16).view(torch.bfloat16), low


def split_master_stochastic(master: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """An fp32 tensor -> (its bf16 rounded stochastically: the magnitude up with the probability of the
    dropped 16 bits' fraction, so the expectation is `master`; the int32 low half) with `join_master`
    exact. The low half lies in (-2^16, 2^16): it needs 17 bits."""
    bits = master.contiguous().view(torch.int32).to(torch.int64)
    noise = torch.randint(0, 1 << 16, bits.shape, generator=generator, device=bits.device, dtype=torch.int64)
    high = (bits + noise) >> 16  # a float's bits are sign and magnitude: this rounds the magnitude
    low = (bits - (high << 16)).to(torch.int32)
    return high.to(torch.int32).to(torch.int16).view(torch.bfloat16), low


def join_master(high: Tensor, low: Tensor) -> Tensor:
    """The exact fp32 master weight of a bf16 tensor and its int16 low half (`split_master`)."""
    bits = (high.contiguous().view(torch.int16).to(torch.int32) << 16) + low.to(torch.int32)
    return bits.view(torch.float32)


class MasterAdamW(torch.optim.AdamW):
    """AdamW over bf16 parameters with exact fp32 master weights and fp32 moments (module docstring),
    the first moment in bf16 with `exp_avg_dtype="bfloat16"`, the bf16 weights rounded from the masters
    stochastically with `rounding="stochastic"` (draws seeded by `seed` and the step); fp32 parameters step as
    `torch.optim.AdamW` does. Only the plain options (no amsgrad, foreach, fused, capturable or
    maximize)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        exp_avg_dtype: str = "float32",
        rounding: str = "nearest",
        seed: int = 0,
        **flags: Any,
    ) -> None:
        for flag in ("amsgrad", "foreach", "fused", "capturable", "maximize", "differentiable"):
            if flags.get(flag):
                raise ValueError(f"MasterAdamW does not support {flag}=True")
        if exp_avg_dtype not in EXP_AVG_DTYPES:
            raise ValueError(
                f"train.exp_avg_dtype must be one of {sorted(EXP_AVG_DTYPES)}, not {exp_avg_dtype!r}"
            )
        if rounding not in ROUNDINGS:
            raise ValueError(f"train.bf16_rounding must be one of {list(ROUNDINGS)}, not {rounding!r}")
        # attributes, not param-group options: a resume converts the saved state to what they ask for
        self.exp_avg_dtype = exp_avg_dtype
        self.rounding = rounding
        self.seed = seed
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **flags)

    def _state_dtypes(self, p: Tensor) -> dict[str, torch.dtype]:
        """The dtype of each optimizer-state tensor of `p` (a bf16 parameter also has its low half)."""
        if p.dtype != torch.bfloat16:
            return {"exp_avg": torch.float32, "exp_avg_sq": torch.float32}
        return {
            "exp_avg": EXP_AVG_DTYPES[self.exp_avg_dtype],
            "exp_avg_sq": torch.float32,
            LOW_KEY: torch.int32 if self.rounding == "stochastic" else torch.int16,
        }

    def _generator(self, step: Tensor, device: torch.device) -> torch.Generator | None:
        """The draws of one optimizer step's stochastic rounding (None: nearest), seeded by `seed` and the
        step count alone, so every DDP rank and a resumed run draw the same."""
        if self.rounding != "stochastic":
            return None
        gen = torch.Generator(device=device)
        gen.manual_seed((self.seed * 1_000_003 + int(step.item())) % (1 << 63))
        return gen

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """One AdamW step; each bf16 parameter is updated through its rebuilt fp32 master."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        gens: dict[tuple[int, torch.device], torch.Generator | None] = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    for key, dtype in self._state_dtypes(p).items():
                        state[key] = torch.zeros_like(p, dtype=dtype)
                if p.dtype == torch.bfloat16:
                    at = (int(state["step"].item()), p.device)  # one stream per step and device
                    if at not in gens:
                        gens[at] = self._generator(state["step"], p.device)
                    self._step_bf16(p, state, group, gens[at])
                else:
                    _adamw(p, p.grad, state, state["step"], group)
        return loss

    @staticmethod
    def _step_bf16(
        p: Tensor, state: dict[str, Any], group: dict[str, Any], generator: torch.Generator | None = None
    ) -> None:
        """Step a bf16 parameter CHUNK elements at a time: its fp32 master and gradient and the int64
        bit arithmetic of `join_master`/`split_master` are built for one chunk, not the whole tensor
        (for a 28M-parameter embedding that was ~1 GB of temporaries at the step's peak). AdamW is
        elementwise, so every chunk steps with the same step count and the result is the same. A bf16
        `exp_avg` is stepped as its fp32 value and rounded back to the nearest bf16. With a `generator`
        the new bf16 weight is the master rounded stochastically (`split_master_stochastic`)."""
        assert p.grad is not None  # step() skips parameters without one
        parts = (p, p.grad, state[LOW_KEY], state["exp_avg"], state["exp_avg_sq"])
        flat = [t.view(-1) for t in parts] if all(t.is_contiguous() for t in parts) else list(parts)
        size = CHUNK if flat[0].dim() == 1 else flat[0].numel()
        for start in range(0, p.numel(), size):
            w, grad, low, exp_avg, exp_avg_sq = (t[start : start + size] if t.dim() == 1 else t for t in flat)
            master = join_master(w, low)
            exp_avg32 = exp_avg if exp_avg.dtype == torch.float32 else exp_avg.float()
            _adamw(
                master, grad, {"exp_avg": exp_avg32, "exp_avg_sq": exp_avg_sq}, state["step"].clone(), group
            )
            if exp_avg32 is not exp_avg:
                exp_avg.copy_(exp_avg32)  # round to nearest (ties to even)
            high, new_low = (
                split_master(master) if generator is None else split_master_stochastic(master, generator)
            )
            w.copy_(high)
            low.copy_(new_low)
        state["step"].add_(1)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As `Optimizer.load_state_dict`, but every state tensor takes the dtype this optimizer keeps it
        in (`_state_dtypes`: the base class casts them all to the parameter's dtype): the low halves int16,
        `exp_avg_sq` fp32, `exp_avg` in `exp_avg_dtype`, so a resume may switch `train.exp_avg_dtype`. A
        low half saved by stochastic rounding (int32) loaded for nearest is re-split: the parameter becomes
        its master rounded to nearest, the master unchanged."""
        kept = {i: {k: v for k, v in s.items() if k in (*MOMENTS, LOW_KEY)}
                for i, s in state_dict["state"].items()}  # fmt: skip
        super().load_state_dict(state_dict)
        ids = [p for g in self.param_groups for p in g["params"]]
        for i, tensors in kept.items():
            p = ids[int(i)]
            dtypes = self._state_dtypes(p)
            for k, v in tensors.items():
                if k == LOW_KEY and v.dtype == torch.int32 and dtypes[k] == torch.int16:
                    with torch.no_grad():
                        high, low = split_master(join_master(p.detach(), v.to(p.device)))
                        p.copy_(high)
                    self.state[p][k] = low
                    continue
                self.state[p][k] = v.to(device=p.device, dtype=dtypes.get(k, v.dtype))


def _adamw(param: Tensor, grad: Tensor, state: dict[str, Any], step: Tensor, group: dict[str, Any]) -> None:
    """torch's own single-tensor AdamW on one fp32 tensor (`step` is incremented, then used)."""
    beta1, beta2 = group["betas"]
    adamw([param], [grad.float()], [state["exp_avg"]], [state["exp_avg_sq"]], [], [step], foreach=False,
          amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
          eps=group["eps"], maximize=False)  # fmt: skip


def master_weights(optimizer: torch.optim.Optimizer, param: Tensor) -> Tensor:
    """The fp32 master of `param` (a bf16 parameter under `MasterAdamW` after its first step: exact;
    otherwise the parameter in fp32)."""
    low = optimizer.state.get(param, {}).get(LOW_KEY)
    return join_master(param, low) if low is not None else param.detach().float()


def make_optimizer(
    params: Iterable[Any],
    dtype: torch.dtype,
    lr: float,
    weight_decay: float,
    exp_avg_dtype: str = "float32",
    rounding: str = "nearest",
    seed: int = 0,
) -> torch.optim.Optimizer:
    """The trainer's AdamW: `MasterAdamW` when the model trains in bf16 (its first moment in
    `exp_avg_dtype`, its weights rounded from the masters by `rounding`), else `torch.optim.AdamW` (fp32
    moments only)."""
    if dtype == torch.bfloat16:
        return MasterAdamW(
            params,
            lr=lr,
            weight_decay=weight_decay,
            exp_avg_dtype=exp_avg_dtype,
            rounding=rounding,
            seed=seed,
        )
    if exp_avg_dtype != "float32":
        raise ValueError(
            f"train.exp_avg_dtype {exp_avg_dtype!r} needs train.dtype: bfloat16 (fp32 training keeps fp32 moments)"
        )
    if rounding != "nearest":
        raise ValueError(
            f"train.bf16_rounding {rounding!r} needs train.dtype: bfloat16 (fp32 weights are not rounded)"
        )
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
