"""Sampling parameters and one batched sampling step.

Each sampled token's logprob is `token_logprobs(logits, token, temperature)` from
`harnessrl.modeling.logprobs`: the log-softmax of the tempered logits (T <= 0 counts as 1.0), taken
*after* temperature and *before* top-k / top-p truncation, which only narrow which tokens may be drawn
(top-k first, then top-p over what is left, as vLLM does).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from torch import Tensor

from harnessrl.modeling.logprobs import tempered_log_softmax


@dataclass
class SamplingParams:
    """What a request asks of generation (already validated)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no limit
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True
    adapter: str | None = None  # the served LoRA adapter of this request (None: the base weights)

    @property
    def greedy(self) -> bool:
        """Temperature 0 means argmax decoding."""
        return self.temperature <= 0


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A per-request generator: seeded if asked, else from OS entropy."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else random.SystemRandom().randrange(2**63))
    return gen


@dataclass
class StepSample:
    """The outcome of sampling one token for each row of a batch."""

    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]  # per row, the k most likely (id, logprob); empty when k = 0


def _top_p_filter(probs: Tensor, top_p: float, first_k: int = 256) -> Tensor:
    """Zero the tail of `probs` [V] outside the smallest set of most likely tokens whose mass reaches top_p.

    Looks at the `first_k` most likely tokens first (a partial sort); falls back to a full sort only when
    the nucleus is larger than that. Both give the same set.
    """
    total = probs.sum()
    k = min(first_k, probs.shape[0])
    sorted_p, order = probs.topk(k)
    if k < probs.shape[0] and sorted_p.sum() < top_p * total:
        sorted_p, order = probs.sort(descending=True)
    keep = (sorted_p.cumsum(0) - sorted_p) < top_p * total
    keep[0] = True
    return torch.zeros_like(probs).scatter(0, order, sorted_p * keep)


def _inverse_cdf(probs: Tensor, uniforms: Tensor) -> Tensor:
    """Draw one index per row of unnormalised `probs` [B, V] from uniforms [B] in [0, 1)."""
    cdf = probs.cumsum(-1)
    idx = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(-1), right=True)
    return idx.squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def sample_step(
    logits: Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> StepSample:
    """Sample one token per row of `logits` [B, V]; report its logprob and the requested top-k.

    Each sampling row draws a single uniform from its own generator (so a seed fixes the output
    whatever else shares the batch) and inverts the CDF of the tempered, top-p-truncated distribution.
    """
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    logp = tempered_log_softmax(logits, temps)
    tokens = logits.argmax(-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        probs = logp[rows].exp()
        for j, i in enumerate(rows):
            if 0 < params[i].top_k < probs.shape[-1]:
                kth = probs[j].topk(params[i].top_k).values[-1]
                probs[j] = torch.where(probs[j] >= kth, probs[j], 0.0)
            if params[i].top_p < 1.0:
                probs[j] = _top_p_filter(probs[j], params[i].top_p)
        u = torch.cat([torch.rand(1, generator=generators[i], device=device) for i in rows])
        tokens[rows] = _inverse_cdf(probs, u)
    lps = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    k = max(p.top_logprobs for p in params)
    top: list[list[tuple[int, float]]] = [[] for _ in params]
    if k > 0:
        vals, ids = logp.topk(k, dim=-1)
        vals_l, ids_l = vals.tolist(), ids.tolist()
        for i, p in enumerate(params):
            n = p.top_logprobs
            top[i] = list(zip(ids_l[i][:n], vals_l[i][:n], strict=True))
    return StepSample(tokens=tokens.tolist(), logprobs=lps.tolist(), top=top)
