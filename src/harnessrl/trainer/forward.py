"""The trainer's forward pass: logprobs of the trainable tokens only, with a shared prefix computed once.

Rows of one step share long prefixes (system prompt, worked examples, the whole prompt for GRPO
siblings). For a micro-batch whose rows agree on their first P tokens, the prefix runs once (batch 1)
and every row's suffix attends to its keys/values; gradients flow back through the shared prefix, so
the result equals a full forward of every row exactly (up to float summation order). The suffixes run
right-padded to the longest ([B, S, H]) or, when their lengths differ (`train.pack_rows`), packed back to
back ([1, Σ s_b, H]; trainer/packing.py), with the same values. The vocabulary projection and
log-softmax run only at positions whose next token is trainable.

Memory: the [tokens × vocab] fp32 logits (SmolLM2: 192 KB a token) are never materialised for a whole
micro-batch: the projection, log-softmax and gather run over chunks of `LOGIT_CHUNK_ELEMENTS // vocab`
tokens, each chunk checkpointed (its logits are recomputed in the backward pass instead of kept), so
the head holds one chunk's buffers at a time. With `checkpoint_layers` each decoder layer is
checkpointed too: the forward keeps only every layer's input and the backward recomputes one layer at a
time (about a third more compute for a small fraction of the activations). By default (None) layers
are checkpointed when a micro-batch's activations would exceed `CHECKPOINT_ABOVE_BYTES`: SmolLM2-135M
keeps ~1.3 MB per token position (30 layers) plus the attention weights, 5-8 GB for a 4,096-token
micro-batch. Recomputation runs the same operations on the same inputs: logprobs and gradients are
unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from harnessrl.modeling.causal_lm import CausalLM, softcap
from harnessrl.modeling.hf_generic import packing_refusal
from harnessrl.modeling.logprobs import tempered_log_softmax
from harnessrl.modeling.memory import trim_heap
from harnessrl.modeling.transformer import DecoderLayer, Rope
from harnessrl.trainer.packing import (
    PackRows,
    RowAttention,
    RowPlan,
    packed_positions,
    plan_rows,
    suffix_mask,
    use_generic_packing,
    use_packing,
)

# Logit elements materialised at once by the head (64 MB of fp32 logits: 341 tokens of a 49,152 vocab).
LOGIT_CHUNK_ELEMENTS = 1 << 24
# Estimated activation bytes of a micro-batch above which its layers are checkpointed by default.
CHECKPOINT_ABOVE_BYTES = 256 << 20


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
    model: CausalLM,
    tokens: Tensor,
    select: Tensor,
    temps: Tensor,
    prefix: int,
    entropy: bool = False,
    checkpoint_layers: bool | None = None,
    pack: PackRows | str = "auto",
) -> Selected:
    """Logprobs of tokens[b, t+1] for every (b, t) with select[b, t] (select: [B, L-1] bool).

    `tokens` [B, L] is right-padded; its first `prefix` tokens are identical in every row and no
    selected position lies before `prefix`. `checkpoint_layers`: recompute each layer's activations in
    the backward pass instead of keeping them (same values); None: when `activation_bytes` exceeds
    `CHECKPOINT_ABOVE_BYTES` (see the module docstring). `pack` (`train.pack_rows`): run the rows'
    suffixes packed back to back instead of padded (trainer/packing.py; same values).
    """
    if getattr(model, "generic", False):  # transformers' model: its own forward (modeling/hf_generic.py)
        return generic_selected_logprobs(model, tokens, select, temps, entropy, checkpoint_layers, pack)
    row, pos = torch.nonzero(select, as_tuple=True)
    if bool((pos < prefix).any()):
        raise ValueError("a selected position lies inside the shared prefix")
    plan = plan_rows(select, prefix)
    packed = use_packing(pack, plan, tokens.shape[1] - prefix)
    sx = packed_suffixes(model, tokens, plan) if packed else padded_suffixes(model, tokens, prefix)
    dtype = model.model.embed_tokens.weight.dtype
    xs, xp = sx.xs, model.embed(tokens[:1, :prefix]) if prefix else None
    rope_p = model.rope(torch.arange(prefix, device=tokens.device).unsqueeze(0), dtype)
    if checkpoint_layers is None:
        checkpoint_layers = layer_bytes(model, sx.positions + prefix, sx.scores) > CHECKPOINT_ABOVE_BYTES
    recompute = checkpoint_layers and torch.is_grad_enabled()
    for layer in model.model.blocks:
        args = (layer, xs, xp, sx.rope, rope_p, sx.views[layer.self_attn.window])
        xs, xp = checkpoint(run_layer, *args, use_reentrant=False) if recompute else run_layer(*args)
        # after each layer's backward its recomputed activations go back to the OS (LoRA on later layers
        # only: the first layers' outputs need no gradient)
        if recompute and xs.requires_grad:
            xs.register_hook(_trim_heap_hook)
    if packed:
        starts = torch.tensor(plan.starts, device=tokens.device)
        hidden = model.model.norm(xs[0, starts[row] + pos - prefix])
    else:
        hidden = model.model.norm(xs[row, pos - prefix])
    cap = model.config.final_logit_softcapping
    lp, ent = head_logprobs(model.lm_head, hidden, tokens[row, pos + 1], temps[row], entropy, cap)
    return Selected(lp, row, pos, ent)


# How the rows' suffixes see the keys in the layers of one window size: the padded rows' mask
# [S, P + S], or the packed rows' per-row attention.
SuffixView = Tensor | RowAttention


@dataclass
class Suffixes:
    """The rows' suffixes ready for the decoder layers, padded [B, S, H] or packed [1, N, H]."""

    xs: Tensor  # embedded suffix tokens
    rope: Rope  # their RoPE (each token at its full-sequence position)
    views: dict[int | None, SuffixView]  # per sliding window (None: global layers)
    positions: int  # suffix positions run (B · S padded, N packed)
    scores: int  # attention scores per head: Σ over rows of suffix × (prefix + suffix)


def padded_suffixes(model: CausalLM, tokens: Tensor, prefix: int) -> Suffixes:
    """The rows' suffixes right-padded to the longest, [B, L - prefix, H]."""
    b, length = tokens.shape
    pos_s = torch.arange(prefix, length, device=tokens.device)
    rope = model.rope(pos_s.unsqueeze(0), model.model.embed_tokens.weight.dtype)
    s = length - prefix
    views: dict[int | None, SuffixView] = {w: suffix_mask(pos_s, length, w) for w in _windows(model)}
    return Suffixes(model.embed(tokens[:, prefix:]), rope, views, b * s, b * s * length)


def packed_suffixes(model: CausalLM, tokens: Tensor, plan: RowPlan) -> Suffixes:
    """The rows' suffixes packed back to back, [1, Σ s_b, H] (trainer/packing.py)."""
    rows, pos = packed_positions(plan, tokens.device)
    rope = model.rope(pos.unsqueeze(0), model.model.embed_tokens.weight.dtype)
    views: dict[int | None, SuffixView] = {
        w: RowAttention.build(plan, w, tokens.device) for w in _windows(model)
    }
    scores = sum(n * (plan.prefix + n) for n in plan.lengths)
    return Suffixes(model.embed(tokens[rows, pos].unsqueeze(0)), rope, views, plan.total, scores)


def _windows(model: CausalLM) -> set[int | None]:
    return {b.self_attn.window for b in model.model.blocks}


def _trim_heap_hook(grad: Tensor) -> None:
    trim_heap()


def activation_bytes(model: CausalLM, rows: int, suffix: int, prefix: int) -> int:
    """About the bytes autograd keeps for the decoder layers of a micro-batch of `rows` padded suffixes
    of `suffix` positions after a shared `prefix` (`layer_bytes`)."""
    return layer_bytes(model, rows * suffix + prefix, rows * suffix * (prefix + suffix))


def layer_bytes(model: CausalLM, positions: int, scores: int) -> int:
    """About the bytes autograd keeps for the decoder layers over `positions` token positions with
    `scores` attention scores per head: per position and layer ~8 hidden-size and 4 intermediate-size
    vectors (norms, projections, SwiGLU), plus each layer's attention weights."""
    c = model.config
    per_layer = positions * (8 * c.hidden_size + 4 * c.intermediate_size)
    per_layer += c.num_attention_heads * scores
    size = model.lm_head.weight.element_size()
    return int(c.num_hidden_layers * per_layer * size)


# A layer sharded by FSDP (trainer/fsdp.py) carries its step under this name, registered as an FSDP forward
# method: calling it gathers the layer's weights first (and its backward reduces their gradients).
SHARDED_STEP = "sharded_step"


def run_layer(
    layer: DecoderLayer, xs: Tensor, xp: Tensor | None, rope_s: Rope, rope_p: Rope, mask: SuffixView
) -> tuple[Tensor, Tensor | None]:
    """One decoder layer of the training forward (`layer_forward`), through the layer's FSDP step when sharded."""
    step = getattr(layer, SHARDED_STEP, None)
    if step is not None:
        out: tuple[Tensor, Tensor | None] = step(xs, xp, rope_s, rope_p, mask)
        return out
    return layer_forward(layer, xs, xp, rope_s, rope_p, mask)


def layer_forward(
    layer: DecoderLayer, xs: Tensor, xp: Tensor | None, rope_s: Rope, rope_p: Rope, mask: SuffixView
) -> tuple[Tensor, Tensor | None]:
    """One decoder layer over the rows' suffixes `xs` and their shared prefix `xp` [1, P, H] (run once,
    its keys/values broadcast to every row); returns both outputs. Padded, `xs` is [B, S, H] and `mask`
    [S, P + S] the suffix's (causal, windowed for a sliding layer) view of the keys; packed, `xs` is
    [1, N, H] and `mask` the rows' `RowAttention`."""
    attn = layer.self_attn
    q, k, v = attn._qkv(layer.input_layernorm(xs), *rope_s[layer.kind])
    kp = vp = None
    if xp is not None:
        qp, kp, vp = attn._qkv(layer.input_layernorm(xp), *rope_p[layer.kind])
        xp = layer.finish(xp, attn._out(attn.attend(qp, kp, vp, None)))
    if isinstance(mask, RowAttention):
        o = mask.attend(attn, q, k, v, kp, vp)
    elif kp is not None and vp is not None:
        b = xs.shape[0]
        k = torch.cat([kp.expand(b, -1, -1, -1), k], dim=2)
        v = torch.cat([vp.expand(b, -1, -1, -1), v], dim=2)
        o = attn.attend(q, k, v, mask)
    else:
        o = attn.attend(q, k, v, None)
    return layer.finish(xs, attn._out(o)), xp


def head_logprobs(
    head: nn.Linear,
    hidden: Tensor,
    targets: Tensor,
    temps: Tensor,
    entropy: bool = False,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Logprobs of `targets` [N] under the tempered softmax of `head(hidden)` ([N, H] -> [N, V] logits),
    and (no gradient) the entropy of each position's distribution; chunk by chunk over the N positions,
    each chunk checkpointed when gradients are recorded (see the module docstring)."""
    chunk = max(1, LOGIT_CHUNK_ELEMENTS // head.out_features)
    # one chunk's buffers are kept for the backward pass as they are; several are recomputed one by one
    recompute = torch.is_grad_enabled() and hidden.requires_grad and hidden.shape[0] > chunk
    lps: list[Tensor] = []
    ents: list[Tensor] = []
    for start in range(0, hidden.shape[0], chunk):
        part = slice(start, start + chunk)
        args = (head, hidden[part], targets[part], temps[part], entropy, softcap)
        lp, ent = checkpoint(_head_chunk, *args, use_reentrant=False) if recompute else _head_chunk(*args)
        lps.append(lp)
        if ent is not None:
            ents.append(ent)
    if not lps:  # no selected position: empty results of the right dtype
        lp, ent = _head_chunk(head, hidden, targets, temps, entropy, softcap)
        return lp, ent
    return torch.cat(lps), torch.cat(ents) if entropy else None


def _head_chunk(
    head: nn.Linear, hidden: Tensor, targets: Tensor, temps: Tensor, entropy: bool, cap: float | None
) -> tuple[Tensor, Tensor | None]:
    full = tempered_log_softmax(
        softcap(head(hidden), cap), temps
    )  # the same function the engine's logprobs use
    lp = full.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = None
    if entropy:
        with torch.no_grad():
            ent = -full.exp().mul_(full).sum(-1)
    return lp, ent


def generic_selected_logprobs(
    model: Any,
    tokens: Tensor,
    select: Tensor,
    temps: Tensor,
    entropy: bool = False,
    checkpoint_layers: bool | None = None,
    pack: PackRows | str = "auto",
) -> Selected:
    """Logprobs of tokens[b, t+1] for every (b, t) with select[b, t], through transformers' forward (a
    transformers-path model, modeling/hf_generic.py).

    Each micro-batch runs transformers' decoder over its rows whole (no shared-prefix split: that needs
    the layers' internals, which differ per architecture), then the SAME chunked head as the builtin path
    (`head_logprobs`) at the selected positions only. Right-padded, the rows need no attention mask: every
    layer is causal (attention and the linear-attention recurrences alike), so padding after a row's last
    token never reaches its selected positions. Packed (`pack`, `train.pack_rows`; `use_generic_packing`
    decides), each row up to its last selected token runs back to back on one time axis with its
    positions restarting at 0: transformers reads those `position_ids` as packed sequences and masks
    attention per row (block-diagonal causal, windowed per row on sliding layers; one SDPA call over all
    packed tokens), for the model types `packing_refusal` allows. `checkpoint_layers` turns on
    transformers' own gradient checkpointing of the decoder layers; None decides as for the builtin path
    (`layer_bytes` over the positions and attention scores run)."""
    decoder = model.model
    plan = plan_rows(select, 0)
    b, length = tokens.shape
    packed = use_generic_packing(pack, plan, length, packing_refusal(model.config), model.flops)
    if checkpoint_layers is None:
        positions = plan.total if packed else b * length
        scores = plan.total**2 if packed else b * length * length
        checkpoint_layers = layer_bytes(model, positions, scores) > CHECKPOINT_ABOVE_BYTES
    wants = bool(checkpoint_layers) and decoder.training
    if wants != bool(getattr(decoder, "is_gradient_checkpointing", False)):
        if wants:
            decoder.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            decoder.gradient_checkpointing_disable()
    row, pos = select.nonzero(as_tuple=True)
    if packed:
        rows, at = packed_positions(plan, tokens.device)
        hidden = model.hidden_states(tokens[rows, at].unsqueeze(0), position_ids=at.unsqueeze(0))[0]
        h = hidden[torch.tensor(plan.starts, device=tokens.device)[row] + pos]
    else:
        h = model.hidden_states(tokens)[row, pos]
    cap = model.config.final_logit_softcapping
    lp, ent = head_logprobs(model.lm_head, h, tokens[row, pos + 1], temps[row], entropy, cap)
    return Selected(lp, row, pos, ent)
