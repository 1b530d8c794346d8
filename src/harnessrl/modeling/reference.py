"""The frozen reference policy of the KL term: the base under LoRA, else a second copy of the model.

Apart from lora.py so that LoRA (which the loaders use to merge adapters) does not import the loaders.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from harnessrl.modeling.loading import load_model
from harnessrl.modeling.lora import LoraAdapter, base_view
from harnessrl.modeling.upcast import install_upcast, uses_upcast


def reference_model(
    model: nn.Module,
    model_dir: str | Path,
    device: str,
    adapter: LoraAdapter | None,
    dtype: torch.dtype = torch.float32,
) -> Any:
    """The frozen initial policy for the KL term, in the policy's compute `dtype` (`train.dtype`): under
    LoRA the base itself (`base_view`, no copy of the weights), else a second copy loaded from
    `model_dir`."""
    if adapter is not None:
        return base_view(model, adapter)
    ref = load_model(model_dir, dtype=dtype, device=device).requires_grad_(False)
    if uses_upcast(model):  # the policy's bf16 products run in fp32 (modeling/upcast.py): the same values
        install_upcast(ref)
    return ref
