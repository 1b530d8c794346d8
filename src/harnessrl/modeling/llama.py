"""A plain-PyTorch Llama (SmolLM2 family) whose state_dict keys are exactly Hugging Face's.

One module serves both the trainer and the builtin engine, so the logprobs the engine reports and the
ones the trainer recomputes come from the same arithmetic:

- `forward(input_ids, attention_mask)`: full causal forward for training (no cache);
- `prefill(tokens, cache, slot, start)`: run a prompt (or its uncached suffix) into one KV-cache slot;
- `decode(tokens, cache, lengths)`: one batched decode step over cache slots `0..B-1`, each sequence at
  its own length.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from harnessrl.modeling.cache import KVCache
from harnessrl.modeling.rope import RopeScaling, rope_frequencies


@dataclass
class LlamaConfig:
    """Llama hyperparameters; defaults are SmolLM2-135M-Instruct's."""

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
    rope_scaling: RopeScaling | None = None  # linear / YaRN context extension (modeling/rope.py)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        """Read a Hugging Face `config.json` dict (transformers 4.x or 5.x layout)."""
        heads = int(d["num_attention_heads"])
        # transformers 4.x writes `rope_theta` + `rope_scaling`, 5.x `rope_parameters` (theta inside);
        # 5.x itself lets `rope_scaling` win when both are present
        params = d.get("rope_parameters") or {}
        rope = d.get("rope_scaling") or params
        theta = rope.get("rope_theta", d.get("rope_theta", params.get("rope_theta", 10000.0)))
        max_positions = int(d.get("max_position_embeddings", 2048))
        eos = d.get("eos_token_id", 2)
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
            rope_theta=float(theta),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=int(d.get("bos_token_id", 1)),
            eos_token_id=int(eos[0] if isinstance(eos, list) else eos),
            rope_scaling=RopeScaling.from_hf(rope, max_positions),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The Hugging Face `config.json` dict for this config (read the same by transformers 4.x and 5.x)."""
        d: dict[str, Any] = asdict(self)
        scaling = self.rope_scaling.to_hf() if self.rope_scaling else None
        d.update(
            architectures=["LlamaForCausalLM"],
            model_type="llama",
            hidden_act="silu",
            attention_bias=False,
            mlp_bias=False,
            rope_scaling=scaling,
            rope_parameters={"rope_theta": self.rope_theta, **(scaling or {"rope_type": "default"})},
            torch_dtype="float32",
        )
        return d


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in fp32 as HF does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        """Normalise the last dimension."""
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    """Rotate the two halves of the last dimension: (a, b) -> (-b, a)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Apply rotary embeddings; `cos`/`sin` broadcast against x [B, heads, T, head_dim]."""
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    """Grouped-query self-attention with HF parameter names."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.hd, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.hd, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.hd, cfg.hidden_size, bias=False)
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
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _out(self, o: Tensor) -> Tensor:
        b, _, t, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(b, t, self.n_heads * self.hd))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None) -> Tensor:
        """Full-sequence attention (training); `mask` None means plain causal."""
        q, k, v = self._qkv(x, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        return self._out(o)

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
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            else:
                keys, values = kv[0, :, : start + t].unsqueeze(0), kv[1, :, : start + t].unsqueeze(0)
                mask = torch.ones(t, start + t, dtype=torch.bool, device=x.device).tril(start)
                o = F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask, enable_gqa=True)
            outs.append(o)
        return self._out(outs[0] if len(outs) == 1 else torch.cat(outs, dim=2))

    def decode(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv: Tensor, lengths: Tensor, mask: Tensor
    ) -> Tensor:
        """One new token per sequence; `kv` is [2, B, n_kv, max_len, head_dim] for slots 0..B-1."""
        q, k, v = self._qkv(x, cos, sin)  # q [B, H, 1, hd], k/v [B, n_kv, 1, hd]
        b = x.shape[0]
        rows = torch.arange(b, device=x.device)
        kv[0][rows, :, lengths] = k[:, :, 0]
        kv[1][rows, :, lengths] = v[:, :, 0]
        width = mask.shape[-1]
        # All queries of a KV group sit at the same position, so they can share the keys without a copy:
        # fold the group's heads into the query-length dimension.
        qg = q.reshape(b, self.n_kv, self.n_heads // self.n_kv, self.hd)
        o = F.scaled_dot_product_attention(qg, kv[0, :, :, :width], kv[1, :, :, :width], attn_mask=mask)
        return self.o_proj(o.reshape(b, 1, self.n_heads * self.hd))


class MLP(nn.Module):
    """SwiGLU feed-forward block."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        # Inference only (modeling/packed.py): one product computing gate and up side by side.
        self.fused_gate_up: Callable[[Tensor], Tensor] | None = None

    def forward(self, x: Tensor) -> Tensor:
        """down(silu(gate(x)) * up(x))."""
        if self.fused_gate_up is not None:
            gate, up = self.fused_gate_up(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def finish(self, x: Tensor, attn_out: Tensor) -> Tensor:
        """Residual after attention, then the MLP sub-block."""
        h = x + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    """Embeddings, decoder layers and the final norm (HF's `model.` prefix)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def blocks(self) -> list[DecoderLayer]:
        """The decoder layers, typed."""
        return cast("list[DecoderLayer]", list(self.layers))


class LlamaForCausalLM(nn.Module):
    """Llama causal LM with HF-compatible parameter names and cache-aware inference entry points."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        _check_cfg(cfg)
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Kept in fp32 outside the buffers so `.to(dtype)` never rounds it (HF computes RoPE in fp32 too).
        self._inv_freq, self._rope_mult = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Random init as HF does (normal(0, std) linears/embeddings, ones for norms)."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("layernorm.weight") or name == "model.norm.weight":
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    def rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos/sin for integer positions [B, T] -> each [B, 1, T, head_dim] (YaRN: times its factor).

        The one RoPE of the training forward, the engine's prefill and its decode steps alike."""
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        freqs = positions.float().unsqueeze(-1) * self._inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self._rope_mult != 1.0:
            cos, sin = cos * self._rope_mult, sin * self._rope_mult
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Training forward: logits [B, T, V] for every position (causal, no cache)."""
        return self.lm_head(self.hidden_states(input_ids, attention_mask))

    def hidden_states(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """The training forward up to the final norm: [B, T, hidden] (project slices of it with
        `logits` when [T, V] logits of a long sequence would not fit in memory)."""
        b, t = input_ids.shape
        x = self.model.embed_tokens(input_ids)
        positions, mask = _positions_and_mask(attention_mask, b, t, input_ids.device)
        cos, sin = self.rope(positions, x.dtype)
        for layer in self.model.blocks:
            x = layer.finish(x, layer.self_attn(layer.input_layernorm(x), cos, sin, mask))
        return self.model.norm(x)

    def prefill(self, tokens: Tensor, cache: KVCache, slot: int, start: int = 0) -> Tensor:
        """Run `tokens` [T] at positions start.. into cache `slot`; return the last position's logits [V]."""
        return self.prefill_many([(tokens, slot, start)], cache)[0]

    def prefill_many(self, items: list[tuple[Tensor, int, int]], cache: KVCache) -> Tensor:
        """Prefill several sequences in one pass: `items[i]` = (tokens [T_i], cache slot, start position).

        The tokens are packed back to back so every projection is one large matrix product; attention
        stays per sequence. Returns the logits of each sequence's last position [N, V].
        """
        for tokens, _, start in items:
            if start + tokens.shape[0] > cache.max_len:
                raise ValueError(
                    f"sequence of {start + tokens.shape[0]} tokens exceeds the cache length {cache.max_len}"
                )
        device = items[0][0].device
        x = self.model.embed_tokens(torch.cat([t for t, _, _ in items]).unsqueeze(0))
        positions = torch.cat([torch.arange(s, s + t.shape[0], device=device) for t, _, s in items])
        cos, sin = self.rope(positions.unsqueeze(0), x.dtype)
        spans = [(t.shape[0], s) for t, _, s in items]
        for i, layer in enumerate(self.model.blocks):
            kvs = [cache.kv[i, :, slot] for _, slot, _ in items]
            x = layer.finish(x, layer.self_attn.prefill(layer.input_layernorm(x), cos, sin, kvs, spans))
        ends = torch.tensor(spans, device=device)[:, 0].cumsum(0) - 1
        return self.logits(self.model.norm(x[0, ends]))

    def logits(self, h: Tensor) -> Tensor:
        """The output projection of final hidden states [..., hidden] -> [..., V].

        Deliberately the plain `F.linear` the training forward uses: a oneDNN-packed copy was ~1.5x
        faster at batch 16 but moved SmolLM2's logprobs by up to 3e-4, past the 1e-4 exactness bound.
        (Fusing q/k/v and gate/up into transposed buffers was tried too: no faster at batch 16 here.)
        """
        return self.lm_head(h)

    def decode(self, tokens: Tensor, cache: KVCache, lengths: Tensor) -> Tensor:
        """One decode step for slots 0..B-1: token i goes to position lengths[i]; returns logits [B, V]."""
        b = tokens.shape[0]
        x = self.model.embed_tokens(tokens.unsqueeze(1))
        cos, sin = self.rope(lengths.unsqueeze(1), x.dtype)
        width = int(lengths.max()) + 1
        mask = (torch.arange(width, device=tokens.device) <= lengths.unsqueeze(1)).view(b, 1, 1, width)
        for i, layer in enumerate(self.model.blocks):
            attn = layer.self_attn.decode(
                layer.input_layernorm(x), cos, sin, cache.kv[i, :, :b], lengths, mask
            )
            x = layer.finish(x, attn)
        return self.logits(self.model.norm(x[:, 0]))

    def new_cache(self, max_batch: int, max_len: int) -> KVCache:
        """Allocate a KV cache matching this model's shape, dtype and device."""
        p = self.lm_head.weight
        c = self.config
        return KVCache(
            c.num_hidden_layers, max_batch, c.num_key_value_heads, max_len, c.head_dim, p.dtype, p.device
        )


def _positions_and_mask(
    attention_mask: Tensor | None, b: int, t: int, device: torch.device
) -> tuple[Tensor, Tensor | None]:
    """Positions and SDPA mask for a padded batch; right padding needs only the causal mask."""
    arange = torch.arange(t, device=device)
    if attention_mask is None:
        return arange.expand(b, t), None
    am = attention_mask.to(device=device, dtype=torch.bool)
    lengths = am.sum(-1, keepdim=True)
    if bool((am == (arange < lengths)).all()):  # right padding (or none): plain causal
        return arange.expand(b, t), None
    positions = (am.long().cumsum(-1) - 1).clamp(min=0)
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    # Keys: causal and real; a padding query still sees itself so no row is fully masked (no NaN).
    mask = causal & (am.unsqueeze(1) | torch.eye(t, dtype=torch.bool, device=device))
    return positions, mask.unsqueeze(1)


def num_parameters(model: nn.Module) -> int:
    """Count unique parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def _check_cfg(cfg: LlamaConfig) -> None:
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    if cfg.head_dim % 2 or math.isnan(cfg.rope_theta):
        raise ValueError("head_dim must be even and rope_theta finite")
