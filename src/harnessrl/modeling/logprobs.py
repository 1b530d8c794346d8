"""THE definition of a token's logprob, shared by the engine (reports it) and the trainer (recomputes it).

logprob(token) = log_softmax(logits.float() / T)[token], with T <= 0 (greedy) treated as T = 1.0: a greedy
request reports logprobs of the untempered distribution. The logprob is taken after temperature and before
any top-p truncation, so it is the logprob under the full tempered distribution, not the truncated one.
"""

from __future__ import annotations

import torch
from torch import Tensor


def effective_temperature(temperature: float | Tensor) -> float | Tensor:
    """Temperature used for logprobs: T, or 1.0 where T <= 0 (greedy)."""
    if isinstance(temperature, Tensor):
        t = temperature.float()
        return torch.where(t > 0, t, torch.ones_like(t))
    return float(temperature) if temperature > 0 else 1.0


def tempered_log_softmax(logits: Tensor, temperature: float | Tensor = 1.0) -> Tensor:
    """log_softmax(logits.float() / T) over the last dim; a tensor T has one value per row."""
    t = effective_temperature(temperature)
    scaled = logits.float()
    if isinstance(t, Tensor):
        scaled = scaled / t.view(*t.shape, *([1] * (scaled.dim() - t.dim())))
    elif t != 1.0:
        scaled = scaled / t
    return torch.log_softmax(scaled, dim=-1)


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float | Tensor = 1.0) -> Tensor:
    """Logprob of `tokens` [...] under `logits` [..., V] at `temperature` (see the module docstring)."""
    lp = tempered_log_softmax(logits, temperature)
    return lp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def next_token_logprobs(logits: Tensor, input_ids: Tensor, temperature: float | Tensor = 1.0) -> Tensor:
    """For a full forward's logits [B, T, V]: logprob of input_ids[:, t+1] given the prefix; [B, T-1]."""
    return token_logprobs(logits[:, :-1], input_ids[:, 1:], temperature)
