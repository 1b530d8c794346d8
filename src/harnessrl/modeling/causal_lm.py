"""The causal LM of every family (modeling/transformer.py's pieces), with state_dict keys exactly HF's.

Entry points, shared by the trainer and the builtin engine:

- `forward(input_ids, attention_mask)`: full causal forward for training (no cache);
- `prefill_many(items, cache)`: run prompts (or their uncached suffixes) into KV-cache slots;
- `decode(tokens, cache, lengths)`: one batched decode step over cache slots `0..B-1`, each sequence at
  its own length.

Sliding-window layers (Gemma 3) keep every position in the cache like global ones and mask the keys
outside their window, so the cache, batching, chunked prefill and prefix cache work unchanged.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor, nn

from harnessrl.modeling.cache import KVCache
from harnessrl.modeling.rope import rope_frequencies
from harnessrl.modeling.transformer import (
    FULL,
    SLIDING,
    DecoderLayer,
    ModelConfig,
    RMSNorm,
    Rope,
    check_config,
)


class DecoderStack(nn.Module):
    """Embeddings, decoder layers and the final norm (HF's `model.` prefix)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, cfg.kind(i)) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)

    @property
    def blocks(self) -> list[DecoderLayer]:
        """The decoder layers, typed."""
        return cast("list[DecoderLayer]", list(self.layers))


class CausalLM(nn.Module):
    """A decoder-only causal LM with HF-compatible parameter names and cache-aware inference entry points."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        check_config(cfg)
        self.config = cfg
        self.model = DecoderStack(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Kept in fp32 outside the buffers so `.to(dtype)` never rounds them (HF computes RoPE in fp32 too).
        self._rope_tables = {FULL: rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)}
        if SLIDING in cfg.layer_types:
            local = cfg.local_rope_theta or cfg.rope_theta
            self._rope_tables[SLIDING] = rope_frequencies(cfg.head_dim, local, None)

    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Random init as HF does (normal(0, std) linears/embeddings, norms at identity, biases zero)."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(0.0 if self.config.norm_offset else 1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    def rope(self, positions: Tensor, dtype: torch.dtype) -> Rope:
        """cos/sin per layer kind for integer positions [B, T] -> each [B, 1, T, head_dim].

        The one RoPE of the training forward, the engine's prefill and its decode steps alike."""
        out: Rope = {}
        for kind, (inv_freq, mult) in self._rope_tables.items():
            if inv_freq.device != positions.device:
                inv_freq = inv_freq.to(positions.device)
                self._rope_tables[kind] = (inv_freq, mult)
            freqs = positions.float().unsqueeze(-1) * inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos(), emb.sin()
            if mult != 1.0:
                cos, sin = cos * mult, sin * mult
            out[kind] = (cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1))
        return out

    def embed(self, input_ids: Tensor) -> Tensor:
        """Token embeddings, times the family's embedding scale (Gemma: sqrt(hidden), rounded to the dtype)."""
        x = self.model.embed_tokens(input_ids)
        if self.config.embed_scale != 1.0:
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype, device=x.device)
        return x

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Training forward: logits [B, T, V] for every position (causal, no cache)."""
        return self.logits(self.hidden_states(input_ids, attention_mask))

    def hidden_states(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """The training forward up to the final norm: [B, T, hidden] (project slices of it with
        `logits` when [T, V] logits of a long sequence would not fit in memory)."""
        b, t = input_ids.shape
        x = self.embed(input_ids)
        positions, mask = _positions_and_mask(attention_mask, b, t, input_ids.device)
        rope = self.rope(positions, x.dtype)
        for layer in self.model.blocks:
            window = layer.self_attn.window
            layer_mask = mask if mask is None or window is None else mask & _window(positions, window)
            cos, sin = rope[layer.kind]
            x = layer.finish(x, layer.self_attn(layer.input_layernorm(x), cos, sin, layer_mask))
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
        x = self.embed(torch.cat([t for t, _, _ in items]).unsqueeze(0))
        positions = torch.cat([torch.arange(s, s + t.shape[0], device=device) for t, _, s in items])
        rope = self.rope(positions.unsqueeze(0), x.dtype)
        spans = [(t.shape[0], s) for t, _, s in items]
        for i, layer in enumerate(self.model.blocks):
            kvs = [cache.kv[i, :, slot] for _, slot, _ in items]
            cos, sin = rope[layer.kind]
            x = layer.finish(x, layer.self_attn.prefill(layer.input_layernorm(x), cos, sin, kvs, spans))
        ends = torch.tensor(spans, device=device)[:, 0].cumsum(0) - 1
        return self.logits(self.model.norm(x[0, ends]))

    def logits(self, h: Tensor) -> Tensor:
        """The output projection of final hidden states [..., hidden] -> [..., V] (soft-capped if the
        family asks: cap * tanh(logits / cap)).

        Deliberately the plain `F.linear` the training forward uses: a oneDNN-packed copy was ~1.5x
        faster at batch 16 but moved SmolLM2's logprobs by up to 3e-4, past the 1e-4 exactness bound.
        (Fusing q/k/v and gate/up into transposed buffers was tried too: no faster at batch 16 here.)
        """
        return softcap(self.lm_head(h), self.config.final_logit_softcapping)

    def decode(self, tokens: Tensor, cache: KVCache, lengths: Tensor) -> Tensor:
        """One decode step for slots 0..B-1: token i goes to position lengths[i]; returns logits [B, V]."""
        b = tokens.shape[0]
        x = self.embed(tokens.unsqueeze(1))
        rope = self.rope(lengths.unsqueeze(1), x.dtype)
        width = int(lengths.max()) + 1
        mask = (torch.arange(width, device=tokens.device) <= lengths.unsqueeze(1)).view(b, 1, 1, width)
        for i, layer in enumerate(self.model.blocks):
            cos, sin = rope[layer.kind]
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


def softcap(logits: Tensor, cap: float | None) -> Tensor:
    """cap * tanh(logits / cap), or the logits unchanged when `cap` is None."""
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


def _window(positions: Tensor, window: int) -> Tensor:
    """[B, 1, T, T] bool: key j within `window` positions of query i (per row's own positions)."""
    return (positions.unsqueeze(1) > positions.unsqueeze(2) - window).unsqueeze(1)


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
