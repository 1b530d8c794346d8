"""Model families (modeling/families.py): for each family a tiny random model with the family's real
config shape and real tokenizer (tests/support/families.py), computed by our model against transformers'
own implementation of the architecture; config.json read the same in both transformers layouts; bf16;
unknown architectures refused with the supported list."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harnessrl.defaults import MODEL_IMPL_ENV
from harnessrl.modeling.families import FAMILIES as ARCHITECTURES
from harnessrl.modeling.families import UnsupportedArchitecture, config_from_hf
from harnessrl.modeling.loading import load_model, read_model_config
from harnessrl.modeling.transformer import SLIDING
from tests.support.families import FAMILIES, family_config, have_tokenizer, hf_model, tiny_family_dir

pytestmark = pytest.mark.skipif(
    not all(have_tokenizer(f) for f in FAMILIES), reason="real tokenizers missing: run make install"
)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("families")


def _ids(vocab: int, rows: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
def test_trainer_logits_equal_transformers(root: Path, family: str) -> None:
    """fp32 logits within 1e-4 of transformers' implementation, padded batch included (left padding
    moves positions; the Gemma 3 window of 16 keys bites in 48-token rows)."""
    d = tiny_family_dir(family, root)
    ours, ref = load_model(d), hf_model(d)
    ids = _ids(ours.config.vocab_size, 2, 48, seed=1)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding on the second row
    with torch.no_grad():
        want = ref(ids).logits
        assert want.std() > 0.5  # far from uniform: a wrong piece would show far above 1e-4
        assert (ours(ids) - want).abs().max().item() < 1e-4
        want_padded = ref(ids, attention_mask=mask).logits[1, 5:]
        got_padded = ours(ids, attention_mask=mask)[1, 5:]
        assert (got_padded - want_padded).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_both_transformers_layouts_read_the_same(root: Path, family: str) -> None:
    """The 4.x config.json (rope_theta, rope_scaling, rope_local_base_freq) as the Hub ships it and the
    5.x one `save_pretrained` wrote (rope_parameters, per layer kind for Gemma 3) give one config."""
    saved = read_model_config(tiny_family_dir(family, root))
    assert config_from_hf(family_config(family)) == saved
    assert saved.architecture == family_config(family)["architectures"][0]
    if family == "gemma3":
        assert saved.layer_types == (SLIDING, "full_attention") and saved.local_rope_theta == 10000.0
        assert saved.rope_theta == 1_000_000.0 and saved.embed_scale == 8.0
    if family.startswith("llama3"):
        assert saved.rope_scaling is not None and saved.rope_scaling.rope_type == "llama3"


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_bf16_follows_fp32(root: Path, family: str) -> None:
    """bf16 weights load and compute: logprobs within bf16 rounding of the fp32 model's."""
    d = tiny_family_dir(family, root)
    full, half = load_model(d), load_model(d, dtype=torch.bfloat16)
    assert half.lm_head.weight.dtype == torch.bfloat16
    ids = _ids(full.config.vocab_size, 1, 24, seed=2)
    with torch.no_grad():
        a = torch.log_softmax(full(ids).float(), -1)
        b = torch.log_softmax(half(ids).float(), -1)
    top = a.topk(5, dim=-1).indices
    assert (a.gather(-1, top) - b.gather(-1, top)).abs().max().item() < 0.5


def test_unknown_architecture_is_refused_with_the_list(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `engine.model_impl: builtin` (auto would take transformers' Mistral: tests/modeling/test_hf_generic.py)."""
    monkeypatch.setenv(MODEL_IMPL_ENV, "builtin")
    config = {**family_config("qwen3"), "architectures": ["MistralForCausalLM"], "model_type": "mistral"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitecture) as err:
        load_model(tmp_path)
    message = str(err.value)
    assert "MistralForCausalLM" in message
    assert all(name in message for name in ARCHITECTURES)
    assert set(ARCHITECTURES) == {
        "LlamaForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Gemma3ForCausalLM",
    }


def test_unsupported_options_name_the_field() -> None:
    with pytest.raises(ValueError, match="use_sliding_window"):
        config_from_hf({**family_config("qwen2_5"), "use_sliding_window": True})
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        config_from_hf({**family_config("gemma3"), "attn_logit_softcapping": 50.0})
    with pytest.raises(ValueError, match="rope_type 'longrope'"):
        config_from_hf({**family_config("llama3"), "rope_scaling": {"rope_type": "longrope", "factor": 2.0}})
