"""oneDNN-packed linear layers for the builtin engine on CPU.

torch's `F.linear` on CPU goes to MKL's sgemm, which repacks the weight on every call and, on some
CPUs (AMD EPYC here), runs its slow generic path: with the 16-row products of a decode step it reaches
~120 GFLOP/s on two cores, where oneDNN with a weight packed once reaches ~380 (and ~500 instead of
~200 for a 1,600-token prefill). `PackedLinears` keeps a oneDNN-packed copy of every `nn.Linear`
weight of an inference model and routes the layer through it; `refresh` repacks after the parameters
change. The engine then calls `release_originals`: the fp32 parameters of the packed layers are freed
(a placeholder keeps their shape) and the packed copies become the one copy of those weights — `load`
packs new weights straight from a state dict, `state_dict` unpacks them (exactly: packing only
reorders), and sleep keeps or drops them. A weight shared with a module that is not packed (SmolLM2's
output projection is its token embedding) keeps its parameter.

The packed product sums in a different order than MKL's, so the engine's logprobs move slightly away
from the trainer's (which stay on `F.linear`, forward and backward). `choose_matmul` therefore checks
the difference on the real weights at startup, in the quantity that matters — the log-probabilities,
through the whole model, of the tokens sampling reaches (the top 20 at each position of a probe
sequence) — and keeps `F.linear` when the packed path is not within `PROBE_BOUND` of it (a path that
rounds through bf16 or TF32 differs by 1e-3 or more; fp32 in another summation order by ~5e-5 on
SmolLM2), or is unavailable.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
from torch import Tensor, nn

from harnessrl.modeling.causal_lm import CausalLM
from harnessrl.modeling.memory import release_freed_memory
from harnessrl.modeling.transformer import MLP, Attention
from harnessrl.modeling.upcast import install_upcast, needs_upcast

log = logging.getLogger(__name__)

Matmul = Literal["auto", "onednn", "aten"]
# Max |logprob difference| that `auto` accepts, over the top PROBE_TOP tokens at each of PROBE_TOKENS
# positions: the engine/trainer exactness bound.
PROBE_BOUND = 1e-4
PROBE_TOKENS = 48
PROBE_TOP = 20
# The row count the packed layout is chosen for (oneDNN accepts any row count at run time).
PACK_ROWS_HINT = 16


def onednn_available() -> bool:
    """True when this torch build can pack and run oneDNN linear layers."""
    ops = getattr(torch.ops, "mkldnn", None)
    return bool(
        torch.backends.mkldnn.is_available()
        and ops is not None
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


class _PackedForward:
    """The replacement `forward` of one linear layer: x @ W.T through oneDNN with a prepacked W, plus an
    unmerged LoRA term (x @ down) @ up when one is set (`PackedLinears.set_lora`)."""

    def __init__(self, packed: Tensor) -> None:
        self.packed = packed
        self.lora: tuple[Tensor, Tensor] | None = None  # (down [in, R], up [R, out]): s · B A, unmerged

    def __call__(self, x: Tensor) -> Tensor:
        y = torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        if self.lora is not None:
            down, up = self.lora
            y.add_((x @ down) @ up)
        return y


def _pack(*weights: Tensor) -> _PackedForward:
    """One packed product computing the given layers' outputs side by side (their weights stacked)."""
    w = weights[0] if len(weights) == 1 else torch.cat(weights)
    return _PackedForward(torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_ROWS_HINT))


# (module whose attribute routes the product, attribute name, the linear layers computed by it)
_Plan = list[tuple[nn.Module, str, list[nn.Linear]]]


class PackedLinears:
    """Routes every bias-free `nn.Linear` of `model` (CPU, not training) through oneDNN-packed weights.

    A Llama attention block's q/k/v projections and an MLP's gate/up projections become one product each
    (`fused_qkv`, `fused_gate_up`): fewer, wider products run closer to the CPU's peak at decode sizes.
    """

    def __init__(self, model: nn.Module, fuse: bool = True) -> None:
        self.model = model
        self.fuse = fuse  # False: every layer its own product (per-request LoRA hooks need them)
        self.active = False
        self.released: set[str] = set()  # weights whose packed copy is the only copy (`release_originals`)

    def _linears(self) -> list[nn.Linear]:
        return _bias_free_linears(self.model)

    def _plan(self) -> _Plan:
        plan: _Plan = []
        fused: set[int] = set()  # layers computed inside a fused product: not packed on their own
        for mod in self.model.modules() if self.fuse else ():
            if isinstance(mod, Attention) and mod.q_proj.bias is None:  # biased (Qwen2): F.linear
                plan.append((mod, "fused_qkv", [mod.q_proj, mod.k_proj, mod.v_proj]))
            elif isinstance(mod, MLP) and mod.gate_proj.bias is None:
                plan.append((mod, "fused_gate_up", [mod.gate_proj, mod.up_proj]))
            else:
                continue
            fused.update(map(id, plan[-1][2]))
        plan += [(lin, "forward", [lin]) for lin in self._linears() if id(lin) not in fused]
        return plan

    def _names(self) -> dict[int, str]:
        return {id(m): f"{name}.weight" for name, m in self.model.named_modules() if isinstance(m, nn.Linear)}

    def refresh(self, state: Mapping[str, Tensor] | None = None) -> None:
        """(Re)pack every linear weight, from `state` (HF names) or else the current parameters, and route
        the layers through the packed copies."""
        names = self._names()
        with torch.no_grad():
            for owner, attr, lins in self._plan():
                weights = []
                for lin in lins:
                    name = names[id(lin)]
                    if state is None and name in self.released:
                        raise RuntimeError(f"{name} lives only in its packed copy: refresh from a state dict")
                    weights.append(lin.weight if state is None else state[name])
                setattr(owner, attr, _pack(*weights))
        self.active = True

    def release_originals(self) -> int:
        """Free the parameters of the packed layers (a zero-stride placeholder keeps shape and dtype): the
        packed copies become the only copy. Weights shared with a module that is not packed are kept.
        Returns the bytes freed."""
        if not self.active:
            raise RuntimeError("pack the weights (refresh) before releasing the originals")
        names = self._names()
        shared = {id(p) for m in self.model.modules() if not isinstance(m, nn.Linear)
                  for p in m.parameters(recurse=False)}  # fmt: skip
        freed = 0
        for _, _, lins in self._plan():
            for lin in lins:
                w = lin.weight
                if id(w) in shared or names[id(lin)] in self.released:
                    continue
                freed += w.untyped_storage().nbytes()
                w.data = torch.zeros((), dtype=w.dtype, device=w.device).expand(w.shape)
                self.released.add(names[id(lin)])
        return freed

    def load(self, state: Mapping[str, Tensor]) -> None:
        """Load a full HF-named state dict: parameters that are kept are copied in, packed layers are packed
        from `state` (their released parameters stay placeholders)."""
        from harnessrl.modeling.loading import check_state_dict  # loading imports this module's model

        model = self.model
        if not isinstance(model, CausalLM):
            raise TypeError("PackedLinears.load needs a CausalLM")
        full = check_state_dict(model, dict(state))
        with torch.no_grad():
            for name, param in model.state_dict().items():
                if name not in self.released:
                    param.copy_(full[name])
        self.refresh(full)

    def update(self, change: Mapping[str, Callable[[Tensor], None]]) -> int:
        """Change the weights named in `change` (HF names) in place and repack only the products that
        compute one of them: each callable gets its weight as a dense tensor to modify (the parameter,
        or for a released weight its unpacked copy). Other products keep their packed copies; a named
        weight no product packs (a biased layer) is its parameter, changed in place. Returns the number
        of products repacked."""
        if not self.active:
            raise RuntimeError("no packed copies to update: load or refresh the weights first")
        names, todo, repacked = self._names(), dict(change), 0
        with torch.no_grad():
            for owner, attr, lins in self._plan():
                if not any(names[id(lin)] in todo for lin in lins):
                    continue
                released = [names[id(lin)] in self.released for lin in lins]
                dense = getattr(owner, attr).packed.to_dense() if any(released) else None
                parts = list(dense.split([lin.out_features for lin in lins])) if dense is not None else []
                weights = [
                    parts[i] if rel else lin.weight
                    for i, (lin, rel) in enumerate(zip(lins, released, strict=True))
                ]
                for lin, w in zip(lins, weights, strict=True):
                    if names[id(lin)] in todo:
                        todo.pop(names[id(lin)])(w)
                # all released: the unpacked copy is packed as it is (no concatenation)
                setattr(owner, attr, _pack(dense) if dense is not None and all(released) else _pack(*weights))
                repacked += 1
            for name, fn in todo.items():
                fn(self.model.get_parameter(name))
        return repacked

    def lora_names(self) -> set[str]:
        """The weights an adapter is served unmerged on (`set_lora`): those of products whose weights all
        live only in their packed copies (released)."""
        names = self._names()
        return {names[id(lin)] for _, _, lins in self._plan() if all(names[id(x)] in self.released for x in lins)
                for lin in lins}  # fmt: skip

    def set_lora(self, terms: Mapping[str, tuple[float, Tensor, Tensor]]) -> int:
        """Serve an adapter unmerged on the packed products: y = W x + Σ s·B (A x) for each weight named
        in `terms` (HF names -> (s, B [out, r], A [r, in]); all in `lora_names()`); every other product's
        term is removed. The packed weights are not touched. A fused product (q/k/v, gate/up) gets one
        term: its layers' A stacked, their s·B placed block-diagonally. Returns the products given one."""
        if not self.active:
            raise RuntimeError("no packed products to serve an adapter on: load the weights first")
        names, given = self._names(), 0
        for owner, attr, lins in self._plan():
            fwd = getattr(owner, attr)
            if not isinstance(fwd, _PackedForward):
                continue
            fwd.lora = None
            hit = [(lin, terms[names[id(lin)]]) for lin in lins if names[id(lin)] in terms]
            if hit:
                fwd.lora = _lora_factors(lins, hit, fwd.packed.dtype)
                given += 1
        return given

    def state_dict(self) -> dict[str, Tensor]:
        """The model's state dict with released weights unpacked from their packed copies (exact; an
        adapter served unmerged, `set_lora`, is not in it)."""
        out = dict(self.model.state_dict())
        names = self._names()
        for owner, attr, lins in self._plan():
            todo = [lin for lin in lins if names[id(lin)] in self.released]
            if not todo:
                continue
            fwd = getattr(owner, attr)
            if not isinstance(fwd, _PackedForward):
                raise RuntimeError(f"{names[id(lins[0])]}: no packed copy (the weights were discarded)")
            dense = fwd.packed.to_dense()
            for lin, part in zip(lins, dense.split([lin.out_features for lin in lins]), strict=True):
                out[names[id(lin)]] = part.clone()
        return out

    @property
    def nbytes(self) -> int:
        """Bytes held by the packed copies."""
        total = 0
        for owner, attr, _ in self._plan():
            fwd = owner.__dict__.get(attr) if attr == "forward" else getattr(owner, attr)
            if isinstance(fwd, _PackedForward):
                total += fwd.packed.numel() * fwd.packed.element_size()
        return total

    def drop(self) -> None:
        """Forget the packed copies (their memory is freed) and route the layers through `F.linear` again.
        After `release_originals` the released weights are then gone until the next `load`."""
        for mod in self.model.modules():
            if isinstance(mod, Attention):
                mod.fused_qkv = None
            elif isinstance(mod, MLP):
                mod.fused_gate_up = None
        for lin in self._linears():
            if isinstance(lin.__dict__.get("forward"), _PackedForward):
                del lin.forward
        self.active = False


def _lora_factors(
    lins: list[nn.Linear], hit: list[tuple[nn.Linear, tuple[float, Tensor, Tensor]]], dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """(down [in, R], up [R, out]) with (x @ down) @ up = Σ s·B (A x) over the `hit` layers of a product
    computing `lins` side by side (R = the hit layers' ranks summed; up is zero off their blocks)."""
    rows = {id(lin): sum(x.out_features for x in lins[:i]) for i, lin in enumerate(lins)}
    down = torch.cat([a.float() for _, (_, _, a) in hit]).t()
    up = torch.zeros(down.shape[1], sum(lin.out_features for lin in lins))
    col = 0
    for lin, (s, b, a) in hit:
        up[col : col + a.shape[0], rows[id(lin)] : rows[id(lin)] + lin.out_features] = b.float().t() * s
        col += a.shape[0]
    return down.to(dtype).contiguous(), up.to(dtype)


def _bias_free_linears(model: nn.Module) -> list[nn.Linear]:
    linears = (m for m in model.modules() if isinstance(m, nn.Linear))
    return [lin for lin in linears if lin.bias is None]


def _probe_logprobs(model: nn.Module, vocab: int) -> Tensor:
    ids = (torch.arange(PROBE_TOKENS) * 7919 + 13) % min(vocab, 32000)
    with torch.inference_mode():
        return torch.log_softmax(model(ids.unsqueeze(0))[0].float(), dim=-1)


def _probe_gap(model: nn.Module, install: Callable[[], None]) -> float:
    """Max |logprob| change of the probe's top tokens when `install` reroutes the model's products."""
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 32000))
    reference = _probe_logprobs(model, vocab)
    top = reference.topk(min(PROBE_TOP, reference.shape[-1]), dim=-1).indices
    install()
    return float((_probe_logprobs(model, vocab) - reference).gather(-1, top).abs().max())


def choose_matmul(
    model: nn.Module, want: Matmul, device: torch.device, fuse: bool = True
) -> tuple[PackedLinears | None, str]:
    """Install packed linears when `want` asks for them (and, for "auto", the probe accepts them);
    `fuse` False keeps every layer's own product (served LoRA adapters hook them).

    Returns the installed `PackedLinears` (None: plain `F.linear`) and a one-line reason for the log.
    """
    if want == "aten":
        return None, "aten (asked)"
    if device.type != "cpu" or not onednn_available():
        if want == "onednn":
            raise ValueError("matmul 'onednn' needs a CPU engine and a torch build with oneDNN")
        return None, f"aten (oneDNN packing is for CPU; device {device.type})"
    dtype = next(model.parameters()).dtype
    packed = PackedLinears(model, fuse)
    if want == "onednn":
        packed.refresh()
        return packed, "onednn (asked)"
    if dtype != torch.float32:
        return None, f"aten (auto packs float32 weights only; these are {dtype})"
    gap = _probe_gap(model, packed.refresh)
    if gap > PROBE_BOUND:
        packed.drop()
        log.warning("event=matmul_probe_rejected gap=%.2e bound=%.0e: keeping F.linear", gap, PROBE_BOUND)
        return None, f"aten (oneDNN probe gap {gap:.1e} > {PROBE_BOUND:.0e})"
    return packed, f"onednn (probe gap {gap:.1e} <= {PROBE_BOUND:.0e})"


# --- training ---------------------------------------------------------------------------------------


class _OneDNNLinear(torch.autograd.Function):
    """y = x @ W.T through a oneDNN-packed copy of W; backward: dW = dy.T @ x and dx = dy @ W, the latter
    through a packed copy of W.T for layers that widen it (in_features > out_features: MLP down
    projections, where it runs 165 -> 60 ms for 4,000 rows of SmolLM2), else as a plain matrix product
    (as fast or faster for the other shapes).

    The packed copy is made for the call and dropped with it: packing one layer's weight is a reorder of
    a few MB, lost in the products (a demo-shaped update took the same time either way), while keeping a
    packed copy of every layer through an update held another copy of the weights (~0.6 GB more at the
    update's peak on SmolLM2; docs/benchmarks.md, Memory). A copy made from the weight as it is now can
    never be stale."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, transposed: bool) -> Tensor:
        ctx.save_for_backward(x, weight)  # autograd refuses the backward if W changed in place meanwhile
        ctx.transposed = transposed
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0] and ctx.transposed:
            packed_t = torch.ops.mkldnn._reorder_linear_weight(
                weight.detach().t().contiguous(), PACK_ROWS_HINT
            )
            dx = torch.ops.mkldnn._linear_pointwise(grad, packed_t, None, "none", [], "")
        elif ctx.needs_input_grad[0]:
            dx = grad @ weight
        if ctx.needs_input_grad[1]:
            dw = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return dx, dw, None


class _TrainPackedForward:
    """The replacement `forward` of one trainable linear layer: the product through oneDNN, packing the
    weight per call (it holds no copy between calls)."""

    def __init__(self, layer: nn.Linear) -> None:
        self.layer = layer
        self.transposed = layer.in_features > layer.out_features  # dx through a packed W.T (see above)

    def __call__(self, x: Tensor) -> Tensor:
        return _OneDNNLinear.apply(x, self.layer.weight, self.transposed)  # type: ignore[no-any-return]


def use_onednn_for_training(model: nn.Module, want: Matmul, device: torch.device) -> str:
    """Route a trainable model's linear layers through oneDNN (forward and the input gradient) when `want`
    is "onednn", or "auto" and the probe accepts it (as `choose_matmul`); returns the reason for the log.
    The weight gradient stays an ordinary matrix product. "auto" on bf16 weights where the CPU has no fast
    bf16 product routes them through fp32 products instead (modeling/upcast.py)."""
    if want == "aten":
        return "aten (aten asked)"
    if device.type != "cpu" or not onednn_available():
        if want == "onednn":
            raise ValueError("matmul 'onednn' needs a CPU trainer and a torch build with oneDNN")
        return f"aten (oneDNN is for CPU; device {device.type})"
    dtype = next(model.parameters()).dtype
    if want == "auto" and needs_upcast(dtype, device):  # modeling/upcast.py
        n = install_upcast(model)
        return f"fp32 products ({n} bf16 linear layers; this CPU has no fast bf16 product)"
    if want == "auto" and dtype != torch.float32:
        return f"aten (auto uses oneDNN for float32 weights only; these are {dtype})"

    def install() -> None:
        for lin in _bias_free_linears(model):
            lin.forward = _TrainPackedForward(lin)  # type: ignore[method-assign, assignment]

    if want == "onednn":
        install()
        return "onednn (asked)"
    gap = _probe_gap(model, install)
    release_freed_memory()
    if gap > PROBE_BOUND:
        for lin in _bias_free_linears(model):
            del lin.forward
        log.warning("event=matmul_probe_rejected gap=%.2e bound=%.0e: keeping F.linear", gap, PROBE_BOUND)
        return f"aten (oneDNN probe gap {gap:.1e} > {PROBE_BOUND:.0e})"
    return f"onednn (probe gap {gap:.1e} <= {PROBE_BOUND:.0e})"
