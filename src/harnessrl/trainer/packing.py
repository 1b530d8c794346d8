"""Packed rows for the trainer's forward (`train.pack_rows`): a micro-batch's suffixes back to back
instead of right-padded to the longest one.

Padded, a micro-batch of B rows whose suffixes (the tokens after the shared prefix) are s_1..s_B long
costs B · max(s) positions in every linear layer and B · max(s) · (P + max(s)) scores per head in
attention: rollouts of 500 and 3,000 tokens together waste ~40% of the compute. Packed, the suffixes
are concatenated along the time axis ([1, Σ s_b, H]), every token at its own row's RoPE position, so
the projections and the MLP run over real tokens only, and attention runs row by row — a row's
queries over the shared prefix's keys (run once, as padded) and its own, causal, windowed on Gemma 3's
sliding layers:

- on CUDA in bf16/fp16, one call of torch's variable-length flash kernel for the whole micro-batch
  (`torch.nn.attention.varlen.varlen_attn`, cumulative row offsets; with a prefix each row's keys are
  the prefix's then its own, and the kernel's causal window is aligned to the last key, as the CPU
  mask is). This branch has NOT run yet: there was no GPU where it was written;
- otherwise one SDPA call per row over its slice: `is_causal` without a prefix, the suffix mask
  (`suffix_mask`: a lower-right causal bias on CUDA, the boolean window mask on CPU) with one.

A row's suffix ends at its last selected position: later tokens (padding included) cannot reach a
selected logprob through causal attention, so they are not run; a row with nothing selected is not
run at all. Logprobs and gradients equal the padded forward's up to float summation order (the
products' blocking changes with the number of positions; tests/trainer/test_packing.py).

When: `on` packs every micro-batch, `off` none, `auto` (the default) those whose padding would be more
than `PACK_ABOVE_WASTE` of the padded positions (equal-length rows keep the one batched attention call).

A transformers-path model (modeling/hf_generic.py) packs through transformers' own padding-free format
instead (trainer/forward.py's `generic_selected_logprobs`): only for the model types hf_generic.py's
`packing_refusal` allows, and under `auto` only where `use_generic_packing`'s estimate says the one
masked attention call over all packed tokens costs less than the padding saves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from harnessrl.modeling.hf_generic import packing_refusal
from harnessrl.modeling.transformer import Attention, window_mask

PackRows = Literal["auto", "on", "off"]
PACK_MODES: tuple[PackRows, ...] = ("auto", "on", "off")
# `auto` packs a micro-batch when more than this share of its padded suffix positions is padding.
PACK_ABOVE_WASTE = 0.1
# dtypes the CUDA varlen (flash) kernel takes
VARLEN_DTYPES = (torch.bfloat16, torch.float16)


def suffix_mask(q_pos: Tensor, k_len: int, window: int | None) -> Tensor:
    """The suffix's view of the prefix + suffix keys. On a GPU, without a sliding window, a lower-right
    causal bias (no [S, P + S] matrix: SDPA can take its flash or memory-efficient kernels); otherwise
    the boolean `window_mask`, as on CPU, where results stay exactly as they were."""
    if window is None and q_pos.device.type == "cuda":
        return causal_lower_right(q_pos.shape[0], k_len)
    return window_mask(q_pos, k_len, window)


@dataclass(frozen=True)
class RowPlan:
    """Where each row of a micro-batch would sit packed: its suffix length (0: nothing selected, not
    run) and offset on the packed time axis."""

    lengths: list[int]  # per micro-batch row: suffix tokens run (prefix .. last selected position)
    starts: list[int]  # per micro-batch row: offset of its first suffix token on the packed axis
    prefix: int

    @property
    def total(self) -> int:
        """Packed suffix positions."""
        return sum(self.lengths)


def plan_rows(select: Tensor, prefix: int) -> RowPlan:
    """The packed layout of the rows of `select` [B, L-1] (position t predicts token t+1) after a shared
    `prefix`: row b runs positions prefix .. its last selected position."""
    steps = torch.arange(1, select.shape[1] + 1, device=select.device)
    ends = (select * steps).amax(dim=1) if select.shape[1] else torch.zeros(select.shape[0])
    lengths = [max(0, int(e) - prefix) for e in ends.tolist()]
    starts, off = [], 0
    for n in lengths:
        starts.append(off)
        off += n
    return RowPlan(lengths, starts, prefix)


def use_packing(mode: str, plan: RowPlan, width: int) -> bool:
    """Whether `mode` (`train.pack_rows`) packs a micro-batch laid out as `plan` whose padded suffixes are
    `width` positions long."""
    if mode not in PACK_MODES:
        raise ValueError(f"train.pack_rows must be one of {list(PACK_MODES)}, not {mode!r}")
    if mode != "auto":
        return mode == "on"
    padded = len(plan.lengths) * width
    return padded - plan.total > PACK_ABOVE_WASTE * padded


def use_generic_packing(
    mode: str, plan: RowPlan, width: int, refusal: str | None, cost: tuple[int, int]
) -> bool:
    """Whether `mode` packs a transformers-path micro-batch laid out as `plan` (no prefix; rows `width`
    tokens padded). Never where `refusal` (hf_generic.py's `packing_refusal`) says why not (`on` then
    raises). Packed, transformers attends once over all N = Σ s_b tokens with a block-diagonal mask: N²
    scores per head and layer, where the padded rows' causal SDPA computes about B · width² / 2; so `auto`
    packs only where padding is over `PACK_ABOVE_WASTE` (as `use_packing`) and the estimate
    N · c_tok + N² · c_score is below B · width · c_tok + B · width² / 2 · c_score, with `cost` =
    (c_tok, c_score): a forward's FLOPs per token and per attention score (`GenericCausalLM.flops`)."""
    packs = use_packing(mode, plan, width)  # checks the mode
    if refusal is not None:
        if mode == "on":
            raise _refused(refusal)
        return False
    if not packs or plan.total == 0:
        return False
    if mode == "on":
        return True
    per_token, per_score = cost
    b, n = len(plan.lengths), plan.total
    return n * per_token + n * n * per_score < b * width * per_token + b * width * width * per_score // 2


def check_pack_rows(model: object, mode: str) -> None:
    """Refuse `train.pack_rows: on` for a transformers-path model whose rows cannot run packed, when
    the trainer loads it (not at the first update)."""
    if mode == "on" and getattr(model, "generic", False):
        refusal = packing_refusal(model.config)  # type: ignore[attr-defined]
        if refusal is not None:
            raise _refused(refusal)


def _refused(refusal: str) -> ValueError:
    return ValueError(f"train.pack_rows: on: {refusal}; set train.pack_rows: auto (runs padded) or off")


def packed_positions(plan: RowPlan, device: torch.device) -> tuple[Tensor, Tensor]:
    """(micro-batch row, full-sequence position) of every packed token, [N] each."""
    rows = [torch.full((n,), b, dtype=torch.long) for b, n in enumerate(plan.lengths) if n]
    pos = [torch.arange(plan.prefix, plan.prefix + n) for n in plan.lengths if n]
    return torch.cat(rows).to(device), torch.cat(pos).to(device)


@dataclass(frozen=True)
class RowAttention:
    """How the packed rows attend in the layers of one window size (`attend`; see the module docstring)."""

    lengths: list[int]  # suffix tokens of each packed row (rows with none left out)
    prefix: int
    masks: list[Tensor | None]  # per row, for per-row SDPA (None: is_causal, windowed if sliding)
    window: int | None

    @staticmethod
    def build(plan: RowPlan, window: int | None, device: torch.device) -> RowAttention:
        """The per-row views of `plan`'s rows for layers with `window` (None: global)."""
        lengths = [n for n in plan.lengths if n]
        p = plan.prefix
        masks: list[Tensor | None] = [
            suffix_mask(torch.arange(p, p + n, device=device), p + n, window) if p else None for n in lengths
        ]
        return RowAttention(lengths, p, masks, window)

    def attend(
        self, attn: Attention, q: Tensor, k: Tensor, v: Tensor, kp: Tensor | None, vp: Tensor | None
    ) -> Tensor:
        """Attention of the packed rows' q/k/v [1, heads, N, head_dim], each row over the shared prefix's
        keys/values `kp`/`vp` [1, kv_heads, P, head_dim] (None: no prefix) and its own."""
        if q.is_cuda and q.dtype in VARLEN_DTYPES and _varlen_attn() is not None:
            return self._varlen(attn, q, k, v, kp, vp)
        # split, not sliced: the backward joins the rows' gradients with one cat (a slice's backward
        # would fill a zero tensor of all N positions per row and add them up)
        parts = (q.split(self.lengths, 2), k.split(self.lengths, 2), v.split(self.lengths, 2))
        outs = []
        for qs, ks, vs, mask in zip(*parts, self.masks, strict=True):
            if kp is not None and vp is not None:
                ks, vs = torch.cat([kp, ks], dim=2), torch.cat([vp, vs], dim=2)
            outs.append(attn.attend(qs, ks, vs, mask))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def _varlen(
        self, attn: Attention, q: Tensor, k: Tensor, v: Tensor, kp: Tensor | None, vp: Tensor | None
    ) -> Tensor:
        """One varlen flash call for all rows (CUDA, bf16/fp16). NOT RUN YET (no GPU where written)."""
        varlen_attn = _varlen_attn()
        assert varlen_attn is not None
        tq, tk, tv = (x[0].transpose(0, 1).contiguous() for x in (q, k, v))  # [N, heads, head_dim]
        k_lengths = self.lengths
        if kp is not None and vp is not None and self.prefix:
            pk, pv = kp[0].transpose(0, 1), vp[0].transpose(0, 1)
            tk = torch.cat([t for part in tk.split(self.lengths) for t in (pk, part)])
            tv = torch.cat([t for part in tv.split(self.lengths) for t in (pv, part)])
            k_lengths = [self.prefix + n for n in self.lengths]
        cu_q, cu_k = _offsets(self.lengths, q.device), _offsets(k_lengths, q.device)
        # flash's window (left, right) around the key aligned with the query: (-1, 0) causal; a sliding
        # layer sees `window` keys, itself included
        window = (-1, 0) if self.window is None else (self.window - 1, 0)
        o = varlen_attn(tq, tk, tv, cu_q, cu_k, max(self.lengths), max(k_lengths),
                        scale=attn.scale, window_size=window, enable_gqa=True)  # fmt: skip
        return o.transpose(0, 1).unsqueeze(0)


def _offsets(lengths: list[int], device: torch.device) -> Tensor:
    """Cumulative offsets [R + 1] (int32) of rows of `lengths`."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return out.to(device)


def _varlen_attn() -> Callable[..., Tensor] | None:
    """torch's `varlen_attn` where the torch installed has it (2.13 does), else None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn  # type: ignore[return-value]
