"""The trainer's forward for a transformers-path model (modeling/hf_generic.py).

Each micro-batch runs transformers' decoder over its right-padded rows whole (no shared-prefix split:
that needs the layers' internals, which differ per architecture), then the SAME chunked head as the
builtin path (`head_logprobs`: projection, the family's soft-cap, `tempered_log_softmax`) at the selected
positions only. Right padding needs no attention mask: every layer is causal (attention and the linear-
attention recurrences alike), so padding after a row's last token never reaches its selected positions.
`checkpoint_layers` turns on transformers' own gradient checkpointing of the decoder layers.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from harnessrl.trainer.forward import Selected, head_logprobs


def generic_selected_logprobs(
    model: Any,
    tokens: Tensor,
    select: Tensor,
    temps: Tensor,
    entropy: bool = False,
    checkpoint_layers: bool | None = None,
) -> Selected:
    """Logprobs of tokens[b, t+1] for every (b, t) with select[b, t], through transformers' forward."""
    decoder = model.model
    wants = bool(checkpoint_layers) and decoder.training
    if wants != bool(getattr(decoder, "is_gradient_checkpointing", False)):
        if wants:
            decoder.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            decoder.gradient_checkpointing_disable()
    hidden = model.hidden_states(tokens)
    row, pos = select.nonzero(as_tuple=True)
    cap = model.config.final_logit_softcapping
    lp, ent = head_logprobs(model.lm_head, hidden[row, pos], tokens[row, pos + 1], temps[row], entropy, cap)
    return Selected(lp, row, pos, ent)
