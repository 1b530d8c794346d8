"""Rotary position embeddings: the inverse frequencies, plain or scaled to reach a longer context.

A head of size d rotates its pair i (i = 0..d/2-1) at position p by the angle p * inv_freq[i], with

    inv_freq[i] = 1 / theta^(2i/d)                                   (default)

Scaling keeps the weights and changes the frequencies so that positions past the trained context
(`original_max_position_embeddings`, L) map onto angles the model has seen. Definitions as in Hugging
Face's `rope_scaling` / `rope_parameters` (the same config.json keys, so both read one directory):

- **linear** (position interpolation, Chen et al. 2023): inv_freq[i] / factor, i.e. position p is read
  as p / factor. Every pair is slowed, the fast (local) ones too.
- **yarn** (Peng et al. 2023, "YaRN"): pairs that turn many times within L keep their frequency
  (extrapolation), pairs that turn less than once are interpolated as in linear, and a ramp blends the
  two between. With r(n) = d * ln(L / (2 pi n)) / (2 ln theta), the pair index that turns n times in L,
      low = max(floor(r(beta_fast)), 0), high = min(ceil(r(beta_slow)), d - 1)   (ceil/floor: `truncate`)
      ramp[i] = clamp((i - low) / (high - low), 0, 1)                       (high += 0.001 if equal)
      inv_freq[i] = inv_freq_default[i] / factor * ramp[i] + inv_freq_default[i] * (1 - ramp[i])
  and cos/sin are multiplied by the attention factor (softmax temperature correction)
      attention_factor = 0.1 ln(factor) + 1            (1 when factor <= 1)
  or, with `mscale` and `mscale_all_dim`, g(factor, mscale) / g(factor, mscale_all_dim) with
  g(s, m) = 0.1 m ln(s) + 1; an explicit `attention_factor` wins. Defaults: beta_fast 32, beta_slow 1.

- **llama3** (Llama 3.1/3.2): with wavelength w = 2 pi / inv_freq[i], pairs with w < L / high_freq_factor
  keep their frequency, pairs with w > L / low_freq_factor are divided by `factor`, and between them
      s = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor)
      inv_freq[i] = (1 - s) * inv_freq_default[i] / factor + s * inv_freq_default[i]
  (no attention factor). Defaults: low_freq_factor 1, high_freq_factor 4.

Dynamic NTK and longrope scaling are not implemented: a config asking for them is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
from torch import Tensor


class RopeType(StrEnum):
    """The RoPE variants this package computes (HF's `rope_type` names)."""

    DEFAULT = "default"
    LINEAR = "linear"
    YARN = "yarn"
    LLAMA3 = "llama3"


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE scaling (HF `rope_scaling` dict); `original_max_position_embeddings` is YaRN's L."""

    rope_type: RopeType
    factor: float
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0

    def __post_init__(self) -> None:
        if self.rope_type == RopeType.DEFAULT:
            raise ValueError("RopeScaling needs a scaling rope_type (linear or yarn); use None for default")
        if not self.factor >= 1.0:
            raise ValueError(f"rope_scaling.factor must be a number >= 1, not {self.factor!r}")
        if (
            self.rope_type in (RopeType.YARN, RopeType.LLAMA3)
            and not (self.original_max_position_embeddings or 0) > 0
        ):
            raise ValueError(
                f"rope_scaling of type {self.rope_type} needs original_max_position_embeddings > 0"
            )
        if self.rope_type == RopeType.LLAMA3 and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError("rope_scaling.high_freq_factor must be greater than low_freq_factor")
        if self.beta_fast < self.beta_slow:
            raise ValueError("rope_scaling.beta_fast must be >= beta_slow")

    @classmethod
    def from_hf(cls, params: dict[str, Any], max_position_embeddings: int) -> RopeScaling | None:
        """Read HF's `rope_scaling` / `rope_parameters` dict; None for default RoPE, ValueError if unknown."""
        kind = str(params.get("rope_type", params.get("type", "default")))
        if kind == RopeType.DEFAULT:
            return None
        if kind not in (RopeType.LINEAR, RopeType.YARN, RopeType.LLAMA3):
            raise ValueError(f"rope_type {kind!r} is not supported; use one of default, linear, yarn, llama3")
        original = params.get("original_max_position_embeddings")
        if kind == RopeType.YARN and not original:
            original = max_position_embeddings  # HF's default when the key is missing
        factor = params.get("factor")
        if factor is None and kind == RopeType.YARN and original:
            factor = max_position_embeddings / int(original)
        if not isinstance(factor, int | float) or isinstance(factor, bool):
            raise ValueError(f"rope_scaling.factor must be a number >= 1, not {factor!r}")

        def opt(key: str) -> float | None:
            value = params.get(key)
            return None if value is None else float(value)

        return cls(
            rope_type=RopeType(kind),
            factor=float(factor),
            original_max_position_embeddings=int(original) if original else None,
            beta_fast=float(params.get("beta_fast") or 32.0),  # HF: a falsy value means the default
            beta_slow=float(params.get("beta_slow") or 1.0),
            attention_factor=opt("attention_factor"),
            mscale=opt("mscale"),
            mscale_all_dim=opt("mscale_all_dim"),
            truncate=bool(params.get("truncate", True)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        )

    def to_hf(self) -> dict[str, Any]:
        """HF's `rope_scaling` dict (keys that keep their default are left out)."""
        d: dict[str, Any] = {"rope_type": str(self.rope_type), "factor": self.factor}
        if self.rope_type == RopeType.YARN:
            d["original_max_position_embeddings"] = self.original_max_position_embeddings
            d.update(beta_fast=self.beta_fast, beta_slow=self.beta_slow)
            for key in ("attention_factor", "mscale", "mscale_all_dim"):
                if getattr(self, key) is not None:
                    d[key] = getattr(self, key)
            if not self.truncate:
                d["truncate"] = False
        if self.rope_type == RopeType.LLAMA3:
            d.update(
                original_max_position_embeddings=self.original_max_position_embeddings,
                low_freq_factor=self.low_freq_factor,
                high_freq_factor=self.high_freq_factor,
            )
        return d


def _powers(head_dim: int, theta: float) -> Tensor:
    """theta^(2i/d) for i = 0..d/2-1, in fp32 on CPU."""
    # explicitly on CPU: models are built under `torch.device("meta")` by load_model
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float()
    return theta ** (steps / head_dim)


def default_inv_freq(head_dim: int, theta: float) -> Tensor:
    """1 / theta^(2i/d) for i = 0..d/2-1, in fp32 on CPU."""
    return 1.0 / _powers(head_dim, theta)


def yarn_attention_factor(s: RopeScaling) -> float:
    """YaRN's cos/sin multiplier (see the module docstring)."""
    if s.attention_factor is not None:
        return s.attention_factor

    def g(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.mscale and s.mscale_all_dim:
        return g(s.factor, s.mscale) / g(s.factor, s.mscale_all_dim)
    return g(s.factor)


def yarn_ramp(s: RopeScaling, head_dim: int, theta: float) -> Tensor:
    """The per-pair blend weight of YaRN: 0 keeps the default frequency, 1 interpolates fully."""
    assert s.original_max_position_embeddings is not None  # checked in RopeScaling.__post_init__

    def pair_turning(turns: float) -> float:
        length = s.original_max_position_embeddings or 0
        return head_dim * math.log(length / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_turning(s.beta_fast), pair_turning(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    pairs = torch.arange(head_dim // 2, dtype=torch.float32, device="cpu")
    return ((pairs - low) / (high - low)).clamp(0, 1)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> tuple[Tensor, float]:
    """(inv_freq [head_dim/2] fp32, cos/sin multiplier) for a head size, base and optional scaling."""
    powers = _powers(head_dim, theta)
    base = 1.0 / powers
    if scaling is None:
        return base, 1.0
    if scaling.rope_type == RopeType.LINEAR:
        return base / scaling.factor, 1.0
    if scaling.rope_type == RopeType.LLAMA3:
        return llama3_inv_freq(base, scaling), 1.0
    interpolated = 1.0 / (scaling.factor * powers)
    ramp = yarn_ramp(scaling, head_dim, theta)
    keep = 1 - ramp  # share of the unscaled (extrapolated) frequency
    return interpolated * (1 - keep) + base * keep, yarn_attention_factor(scaling)


def llama3_inv_freq(base: Tensor, s: RopeScaling) -> Tensor:
    """Llama 3's per-pair frequency scaling of the default `base` inverse frequencies (module docstring)."""
    length = float(s.original_max_position_embeddings or 0)
    wavelen = 2 * math.pi / base
    scaled = torch.where(wavelen > length / s.low_freq_factor, base / s.factor, base)
    smooth = (length / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= length / s.high_freq_factor) & (wavelen <= length / s.low_freq_factor)
    return torch.where(medium, blended, scaled)
