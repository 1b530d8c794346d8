"""Model directories: names, conversion cache, state dict files, the tiny model, the tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from harnessrl.chat import render_chat
from harnessrl.modeling.llama import LlamaForCausalLM
from harnessrl.modeling.loading import (
    default_cache_dir,
    load_model,
    load_state_dict_file,
    load_tokenizer,
    load_weights_into,
    resolve_model,
    smollm2_dir,
)


def test_default_cache_dir_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HARNESSRL_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("HARNESSRL_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "harnessrl"


def test_resolve_model(engine_tiny_dir: Path, tmp_path: Path) -> None:
    assert resolve_model(str(engine_tiny_dir)) == engine_tiny_dir
    with pytest.raises(FileNotFoundError, match="not a model directory"):
        resolve_model(tmp_path)


def test_tiny_dir_has_real_tokenizer_files(engine_tiny_dir: Path) -> None:
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ):
        assert (engine_tiny_dir / name).is_file(), name
    tok = load_tokenizer(engine_tiny_dir)
    assert tok.get_vocab_size() == 49152
    assert tok.token_to_id("<|im_start|>") == 1 and tok.token_to_id("<|im_end|>") == 2


def test_chat_ids_equal_hf_apply_chat_template(engine_tiny_dir: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(engine_tiny_dir))
    tok = load_tokenizer(engine_tiny_dir)
    for messages in (
        [{"role": "user", "content": "What is 2 + 2?"}],
        [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "héllo <b>wörld</b> 🎉"},
            {"role": "assistant", "content": "Hi!\n\nSure."},
            {"role": "user", "content": "  spaces  "},
        ],
    ):
        ref = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ref = ref["input_ids"] if isinstance(ref, dict) or hasattr(ref, "keys") else ref
        ours = tok.encode(render_chat(messages), add_special_tokens=False).ids
        assert ours == list(ref)


def test_state_dict_file_or_dir(
    tmp_path: Path, engine_tiny_dir: Path, engine_tiny_model: LlamaForCausalLM
) -> None:
    from_dir = load_state_dict_file(engine_tiny_dir)
    from_file = load_state_dict_file(engine_tiny_dir / "model.safetensors")
    assert from_dir.keys() == from_file.keys()
    assert "lm_head.weight" not in from_dir  # tied: HF omits it
    with pytest.raises(FileNotFoundError):
        load_state_dict_file(tmp_path)


def test_load_weights_into_rejects_mismatches(tmp_path: Path, engine_tiny_dir: Path) -> None:
    model = load_model(engine_tiny_dir)
    state = load_state_dict_file(engine_tiny_dir)
    with pytest.raises(ValueError, match="missing"):
        load_weights_into(model, {k: v for k, v in state.items() if "norm" not in k})
    bad = dict(state)
    bad["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match="shape"):
        load_weights_into(model, bad)
    shifted = {k: v + 1.0 for k, v in state.items()}
    save_file(shifted, str(tmp_path / "w.safetensors"))
    load_weights_into(model, load_state_dict_file(tmp_path / "w.safetensors"))
    assert torch.equal(model.model.norm.weight, shifted["model.norm.weight"])
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_smollm2_dir_is_converted_once(smollm2_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from harnessrl.modeling import loading

    def no_conversion(out: Path, weights: bool) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(loading, "_convert_smollm2", no_conversion)
    d = smollm2_dir()
    assert resolve_model("smollm2") == d == resolve_model("SmolLM2-135M-Instruct")
    assert (d / "tokenizer.json").is_file() and (d / "config.json").is_file()
