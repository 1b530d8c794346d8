"""Several LoRA adapters served at once on one engine model, applied per sequence, unmerged.

With several policies in one run (`policies:` in the run config, docs/lora.md) a batch mixes sequences
of different adapters, so no adapter can be merged into the shared weights. Each targeted linear layer
keeps its base product and gets, for the tokens of the sequences of adapter k only,

    y[i] = W x[i] + s_k · B_k (A_k x[i])        (fp32, as the trainer's hook computes it)

The scheduler says before every forward which tokens belong to which adapter (`assign`: the tokens
of a packed prefill, or one row per sequence of a decode step); tokens of no adapter get the base
product alone. The deltas are added by forward hooks on the targeted layers, so the engine must run
its per-layer products (no fused q/k/v or gate/up: `PackedLinears(fuse=False)`). A batch whose
sequences all name one adapter adds one delta over all rows (no gather).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from harnessrl.modeling.lora import PEFT_PREFIX, LoraSpec

log = logging.getLogger(__name__)


@dataclass
class ServedAdapter:
    """One adapter as the engine holds it: its spec, version and (A, B) per targeted layer (fp32)."""

    name: str
    spec: LoraSpec
    version: int
    pairs: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)


class ServedAdapters:
    """The adapters an engine serves by name, and which tokens of the current forward use which."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        self.adapters: dict[str, ServedAdapter] = {}
        self._plan: list[tuple[ServedAdapter, Tensor | None]] = []  # (adapter, token rows; None: all)
        self._hooked: set[str] = set()

    def version(self, name: str) -> int | None:
        """The version of adapter `name`, None when it is not loaded."""
        a = self.adapters.get(name)
        return None if a is None else a.version

    def served(self) -> dict[str, int]:
        """Every adapter served, with its version."""
        return {name: a.version for name, a in list(self.adapters.items())}

    def put(self, name: str, spec: LoraSpec, tensors: Mapping[str, Tensor], version: int) -> None:
        """Add or replace adapter `name` (PEFT tensor names; refused when a layer or shape does not fit)."""
        device = next(self.model.parameters()).device
        served = ServedAdapter(name, spec, version)
        for key, a in tensors.items():
            if not key.endswith(".lora_A.weight"):
                continue
            module = key.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
            b = tensors.get(f"{PEFT_PREFIX}{module}.lora_B.weight")
            lin = self.linears.get(module)
            if lin is None or b is None:
                raise ValueError(f"adapter {name!r}: {module} is not a linear layer of this model")
            if a.shape != (spec.r, lin.in_features) or b.shape != (lin.out_features, spec.r):
                raise ValueError(f"adapter {name!r}: {module} has shapes {tuple(a.shape)}/{tuple(b.shape)}")
            served.pairs[module] = (a.float().to(device), b.float().to(device))
        if not served.pairs:
            raise ValueError(f"adapter {name!r} holds no lora_A/lora_B tensors")
        for module in served.pairs:
            if module not in self._hooked:
                self.linears[module].register_forward_hook(self._hook(module))
                self._hooked.add(module)
        self.adapters[name] = served
        log.info("event=adapter_served name=%s version=%d layers=%d", name, version, len(served.pairs))

    def assign(self, names: Sequence[str | None], counts: Sequence[int] | None = None) -> None:
        """The tokens of the next forward: sequence i names adapter `names[i]` (None: the base) and has
        `counts[i]` tokens there, packed in order (None: one token each, a decode step)."""
        sizes = list(counts) if counts is not None else [1] * len(names)
        used = {n for n in names if n is not None and n in self.adapters}
        if len(used) == 1 and all(n in used for n in names):
            self._plan = [(self.adapters[used.pop()], None)]
            return
        plan: list[tuple[ServedAdapter, Tensor | None]] = []
        starts = torch.tensor([0, *sizes]).cumsum(0).tolist()
        for name in sorted(used):
            rows = [r for i, n in enumerate(names) if n == name for r in range(starts[i], starts[i + 1])]
            plan.append((self.adapters[name], torch.tensor(rows, dtype=torch.long)))
        self._plan = plan

    def clear(self) -> None:
        """Forget the assignment (the next forward is served by the base unless assigned again)."""
        self._plan = []

    def _hook(self, module: str):  # type: ignore[no-untyped-def]
        def hook(_: nn.Module, args: tuple[Tensor, ...], out: Tensor) -> Tensor:
            if not self._plan:
                return out
            x = args[0].reshape(-1, args[0].shape[-1])
            flat = out.view(-1, out.shape[-1])
            for adapter, rows in self._plan:
                pair = adapter.pairs.get(module)
                if pair is None:
                    continue
                xs = x if rows is None else x.index_select(0, rows.to(x.device))
                delta = F.linear(F.linear(xs.float(), pair[0]), pair[1]) * adapter.spec.scale
                if rows is None:
                    flat += delta.to(out.dtype)
                else:
                    flat.index_add_(0, rows.to(x.device), delta.to(out.dtype))
            return out

        return hook
