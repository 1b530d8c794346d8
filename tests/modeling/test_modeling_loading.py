"""Model directories: names, conversion cache, state dict files, the tiny model, the tokenizer."""

from __future__ import annotations

import json
import shutil
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
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "harnessrl"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")  # not absolute: ignored, as the XDG spec says
    assert default_cache_dir() == Path.home() / ".cache" / "harnessrl"
    monkeypatch.delenv("XDG_CACHE_HOME")
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


def _sharded_copy(src: Path, out: Path, extra: dict[str, torch.Tensor]) -> Path:
    """`src`'s weights as 2 shards + model.safetensors.index.json (as transformers writes a big model),
    with `extra` tensors added to the second shard."""
    out.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copyfile(f, out / f.name)
    state = load_state_dict_file(src)
    names = sorted(state)
    parts = [names[: len(names) // 2], names[len(names) // 2 :]]
    weight_map = {}
    for i, part in enumerate(parts):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        tensors = {n: state[n] for n in part} | (extra if i else {})
        save_file(tensors, str(out / file))
        weight_map.update(dict.fromkeys(tensors, file))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def test_sharded_folder_loads_by_its_index_into_the_target_dtype(
    tmp_path: Path, engine_tiny_dir: Path
) -> None:
    """A folder of shards is read through its index, tensor by tensor, straight into the dtype asked;
    a RoPE inv_freq buffer some exporters write is skipped by name; a stray shard the index does not name
    is not read, a tensor the model lacks is refused."""
    inv = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}
    sharded = _sharded_copy(engine_tiny_dir, tmp_path / "sharded", inv)
    save_file(
        {"junk.weight": torch.ones(2)}, str(sharded / "model-99999-of-99999.safetensors")
    )  # not indexed
    want = load_model(engine_tiny_dir)
    got = load_model(sharded, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in got.parameters())
    for (name, a), b in zip(want.state_dict().items(), got.state_dict().values(), strict=True):
        assert torch.equal(a.to(torch.bfloat16), b), name
    assert got.lm_head.weight is got.model.embed_tokens.weight
    assert "model.layers.0.self_attn.rotary_emb.inv_freq" not in load_state_dict_file(sharded)
    bad = _sharded_copy(engine_tiny_dir, tmp_path / "bad", {"model.layers.0.mlp.extra.weight": torch.ones(2)})
    with pytest.raises(ValueError, match=r"unexpected=\['model\.layers\.0\.mlp\.extra\.weight'\]"):
        load_model(bad)
    (bad / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002"):
        load_model(bad)
