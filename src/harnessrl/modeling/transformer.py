"""The decoder-only transformer every supported family is made of, with Hugging Face's parameter names.

A family (modules `llama`, `qwen2`, `qwen3`, `gemma3`; the registry is `families`) is a reading of its
`config.json` into a `ModelConfig`: which of the pieces below it uses. The pieces:

- attention: grouped-query, RoPE, optional q/k/v biases (Qwen2), an RMSNorm over each head of q and k
  before RoPE (Qwen3, Gemma 3), a scale other than 1/sqrt(head_dim) (Gemma 3's query_pre_attn_scalar),
  sliding-window layers with their own RoPE base beside global ones (Gemma 3);
- feed-forward: gated, act(gate(x)) * up(x), with SiLU or tanh-approximated GELU;
- norms: RMSNorm scaling by w (Llama) or by (1 + w) in fp32 (Gemma); pre-norm blocks, or "sandwich"
  blocks that also normalise each sub-block's output before its residual (Gemma 3);
- embeddings optionally scaled by sqrt(hidden) (Gemma), logits optionally soft-capped.

One module serves both the trainer and the builtin engine (modeling/causal_lm.py holds the model with its
entry points), so the logprobs the engine reports and the ones the trainer recomputes come from the
same arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from harnessrl.modeling.rope import RopeScaling

FULL = "full_attention"
SLIDING = "sliding_attention"
# cos/sin per layer kind (FULL, SLIDING), each [B, 1, T, head_dim]
Rope = dict[str, tuple[Tensor, Tensor]]


@dataclass
class ModelConfig:
    """Hyperparameters of a decoder; defaults are SmolLM2-135M-Instruct's (a Llama)."""

    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 30
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    rope_theta: float = 100000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    bos_token_id: int = 1
    eos_token_id: int = 2
    rope_scaling: RopeScaling | None = None  # linear / YaRN / llama3 scaling (modeling/rope.py)
    architecture: str = "LlamaForCausalLM"
    qkv_bias: bool = False  # biases on q/k/v (Qwen2)
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over head_dim of q and k before RoPE (Qwen3, Gemma 3)
    sandwich_norm: bool = False  # also normalise attention and MLP outputs (Gemma 3)
    norm_offset: bool = False  # RMSNorm scales by (1 + w), in fp32 (Gemma)
    embed_scale: float = 1.0  # embeddings times this (Gemma: sqrt(hidden_size))
    hidden_act: str = "silu"  # "silu" or "gelu_pytorch_tanh"
    attn_scale: float | None = None  # None: 1 / sqrt(head_dim)
    final_logit_softcapping: float | None = None
    sliding_window: int | None = None  # keys a sliding layer sees, itself included
    layer_types: tuple[str, ...] = ()  # per layer FULL or SLIDING; empty: every layer FULL
    local_rope_theta: float | None = None  # RoPE base of SLIDING layers (no scaling)
    # The config.json this was read from: written back on save (with the dtype updated).
    hf_config: dict[str, Any] | None = field(default=None, repr=False, compare=False)
    # The model folder this was loaded from (its tokenizer and generation config go into checkpoints).
    source_dir: str | None = field(default=None, repr=False, compare=False)

    def kind(self, layer: int) -> str:
        """FULL or SLIDING for decoder layer `layer`."""
        return self.layer_types[layer] if self.layer_types else FULL


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 as HF does: w * x (Llama) or (1 + w) * x (Gemma)."""

    def __init__(self, dim: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps, self.offset = eps, offset

    def forward(self, x: Tensor) -> Tensor:
        """Normalise the last dimension."""
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:  # Gemma scales in fp32 and rounds once
            return (h * (1.0 + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    """Rotate the two halves of the last dimension: (a, b) -> (-b, a)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Apply rotary embeddings; `cos`/`sin` broadcast against x [B, heads, T, head_dim]."""
    return x * cos + rotate_half(x) * sin


def window_mask(q_pos: Tensor, k_len: int, window: int | None) -> Tensor:
    """[Tq, k_len] bool: query at position q_pos[i] may see key j (causal, and within `window` keys)."""
    keys = torch.arange(k_len, device=q_pos.device)
    allowed = keys.unsqueeze(0) <= q_pos.unsqueeze(1)
    if window is not None:
        allowed &= keys.unsqueeze(0) > q_pos.unsqueeze(1) - window
    return allowed


class Attention(nn.Module):
    """Grouped-query self-attention with HF parameter names (see the module docstring for the options)."""

    def __init__(self, cfg: ModelConfig, kind: str = FULL) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.hd, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps, cfg.norm_offset)
        self.qk_norm = cfg.qk_norm
        self.scale = cfg.attn_scale  # None: SDPA's default 1/sqrt(head_dim)
        self.window = cfg.sliding_window if kind == SLIDING else None
        # Inference only (modeling/packed.py): one product computing q, k and v side by side.
        self.fused_qkv: Callable[[Tensor], Tensor] | None = None

    def _qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        b, t, _ = x.shape
        if self.fused_qkv is not None:
            kv_width = self.n_kv * self.hd
            qp, kp, vp = self.fused_qkv(x).split([self.n_heads * self.hd, kv_width, kv_width], dim=-1)
        else:
            qp, kp, vp = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = qp.view(b, t, self.n_heads, self.hd).transpose(1, 2)
        k = kp.view(b, t, self.n_kv, self.hd).transpose(1, 2)
        v = vp.view(b, t, self.n_kv, self.hd).transpose(1, 2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _out(self, o: Tensor) -> Tensor:
        b, _, t, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(b, t, self.n_heads * self.hd))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """softmax(q k^T * scale + mask) v; `mask` None means plain causal (q and k of equal length)."""
        if mask is None and self.window is not None:
            mask = window_mask(torch.arange(q.shape[2], device=q.device), k.shape[2], self.window)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=True
        )

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None) -> Tensor:
        """Full-sequence attention (training); `mask` None means plain causal (windowed if sliding)."""
        q, k, v = self._qkv(x, cos, sin)
        return self._out(self.attend(q, k, v, mask))

    def prefill(
        self, x: Tensor, cos: Tensor, sin: Tensor, kvs: list[Tensor], spans: list[tuple[int, int]]
    ) -> Tensor:
        """Attend several sequences packed along x's time axis, each over its own cached prefix.

        `x` is [1, T, hidden] holding the sequences back to back; `spans[i]` = (length, start position) of
        sequence i and `kvs[i]` its slot view [2, n_kv, max_len, head_dim] of this layer, where its K/V
        are written. The projections run once over all T tokens; attention runs per sequence.
        """
        q, k, v = self._qkv(x, cos, sin)
        outs, off = [], 0
        for kv, (t, start) in zip(kvs, spans, strict=True):
            qs, ks, vs = q[:, :, off : off + t], k[:, :, off : off + t], v[:, :, off : off + t]
            off += t
            kv[0, :, start : start + t] = ks[0]
            kv[1, :, start : start + t] = vs[0]
            if start == 0:
                o = self.attend(qs, ks, vs, None)
            else:
                keys, values = kv[0, :, : start + t].unsqueeze(0), kv[1, :, : start + t].unsqueeze(0)
                q_pos = torch.arange(start, start + t, device=x.device)
                o = self.attend(qs, keys, values, window_mask(q_pos, start + t, self.window))
            outs.append(o)
        return self._out(outs[0] if len(outs) == 1 else torch.cat(outs, dim=2))

    def decode(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv: Tensor, lengths: Tensor, mask: Tensor
    ) -> Tensor:
        """One new token per sequence; `kv` is [2, B, n_kv, max_len, head_dim] for slots 0..B-1 and
        `mask` [B, 1, 1, width] the causal mask (this method narrows it to the window)."""
        q, k, v = self._qkv(x, cos, sin)  # q [B, H, 1, hd], k/v [B, n_kv, 1, hd]
        b = x.shape[0]
        rows = torch.arange(b, device=x.device)
        kv[0][rows, :, lengths] = k[:, :, 0]
        kv[1][rows, :, lengths] = v[:, :, 0]
        width = mask.shape[-1]
        if self.window is not None:
            keys = torch.arange(width, device=x.device)
            mask = mask & (keys > (lengths - self.window).unsqueeze(1)).view(b, 1, 1, width)
        # All queries of a KV group sit at the same position, so they can share the keys without a copy:
        # fold the group's heads into the query-length dimension.
        qg = q.reshape(b, self.n_kv, self.n_heads // self.n_kv, self.hd)
        o = F.scaled_dot_product_attention(
            qg, kv[0, :, :, :width], kv[1, :, :, :width], attn_mask=mask, scale=self.scale
        )
        return self.o_proj(o.reshape(b, 1, self.n_heads * self.hd))


ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class MLP(nn.Module):
    """Gated feed-forward block: down(act(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        bias = cfg.mlp_bias
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)
        self.act = ACTIVATIONS[cfg.hidden_act]
        # Inference only (modeling/packed.py): one product computing gate and up side by side.
        self.fused_gate_up: Callable[[Tensor], Tensor] | None = None

    def forward(self, x: Tensor) -> Tensor:
        """down(act(gate(x)) * up(x))."""
        if self.fused_gate_up is not None:
            gate, up = self.fused_gate_up(x).chunk(2, dim=-1)
            return self.down_proj(self.act(gate) * up)
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A transformer block: pre-norm (Llama, Qwen) or sandwich-norm (Gemma 3)."""

    def __init__(self, cfg: ModelConfig, kind: str = FULL) -> None:
        super().__init__()
        eps, offset = cfg.rms_norm_eps, cfg.norm_offset
        self.kind = kind
        self.self_attn = Attention(cfg, kind)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, offset)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, offset)
        self.sandwich = cfg.sandwich_norm
        if cfg.sandwich_norm:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, offset)

    def finish(self, x: Tensor, attn_out: Tensor) -> Tensor:
        """Residual after attention, then the MLP sub-block."""
        if not self.sandwich:
            h = x + attn_out
            return h + self.mlp(self.post_attention_layernorm(h))
        h = x + self.post_attention_layernorm(attn_out)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


def check_config(cfg: ModelConfig) -> None:
    """Refuse shapes and options the model cannot compute, naming the config.json field."""
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ValueError("config.json: num_attention_heads must be a multiple of num_key_value_heads")
    if cfg.head_dim % 2 or cfg.rope_theta != cfg.rope_theta:
        raise ValueError("config.json: head_dim must be even and rope_theta finite")
    if cfg.hidden_act not in ACTIVATIONS:
        raise ValueError(
            f"config.json: hidden_act {cfg.hidden_act!r} is not supported; use one of {list(ACTIVATIONS)}"
        )
    if cfg.layer_types and len(cfg.layer_types) != cfg.num_hidden_layers:
        raise ValueError("config.json: layer_types must name one type per layer (num_hidden_layers)")
    bad = sorted(set(cfg.layer_types) - {FULL, SLIDING})
    if bad:
        raise ValueError(f"config.json: layer_types {bad} unknown; use {FULL!r} or {SLIDING!r}")
    if SLIDING in cfg.layer_types and not (cfg.sliding_window or 0) > 0:
        raise ValueError("config.json: sliding_attention layers need sliding_window > 0")
