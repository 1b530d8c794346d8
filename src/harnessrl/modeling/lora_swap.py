"""Swapping the LoRA adapter merged into weights held in memory, in place (the builtin engine's LoRA sync).

An engine serving merged weights holds W + s·B_old A_old for every targeted layer. A sync brings the
next adapter (a few MB); `LoraSwap` turns the pair into per-weight low-rank terms, and `add_terms_`
adds W' = W + s·B_new A_new − s·B_old A_old to each targeted weight in place, in fp32, rounded once to
W's dtype (fp32: ~1e-7 relative per swap, negligible over thousands of syncs). Nothing else is copied
or re-read: on the oneDNN-packed path (modeling/packed.py) only the products that compute a targeted
layer are unpacked and repacked (`PackedLinears.update`), the embeddings, norms and untargeted layers
stay as they are.
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


@dataclass(frozen=True)
class LoraSwap:
    """A weight load that replaces the adapter merged into the weights held: `new` goes in, `old` comes
    out (None: the weights held are the base's)."""

    new: Adapter
    old: Adapter | None

    def terms(self) -> dict[str, list[Term]]:
        """Per targeted weight (HF name, `<module>.weight`), the products to add: the new adapter's
        (+s) first, then the old one's (−s)."""
        out: dict[str, list[Term]] = {}
        pairs = ((1.0, self.new), (-1.0, self.old)) if self.old is not None else ((1.0, self.new),)
        for sign, (spec, tensors) in pairs:
            for key, a in tensors.items():
                if not key.endswith(".lora_A.weight"):
                    continue
                module = key.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
                b = tensors.get(f"{PEFT_PREFIX}{module}.lora_B.weight")
                if b is None:
                    raise ValueError(f"adapter layer {module} has lora_A but no lora_B tensor")
                out.setdefault(f"{module}.weight", []).append((sign * spec.scale, b, a))
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
