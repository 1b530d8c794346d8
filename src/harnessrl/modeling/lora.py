"""LoRA: low-rank adapters on the linear projections of any model family, kept outside the model.

A targeted linear layer y = W x gets a trainable low-rank update (Hu et al., 2021):

    y = W x + s · B (A · dropout(x)),    A ∈ R^{r×in}, B ∈ R^{out×r}, s = alpha / r

A starts Kaiming-uniform and B at zero, so an adapter starts as the identity (the engine's version-0
logprobs are the base model's). Merging writes W' = W + s · B A, which gives the same outputs up to
rounding (`merged_state`); the builtin engine serves merged weights.

The adapter is its own module (`LoraAdapter`), attached to a model by forward hooks on the targeted
`nn.Linear` layers, found by name (PEFT's rule: a module whose name equals a target or ends with
`.<target>`). The model's own state dict stays exactly Hugging Face's and its parameters are frozen, so
the optimizer holds state for the adapter alone. Hooks run whatever computes the layer's product
(`F.linear` or the trainer's oneDNN path in modeling/packed.py), so nothing in a model family's module
knows about LoRA. The engine's fused q/k/v and gate/up products bypass the layers' calls: an adapter is
never attached to an engine's model, whose weights are merged instead.

On disk an adapter is a PEFT folder (`adapter_config.json` + `adapter_model.safetensors`, tensors named
`base_model.model.<module>.lora_A.weight` [r, in] and `...lora_B.weight` [out, r]) that
`peft.PeftModel.from_pretrained` loads on the base model folder (`save_peft`, `read_peft`).
"""

from __future__ import annotations

import copy
import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from harnessrl.defaults import LORA_TARGET_MODULES

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
log = logging.getLogger(__name__)
# Every linear projection of a decoder layer, in the names all supported families use (defaults.py).
DEFAULT_TARGETS = LORA_TARGET_MODULES


@dataclass(frozen=True)
class LoraSpec:
    """Rank, scale numerator, input dropout and the targeted module names of an adapter."""

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = field(default=DEFAULT_TARGETS)

    @property
    def scale(self) -> float:
        """s = alpha / r, the factor on B A (PEFT's default scaling)."""
        return self.alpha / self.r

    def peft_config(self, base_model: str) -> dict[str, Any]:
        """The `adapter_config.json` PEFT writes for this adapter (a causal LM, no bias, plain scaling)."""
        return {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": self.r, "lora_alpha": self.alpha, "lora_dropout": self.dropout,
            "target_modules": sorted(self.target_modules), "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "modules_to_save": None, "init_lora_weights": True,
            "inference_mode": True,
        }  # fmt: skip


def target_linears(model: nn.Module, targets: tuple[str, ...]) -> dict[str, nn.Linear]:
    """The linear layers of `model` an adapter with `targets` covers, by module name (PEFT's match)."""
    found: dict[str, nn.Linear] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and any(name == t or name.endswith(f".{t}") for t in targets):
            found[name] = mod
    if not found:
        linear_names = sorted(
            {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        )
        raise ValueError(
            f"train.lora.target_modules {list(targets)} match no linear layer; this model has {linear_names}"
        )
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    tied = [n for n, m in found.items() if id(m.weight) in embeddings]
    if tied:
        raise ValueError(
            f"train.lora.target_modules: {tied} share their weight with the token embedding; leave them out"
        )
    return found


class LoraAdapter(nn.Module):
    """The A and B matrices (fp32) of every targeted layer, in `names` order; `attach` hooks them in."""

    def __init__(
        self, spec: LoraSpec, shapes: Mapping[str, tuple[int, int]], seed: int = 0, base_model: str = ""
    ) -> None:
        super().__init__()
        self.base_model = base_model  # the base model folder (adapter_config.json's base_model_name_or_path)
        if spec.r < 1:
            raise ValueError(f"train.lora.r must be >= 1, not {spec.r}")
        self.spec = spec
        self.names = list(shapes)
        gen = torch.Generator().manual_seed(seed)
        self.lora_A = nn.ParameterList()
        self.lora_B = nn.ParameterList()
        for name in self.names:
            out_f, in_f = shapes[name]
            bound = 1.0 / math.sqrt(in_f)  # kaiming_uniform_(a=sqrt(5)), as nn.Linear and PEFT initialise A
            a = (torch.rand(spec.r, in_f, generator=gen) * 2 - 1) * bound
            self.lora_A.append(nn.Parameter(a))
            self.lora_B.append(nn.Parameter(torch.zeros(out_f, spec.r)))
        self.enabled = True
        self._handles: list[RemovableHandle] = []

    def pair(self, name: str) -> tuple[Tensor, Tensor]:
        """(A, B) of module `name`."""
        i = self.names.index(name)
        return self.lora_A[i], self.lora_B[i]

    def delta(self, i: int, x: Tensor) -> Tensor:
        """s · B (A · dropout(x)) for layer i, in fp32 (dropout only while gradients are recorded)."""
        x = x.to(self.lora_A[i].dtype)
        if self.spec.dropout > 0 and torch.is_grad_enabled():
            x = F.dropout(x, self.spec.dropout, training=True)
        return F.linear(F.linear(x, self.lora_A[i]), self.lora_B[i]) * self.spec.scale

    def detach_hooks(self) -> None:
        """Remove the forward hooks from the model (the adapter keeps its weights)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def peft_tensors(self) -> dict[str, Tensor]:
        """The adapter's tensors under PEFT's names (contiguous CPU copies)."""
        out: dict[str, Tensor] = {}
        for name, a, b in zip(self.names, self.lora_A, self.lora_B, strict=True):
            out[f"{PEFT_PREFIX}{name}.lora_A.weight"] = a.detach().cpu().contiguous()
            out[f"{PEFT_PREFIX}{name}.lora_B.weight"] = b.detach().cpu().contiguous()
        return out

    def load_peft_tensors(self, tensors: Mapping[str, Tensor]) -> None:
        """Copy tensors named as `peft_tensors` names them into the adapter (strict on names and shapes)."""
        mine = self.peft_tensors()
        missing, unexpected = sorted(set(mine) - set(tensors)), sorted(set(tensors) - set(mine))
        if missing or unexpected:
            raise ValueError(f"adapter mismatch: missing={missing[:3]} unexpected={unexpected[:3]}")
        with torch.no_grad():
            for i, name in enumerate(self.names):
                self.lora_A[i].copy_(tensors[f"{PEFT_PREFIX}{name}.lora_A.weight"])
                self.lora_B[i].copy_(tensors[f"{PEFT_PREFIX}{name}.lora_B.weight"])


def attach(model: nn.Module, spec: LoraSpec, seed: int = 0, base_model: str | Path = "") -> LoraAdapter:
    """Freeze `model` and hook a new adapter (on the model's device) into its targeted linear layers;
    `base_model` is the folder the model was loaded from (recorded in exported adapters)."""
    layers = target_linears(model, spec.target_modules)
    if any(getattr(m, "fused_qkv", None) or getattr(m, "fused_gate_up", None) for m in model.modules()):
        raise ValueError("LoRA hooks need the per-layer products; this model runs fused ones (an engine's)")
    shapes = {name: (lin.out_features, lin.in_features) for name, lin in layers.items()}
    adapter = LoraAdapter(spec, shapes, seed, str(base_model)).to(next(model.parameters()).device)
    model.requires_grad_(False)
    for i, lin in enumerate(layers.values()):
        adapter._handles.append(lin.register_forward_hook(_hook(adapter, i)))
    return adapter


def base_view(model: nn.Module, *adapters: LoraAdapter) -> nn.Module:
    """A second model object over the same frozen base tensors, without the `adapters`' hooks: the base
    model (the KL term's reference) at no extra weight memory. The base must stay frozen (it does under
    LoRA: only the adapters train)."""
    shared: dict[int, Any] = {id(t): t for t in (*model.parameters(), *model.buffers())}
    view = copy.deepcopy(model, shared)
    ids = {h.id for adapter in adapters for h in adapter._handles}
    for mod in view.modules():
        for hook_id in ids & set(mod._forward_hooks):
            del mod._forward_hooks[hook_id]
    return view


def _hook(adapter: LoraAdapter, i: int) -> Any:
    def hook(_: nn.Module, args: tuple[Tensor, ...], out: Tensor) -> Tensor:
        if not adapter.enabled:
            return out
        return out + adapter.delta(i, args[0]).to(out.dtype)

    return hook


def merge_into(
    state: Mapping[str, Tensor], spec: LoraSpec, tensors: Mapping[str, Tensor]
) -> dict[str, Tensor]:
    """A copy of the HF state dict `state` with W' = W + s · B A for every layer in the PEFT `tensors`
    (computed in fp32, stored in W's dtype); the other tensors are shared, not copied."""
    out = dict(state)
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
        b = tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"]
        w = state[f"{module}.weight"]
        out[f"{module}.weight"] = torch.addmm(w.float(), b.float(), a.float(), alpha=spec.scale).to(w.dtype)
    return out


def merged_state(model: nn.Module, adapter: LoraAdapter) -> dict[str, Tensor]:
    """The model's state dict with the adapter merged into the targeted weights (detached)."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    return merge_into(state, adapter.spec, adapter.peft_tensors())


def save_peft(adapter: LoraAdapter, out_dir: str | Path, base_model: str, version: int | None = None) -> Path:
    """Write the adapter as a PEFT folder (config + safetensors; `version` in the file's metadata)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt", **({"weight_version": str(version)} if version is not None else {})}
    tmp = out / f".{ADAPTER_WEIGHTS}.tmp"
    save_file(adapter.peft_tensors(), str(tmp), metadata=meta)
    tmp.replace(out / ADAPTER_WEIGHTS)
    (out / ADAPTER_CONFIG).write_text(json.dumps(adapter.spec.peft_config(base_model), indent=2))
    return out


def is_peft_dir(path: str | Path) -> bool:
    """True when `path` is an adapter folder (it has adapter_config.json)."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


# adapter_config.json fields this code does not apply, with the value that means "not used"
UNSUPPORTED_FIELDS: dict[str, Any] = {
    "use_rslora": False, "use_dora": False, "rank_pattern": {}, "alpha_pattern": {},
    "layers_to_transform": None, "layers_pattern": None, "modules_to_save": None, "fan_in_fan_out": False,
    "lora_bias": False, "bias": "none",
}  # fmt: skip


def check_peft_config(cfg: Mapping[str, Any], where: str) -> None:
    """Refuse an adapter config that sets a field `read_peft` would otherwise ignore (merging it with one
    global r and alpha would give other weights than PEFT's), naming the field."""
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {cfg.get('peft_type')!r} is not supported; only LORA adapters")
    for key, unused in UNSUPPORTED_FIELDS.items():
        value = cfg.get(key, unused)
        if value != unused and not (unused in ({}, None) and not value):
            raise ValueError(
                f"{where}: adapter_config.json sets {key}={value!r}, which harnessrl does not apply; "
                f"only plain LoRA with one r and lora_alpha for every target ({key}: {unused!r})"
            )


def read_peft(path: str | Path) -> tuple[LoraSpec, dict[str, Tensor]]:
    """The spec and tensors of a PEFT LoRA folder (plain LoRA only: fields it would not apply are
    refused by name, `check_peft_config`)."""
    p = Path(path)
    cfg = json.loads((p / ADAPTER_CONFIG).read_text())
    check_peft_config(cfg, str(p))
    targets = cfg.get("target_modules") or []
    spec = LoraSpec(int(cfg["r"]), float(cfg["lora_alpha"]), float(cfg.get("lora_dropout", 0.0)),
                    tuple([targets] if isinstance(targets, str) else targets))  # fmt: skip
    tensors = load_file(str(p / ADAPTER_WEIGHTS))
    # PEFT may name tensors `...lora_A.default.weight` in memory; on disk the adapter name is dropped
    return spec, {k.replace(".default.weight", ".weight"): v for k, v in tensors.items()}


def merge_peft_dir(state: Mapping[str, Tensor], adapter_dir: str | Path) -> dict[str, Tensor]:
    """`state` (a base model's HF state dict) with the PEFT adapter at `adapter_dir` merged in."""
    spec, tensors = read_peft(adapter_dir)
    log.info(
        "event=lora_adapter_merged path=%s r=%d alpha=%g layers=%d",
        adapter_dir,
        spec.r,
        spec.alpha,
        len(tensors) // 2,
    )
    return merge_into(state, spec, tensors)


def attach_lora(model: nn.Module, section: Any, seed: int, base_model: str | Path) -> LoraAdapter:
    """`attach` with the settings of a run's `train.lora` section (config.LoraSection)."""
    spec = LoraSpec(section.r, section.alpha, section.dropout, tuple(section.target_modules))
    adapter = attach(model, spec, seed, base_model)
    n = sum(p.numel() for p in adapter.parameters())
    log.info(
        "event=lora_attached r=%d alpha=%g layers=%d params=%d", spec.r, spec.alpha, len(adapter.names), n
    )
    return adapter
