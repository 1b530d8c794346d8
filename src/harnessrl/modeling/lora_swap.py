"""Swapping the LoRA adapter an engine serves for the next one, from memory (the builtin engine's LoRA sync).

A sync brings the next adapter (a few MB), never the base. `LoraSwap` pairs it with the adapter served
until now and turns both into per-weight low-rank terms s·B A. The engine then changes only what the
adapter touches (`ModelMemory._swap_lora`):

- on the oneDNN-packed CPU path (modeling/packed.py) the adapter is served unmerged, y = W x + s·B (A x),
  on the packed products (`PackedLinears.set_lora`): the packed base weights are not touched at all, so a
  swap costs the adapter's few MB instead of unpacking and repacking every targeted layer (which costs
  about what a full-weight load does);
- a targeted weight held as a parameter (`F.linear`, an accelerator, a biased layer) is merged in place:
  W' = W + s·B_new A_new − s·B_old A_old, computed in fp32 and rounded once to W's dtype (`add_terms_`;
  fp32: ~1e-7 relative per swap, negligible over thousands of syncs).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from harnessrl.modeling.lora import PEFT_PREFIX, LoraSpec

Adapter = tuple[LoraSpec, Mapping[str, Tensor]]
# (factor, B [out, r], A [r, in]): the term factor · B A of one adapter on one weight
Term = tuple[float, Tensor, Tensor]


def adapter_terms(adapter: Adapter, sign: float = 1.0) -> dict[str, Term]:
    """Per targeted weight (HF name, `<module>.weight`), the adapter's term (sign · s, B, A)."""
    spec, tensors = adapter
    out: dict[str, Term] = {}
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
        b = tensors.get(f"{PEFT_PREFIX}{module}.lora_B.weight")
        if b is None:
            raise ValueError(f"adapter layer {module} has lora_A but no lora_B tensor")
        out[f"{module}.weight"] = (sign * spec.scale, b, a)
    return out


@dataclass(frozen=True)
class LoraSwap:
    """A weight load that replaces the adapter served by `new`; `old` is the one served until now (None:
    the weights held are the base's)."""

    new: Adapter
    old: Adapter | None
    # the base weights to load first (read from disk after a level-2 sleep discarded the weights held)
    base: dict[str, Tensor] | None = None

    def terms(self) -> dict[str, list[Term]]:
        """Per targeted weight, what merging in place adds: the new adapter's term (+s) first, then the old
        one's (−s)."""
        out = {name: [term] for name, term in adapter_terms(self.new).items()}
        for name, term in adapter_terms(self.old, -1.0).items() if self.old is not None else ():
            out.setdefault(name, []).append(term)
        return out

    def check(self, shapes: Mapping[str, torch.Size]) -> dict[str, list[Term]]:
        """The terms, once every targeted weight is known to exist in `shapes` (the model's weight
        shapes) with B A of its shape: refused before any weight is touched. Returns `terms()`."""
        terms = self.terms()
        for name, items in terms.items():
            if name not in shapes:
                raise ValueError(
                    f"adapter layer {name.removesuffix('.weight')} is not a weight of this model"
                )
            for _, b, a in items:
                if (b.shape[0], a.shape[1]) != tuple(shapes[name]) or b.shape[1] != a.shape[0]:
                    raise ValueError(
                        f"adapter layer {name.removesuffix('.weight')}: lora_B {tuple(b.shape)} @ lora_A "
                        f"{tuple(a.shape)} does not give the weight's shape {tuple(shapes[name])}"
                    )
        return terms


def add_terms_(weight: Tensor, terms: list[Term]) -> None:
    """weight += Σ factor · B A, in place: computed in fp32 and rounded once to the weight's dtype (the
    same operations, in the same order, as merging into an fp32 copy)."""
    with torch.no_grad():
        acc = weight if weight.dtype == torch.float32 else weight.float()
        for factor, b, a in terms:
            acc.addmm_(b.float(), a.float(), alpha=factor)
        if acc is not weight:
            weight.copy_(acc)
