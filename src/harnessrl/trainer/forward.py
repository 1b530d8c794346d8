"""The trainer's forward pass: logprobs of the trainable tokens only, with a shared prefix computed once.

Rows of one step share long prefixes (system prompt, worked examples, the whole prompt for GRPO
siblings). For a micro-batch whose rows agree on their first P tokens, the prefix runs once (batch 1)
and every row's suffix attends to its keys/values; gradients flow back through the shared prefix, so
the result equals a full forward of every row exactly (up to float summation order). The vocabulary
projection and log-softmax run only at positions whose next token is trainable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from harnessrl.modeling.llama import LlamaForCausalLM
from harnessrl.modeling.logprobs import tempered_log_softmax


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def shareable_prefix(rows: list[list[int]], first_trainable: list[int]) -> int:
    """Tokens every row shares that end before any row's first trainable token's predecessor."""
    p = min(len(r) for r in rows)
    for r in rows[1:]:
        p = min(p, common_prefix_len(rows[0], r))
    # the logits predicting token t come from position t-1, which must lie in the (per-row) suffix
    return max(0, min(p, min(first_trainable) - 1))


@dataclass
class Selected:
    """Logprobs at the selected (row, position) pairs, where position t predicts token t+1."""

    logprobs: Tensor  # [N]
    row: Tensor  # [N] row index within the micro-batch
    pos: Tensor  # [N] full-sequence position of the predicting token
    entropy: Tensor | None = None  # [N] entropy of the tempered distribution there (no gradient)


def selected_logprobs(
    model: LlamaForCausalLM,
    tokens: Tensor,
    select: Tensor,
    temps: Tensor,
    prefix: int,
    entropy: bool = False,
) -> Selected:
    """Logprobs of tokens[b, t+1] for every (b, t) with select[b, t] (select: [B, L-1] bool).

    `tokens` [B, L] is right-padded; its first `prefix` tokens are identical in every row and no
    selected position lies before `prefix`.
    """
    b, length = tokens.shape
    emb = model.model.embed_tokens
    dtype = emb.weight.dtype
    xs = emb(tokens[:, prefix:])
    pos_s = torch.arange(prefix, length, device=tokens.device).unsqueeze(0)
    cos_s, sin_s = model.rope(pos_s, dtype)
    xp = emb(tokens[:1, :prefix]) if prefix else None
    cos_p, sin_p = model.rope(torch.arange(prefix, device=tokens.device).unsqueeze(0), dtype)
    s = length - prefix
    mask = torch.ones(s, prefix + s, dtype=torch.bool, device=tokens.device).tril(prefix)
    for layer in model.model.blocks:
        attn = layer.self_attn
        hs = layer.input_layernorm(xs)
        q, k, v = attn._qkv(hs, cos_s, sin_s)
        if xp is not None:
            qp, kp, vp = attn._qkv(layer.input_layernorm(xp), cos_p, sin_p)
            op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
            xp = layer.finish(xp, attn._out(op))
            k = torch.cat([kp.expand(b, -1, -1, -1), k], dim=2)
            v = torch.cat([vp.expand(b, -1, -1, -1), v], dim=2)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        xs = layer.finish(xs, attn._out(o))
    row, pos = torch.nonzero(select, as_tuple=True)
    if bool((pos < prefix).any()):
        raise ValueError("a selected position lies inside the shared prefix")
    hidden = model.model.norm(xs[row, pos - prefix])
    logits = model.lm_head(hidden)
    full = tempered_log_softmax(logits, temps[row])  # the same function the engine's logprobs use
    lp = full.gather(-1, tokens[row, pos + 1].unsqueeze(-1)).squeeze(-1)
    ent = None
    if entropy:
        with torch.no_grad():
            ent = -(full.exp() * full).sum(-1)
    return Selected(lp, row, pos, ent)
