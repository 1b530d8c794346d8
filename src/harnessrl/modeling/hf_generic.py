"""The second model path: any causal LM transformers implements, trained and served with one arithmetic.

A folder whose config.json names no builtin family (modeling/families.py decides, in `model_impl`) is
loaded with transformers' own class for its `architectures` (`from_pretrained`: its weight conversions,
e.g. an MoE's per-expert tensors fused), and `GenericCausalLM` exposes the text model inside it with the
entry points the builtin `CausalLM` has, so the trainer and the engine's scheduler drive either:

- `hidden_states` / `logits` / `forward`: the training forward (transformers' decoder, then the output
  projection and the family's final soft-cap here, so the trainer's chunked head and the engine's
  sampling take the logprob from the same logits: modeling/logprobs.py);
- `prefill_many` / `decode` / `new_cache`: the engine's, on one transformers cache per sequence
  (modeling/hf_cache.py: KV for attention layers, conv + recurrent state for linear-attention ones).

A conditional-generation folder (Qwen3.5's `Qwen3_5ForConditionalGeneration`, Gemma 4's) is loaded
whole; the trainer sees its text model (`get_decoder()`) and output projection, and a checkpoint writes
the whole model again (`save_pretrained`), its vision weights as they were read, plus any tensors
transformers did not load (Qwen3.5's multi-token-prediction head `mtp.*`), copied unchanged.

State dict names are transformers' in-memory names of the text model (`model.*`, `lm_head.weight`), so
LoRA's merge, `check_state_dict` and the weight copy of the builtin path work unchanged; folders are read
with `read_generic_weights` (transformers' loading, so a folder's on-disk names never matter here).
"""

from __future__ import annotations

import inspect
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from harnessrl.modeling.hf_cache import SlotCaches

log = logging.getLogger(__name__)


@dataclass
class GenericConfig:
    """What the trainer and engine read of a generic model's config (the builtin `ModelConfig`'s names)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    eos_token_id: int | None
    tie_word_embeddings: bool
    final_logit_softcapping: float | None
    hybrid: bool  # some layers keep a recurrent/conv state (no prefix reuse but exact continuation)
    moe: bool
    model_type: str = ""  # the text model's (transformers' `model_type`: `qwen3_5_text`, `gemma4_text`, ...)
    hf_config: dict[str, Any] = field(default_factory=dict)  # the folder's config.json
    source_dir: str | None = None
    rope_scaling: None = None  # RoPE is transformers' business on this path
    impl: str = "transformers"


def text_config_dict(hf: dict[str, Any]) -> dict[str, Any]:
    """The text model's part of a config.json dict (`text_config` of a conditional-generation folder)."""
    text = hf.get("text_config")
    return dict(text) if isinstance(text, dict) else hf


def _first(value: Any) -> int | None:
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def generic_config(hf: dict[str, Any], text: Any, source_dir: str | None) -> GenericConfig:
    """The `GenericConfig` of a config.json dict `hf` whose text model's transformers config is `text`."""
    layer_types = list(getattr(text, "layer_types", None) or [])
    experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    experts = experts or (getattr(text, "enable_moe_block", False) and getattr(text, "num_experts", 0))
    return GenericConfig(
        architecture=str((hf.get("architectures") or [type(text).__name__])[0]),
        vocab_size=int(text.vocab_size),
        hidden_size=int(text.hidden_size),
        num_hidden_layers=int(text.num_hidden_layers),
        num_attention_heads=int(getattr(text, "num_attention_heads", 1)),
        intermediate_size=int(getattr(text, "intermediate_size", 0) or 0),
        max_position_embeddings=int(getattr(text, "max_position_embeddings", 0) or 4096),
        eos_token_id=_first(getattr(text, "eos_token_id", None) or hf.get("eos_token_id")),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", getattr(text, "tie_word_embeddings", False))),
        final_logit_softcapping=getattr(text, "final_logit_softcapping", None),
        hybrid=any(t not in ("full_attention", "sliding_attention") for t in layer_types),
        moe=bool(experts),
        model_type=str(getattr(text, "model_type", "") or ""),
        hf_config=hf,
        source_dir=source_dir,
    )


class GenericCausalLM(nn.Module):
    """The text model of a transformers model with the builtin `CausalLM`'s entry points (see the module
    docstring); parameters are the transformers model's own (one copy)."""

    generic = True
    full: Any  # the whole transformers model (set outside nn.Module's registry)

    def __init__(self, full: nn.Module, config: GenericConfig) -> None:
        super().__init__()
        decoder, head = full.get_decoder(), full.get_output_embeddings()  # type: ignore[operator]
        if not isinstance(head, nn.Linear):
            raise ValueError(f"{config.architecture}: no linear output projection (get_output_embeddings)")
        self.model = decoder
        self.lm_head = head
        self.config = config
        object.__setattr__(self, "full", full)  # the whole model (saving), not a registered submodule
        self.decoder_prefix = next(n for n, m in full.named_modules() if m is decoder) + "."
        params = inspect.signature(decoder.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self.flops = _forward_flops(decoder, config)

    # --- training ---------------------------------------------------------------------------------------

    def hidden_states(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None
    ) -> Tensor:
        """transformers' decoder over `input_ids` [B, T] up to its final norm: [B, T, hidden]. `position_ids`
        [1, T] restarting at 0 mark rows packed back to back (`packing_refusal` says for which models)."""
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
        hidden: Tensor = out.last_hidden_state
        return hidden

    def logits(self, h: Tensor) -> Tensor:
        """Output projection (+ the family's final soft-cap) of hidden states [..., hidden] -> [..., V]."""
        logits: Tensor = self.lm_head(h)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Training forward: logits [B, T, V] for every position."""
        return self.logits(self.hidden_states(input_ids, attention_mask))

    def embed(self, input_ids: Tensor) -> Tensor:
        """The decoder's input embeddings (as transformers computes them, scale included)."""
        emb: Tensor = self.model.get_input_embeddings()(input_ids)  # type: ignore[operator]
        return emb

    # --- serving (modeling/hf_cache.py holds one transformers cache per slot) ---------------------------

    def new_cache(self, max_batch: int, max_len: int) -> SlotCaches:
        """Empty per-slot caches (filled by `prefill_many`)."""
        return SlotCaches(max_batch, max_len, self.config.hybrid)

    def _step(self, tokens: Tensor, cache: Any) -> tuple[Tensor, Any]:
        kwargs = {self._cache_arg: cache}
        out = self.model(input_ids=tokens.unsqueeze(0), use_cache=True, **kwargs)
        new_cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
        return out.last_hidden_state[0, -1], new_cache

    def prefill_many(self, items: list[tuple[Tensor, int, int]], cache: SlotCaches) -> Tensor:
        """Run each `(tokens [T], slot, start)` into its slot's cache (continuing its first `start`
        tokens); returns each sequence's last-position logits [N, V]. One sequence at a time."""
        last = []
        for tokens, slot, start in items:
            if start + tokens.shape[0] > cache.max_len:
                raise ValueError(
                    f"sequence of {start + tokens.shape[0]} tokens exceeds the cache length {cache.max_len}"
                )
            h, cache.caches[slot] = self._step(tokens, cache.continue_from(slot, start))
            last.append(h)
        return self.logits(torch.stack(last))

    def decode(self, tokens: Tensor, cache: SlotCaches, lengths: Tensor) -> Tensor:
        """One decode step for slots 0..B-1 (token i at position lengths[i]); logits [B, V]. The sequences
        run one after another (each on its own cache), see docs/models.md."""
        last = []
        for i in range(tokens.shape[0]):
            h, cache.caches[i] = self._step(tokens[i : i + 1], cache.continue_from(i, int(lengths[i])))
            last.append(h)
        return self.logits(torch.stack(last))


# Text model types whose decoder keeps rows packed back to back apart (`train.pack_rows`): every layer
# mixes tokens only through attention, and the model hands its `position_ids` to transformers' mask
# functions, which turn positions restarting at 0 into a block-diagonal causal (windowed) mask.
# Each is checked against its rows run padded (tests/trainer/test_generic_packing.py).
PACKED_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "qwen3_moe", "gemma3_text", "gemma4_text"})


def packing_refusal(config: GenericConfig) -> str | None:
    """Why rows of this model cannot run packed (`train.pack_rows`), or None where they can."""
    if config.model_type in PACKED_MODEL_TYPES:
        return None
    if config.hybrid:
        return (
            f"model type {config.model_type!r} has linear-attention layers (a causal conv and a recurrent "
            "state over the whole time axis): packed, each row would carry the previous row's state; "
            "transformers keeps packed rows apart there only with the CUDA kernels of "
            "flash-linear-attention and causal-conv1d"
        )
    return (
        f"model type {config.model_type!r} is not one whose packed forward harnessrl has checked "
        f"(those are {', '.join(sorted(PACKED_MODEL_TYPES))})"
    )


def _forward_flops(decoder: nn.Module, config: GenericConfig) -> tuple[int, int]:
    """About the decoder's forward FLOPs per token (2 per weight outside embedding tables; every expert
    of an MoE counted) and per query-key pair attended (q·k and p·v: 4 · head_dim per head and layer):
    what `train.pack_rows: auto` weighs (trainer/packing.py's `use_generic_packing`)."""
    embeddings = {id(p) for m in decoder.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    weights = sum(p.numel() for p in decoder.parameters() if id(p) not in embeddings)
    text = decoder.config  # type: ignore[union-attr]
    head_dim = getattr(text, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * int(weights), 4 * int(head_dim) * config.num_attention_heads * config.num_hidden_layers


def is_generic(model: object) -> bool:
    """True for a model of the transformers path (`GenericCausalLM`)."""
    return bool(getattr(model, "generic", False))


def generic_prefill_chunk(model: object, chunk: int, budget: int) -> int:
    """The engine's prefill chunk: `chunk` for a builtin model; for a generic one a whole prompt at once
    (the scheduler's decode step carries a chunked prompt along with a dummy token, which a recurrent
    state would take in: the generic path never leaves a prompt half prefilled)."""
    return max(chunk, budget) if is_generic(model) else chunk


def _model_class(hf: dict[str, Any]) -> Any:
    """transformers' class for a config.json: the named architecture, else AutoModelForCausalLM."""
    import transformers

    for name in hf.get("architectures") or []:
        cls = getattr(transformers, str(name), None)
        if cls is not None:
            return cls
    return transformers.AutoModelForCausalLM


def load_generic(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> GenericCausalLM:
    """Load a model folder with transformers (its whole model; the text part exposed) in eval mode."""
    d = Path(path)
    hf = json.loads((d / "config.json").read_text())
    full = _model_class(hf).from_pretrained(str(d), dtype=dtype).to(device).eval()
    text = full.get_decoder().config
    model = GenericCausalLM(full, generic_config(hf, text, str(d)))
    log.info("event=generic_model_loaded path=%s class=%s hybrid=%s moe=%s", d, type(full).__name__,
             model.config.hybrid, model.config.moe)  # fmt: skip
    return model.eval()


def full_state(model: GenericCausalLM, state: dict[str, Tensor] | None) -> dict[str, Tensor] | None:
    """`state` (the text model's names) as the whole transformers model's state dict, or None."""
    if state is None:
        return None
    out = dict(model.full.state_dict())
    head = next(n for n, m in model.full.named_modules() if m is model.lm_head) + ".weight"
    for name, tensor in state.items():
        if name == "lm_head.weight":
            out[head] = tensor
        elif name.startswith("model."):
            out[model.decoder_prefix + name.removeprefix("model.")] = tensor
        else:
            raise ValueError(f"{name}: not a tensor of the text model (model.* or lm_head.weight)")
    if model.lm_head.weight is model.model.get_input_embeddings().weight:  # type: ignore[operator]
        out.pop(head, None)  # tied: save_pretrained writes the embedding only
    return out


def save_generic(model: GenericCausalLM, out_dir: str | Path, state: dict[str, Tensor] | None = None) -> Path:
    """Write the whole model as the folder it came from (transformers' `save_pretrained`, its layout),
    with `state` (text model names; a LoRA merge) instead of the text model's own weights if given;
    tensors of the source folder transformers never loaded are copied over unchanged."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.full.save_pretrained(str(out), state_dict=full_state(model, state))
    if model.config.source_dir:
        from harnessrl.modeling.hf_extra import copy_unloaded_tensors

        copy_unloaded_tensors(Path(model.config.source_dir), out)
    return out


def read_generic_weights(model: GenericCausalLM, path: str | Path, base_dir: str | Path) -> dict[str, Tensor]:
    """The text model's state dict (its names) read from a folder of this model (transformers' loading),
    or, for a PEFT adapter folder, the base at `base_dir` with the adapter merged in."""
    from harnessrl.modeling.lora import is_peft_dir, merge_peft_dir

    p = Path(path)
    if is_peft_dir(p):
        base = load_generic(base_dir, dtype=model.lm_head.weight.dtype)
        return merge_peft_dir(_text_state(base), p)
    return _text_state(load_generic(p, dtype=model.lm_head.weight.dtype))


def _text_state(model: GenericCausalLM) -> dict[str, Tensor]:
    return {k: v.detach() for k, v in model.state_dict().items()}
