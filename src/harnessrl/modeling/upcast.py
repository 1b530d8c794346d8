"""bf16 training on a CPU without bf16 matrix instructions: the linear layers' products in fp32.

On an AVX2 CPU (this project's 2-core machines) PyTorch has no fast bf16 matrix product: `aten::mm` on bf16
runs at 3–7 GFLOP/s against 30–60 for fp32 on the same shapes, and a `train.dtype: bfloat16` update of
SmolLM2 took 37× the fp32 one (bench/results/scale_bf16_rows8.json), 70% of it in `aten::mm`. Here each
linear layer's forward and backward products convert their bf16 operands to fp32, multiply, and round the
result to bf16: what a GPU's bf16 GEMM computes (fp32 accumulation, a bf16 result), without its speed but
without the CPU's slow bf16 kernel either. Weights, gradients, saved activations and the optimizer's state
stay as `train.dtype` makes them; only one layer's operands exist in fp32 at a time.

`train.matmul: auto` chooses this for bf16 weights on CPUs whose PyTorch capability is below AVX-512
(`needs_upcast`); `aten` keeps PyTorch's bf16 products (modeling/packed.py's `use_onednn_for_training`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# PyTorch's CPU capabilities with fast bf16 products (oneDNN's AVX-512 and AMX kernels; ARM's SVE)
FAST_BF16_CAPABILITIES = ("AVX512", "AVX512_BF16", "AMX", "SVE", "SVE256")


def needs_upcast(dtype: torch.dtype, device: torch.device) -> bool:
    """True for bf16 weights on a CPU whose PyTorch capability has no fast bf16 matrix product."""
    if dtype != torch.bfloat16 or device.type != "cpu":
        return False
    return torch.backends.cpu.get_cpu_capability() not in FAST_BF16_CAPABILITIES


class _UpcastLinear(torch.autograd.Function):
    """y = x Wᵀ + b with fp32 products and a result in x's dtype; the backward the same way."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        x, weight = ctx.saved_tensors
        g = grad.float()
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = (g @ weight.float()).to(x.dtype)
        flat = g.reshape(-1, g.shape[-1])
        if ctx.needs_input_grad[1]:
            dw = (flat.t() @ x.reshape(-1, x.shape[-1]).float()).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = flat.sum(0).to(weight.dtype)
        return dx, dw, db


class _UpcastForward:
    """The replacement `forward` of one linear layer (forward hooks, such as a LoRA adapter's, still run)."""

    def __init__(self, layer: nn.Linear) -> None:
        self.layer = layer

    def __call__(self, x: Tensor) -> Tensor:
        lin = self.layer
        return _UpcastLinear.apply(x, lin.weight, lin.bias)  # type: ignore[no-any-return]


def install_upcast(model: nn.Module) -> int:
    """Route every bf16 linear layer of `model` through fp32 products; returns how many."""
    layers = [m for m in model.modules() if isinstance(m, nn.Linear) and m.weight.dtype == torch.bfloat16]
    for lin in layers:
        lin.forward = _UpcastForward(lin)  # type: ignore[method-assign, assignment]
    return len(layers)


def uses_upcast(model: nn.Module) -> bool:
    """Whether `install_upcast` routed `model`'s linear layers (a reference model then follows its policy)."""
    return any(isinstance(m.__dict__.get("forward"), _UpcastForward) for m in model.modules())
