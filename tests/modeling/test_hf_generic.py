"""The transformers path (modeling/hf_generic.py) on tiny random folders transformers drew and saved:
which path a folder takes, the trainer's logprobs against transformers' own forward, the engine's
cached prefill/decode against the trainer's, and checkpoints written in the layout the user brought."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from harnessrl.modeling.families import UnsupportedArchitecture, model_impl
from harnessrl.modeling.hf_cache import SlotCaches
from harnessrl.modeling.hf_generic import GenericCausalLM, is_generic
from harnessrl.modeling.loading import load_model, read_weights, save_model
from harnessrl.trainer.forward import selected_logprobs
from tests.support.families import family_config
from tests.support.generic_families import GENERIC, generic_dir

pytest.importorskip("transformers")
BOUND = 1e-4


def test_the_path_is_chosen_from_config_json_and_can_be_forced() -> None:
    qwen3 = family_config("qwen3")
    assert model_impl(qwen3) == "builtin"
    assert model_impl(qwen3, "transformers") == "transformers"  # a builtin family through transformers
    qwen35 = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5"}
    assert model_impl(qwen35) == "transformers"
    with pytest.raises(UnsupportedArchitecture, match="supported: LlamaForCausalLM"):
        model_impl(qwen35, "builtin")
    unknown = {"architectures": ["NoSuchForCausalLM"], "model_type": "no_such"}
    with pytest.raises(UnsupportedArchitecture, match="nor does the installed transformers implement"):
        model_impl(unknown)
    with pytest.raises(ValueError, match="not implemented by the installed transformers"):
        model_impl(unknown, "transformers")
    with pytest.raises(ValueError, match=r"engine\.model_impl must be one of"):
        model_impl(qwen3, "fast")


def _tokens(seed: int, n: int, rows: int = 2) -> torch.Tensor:
    return torch.randint(3, 20000, (rows, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(GENERIC))
def test_trainer_matches_transformers_and_engine_matches_trainer(name: str) -> None:
    model = load_model(generic_dir(name))
    assert is_generic(model) and isinstance(model, GenericCausalLM)
    ids = _tokens(1, 24)
    with torch.no_grad():
        trainer = selected_logprobs(model, ids, torch.ones(2, 23, dtype=torch.bool), torch.ones(2), 0)
        own = model.full(input_ids=ids).logits.log_softmax(-1)[:, :-1]  # transformers' whole model
    ref = own.gather(-1, ids[:, 1:, None])[..., 0]
    assert float((trainer.logprobs.view(2, 23) - ref).abs().max()) <= BOUND
    # the engine: row 0 prefilled in two pieces (a continued cache), row 1 whole, then batched decodes
    cache = model.new_cache(2, 64)
    served = []
    with torch.no_grad():
        model.prefill_many([(ids[0, :7], 0, 0)], cache)
        logits = model.prefill_many([(ids[0, 7:12], 0, 7), (ids[1, :12], 1, 0)], cache)
        for t in range(12, 23):
            served.append(logits.log_softmax(-1).gather(-1, ids[:, t, None])[:, 0])
            logits = model.decode(ids[:, t], cache, torch.tensor([t, t]))
    gap = (torch.stack(served, 1) - trainer.logprobs.view(2, 23)[:, 11:22]).abs().max()
    assert float(gap) <= BOUND
    assert cache.nbytes > 0


def test_a_hybrid_cache_is_reused_only_whole() -> None:
    model = load_model(generic_dir("qwen3_5"))
    assert model.config.hybrid
    cache = model.new_cache(2, 64)
    ids = _tokens(2, 10, rows=1)[0]
    with torch.no_grad():
        model.prefill_many([(ids, 0, 0)], cache)
    assert cache.reusable_prefix(0, 10, 10) == 10  # the next prompt extends every held token
    assert cache.reusable_prefix(0, 6, 10) == 0  # a recurrent state cannot be cut back to 6 tokens
    with pytest.raises(RuntimeError, match="cannot continue from 6"):
        cache.continue_from(0, 6)
    attention_only = SlotCaches(1, 64, hybrid=False)
    assert attention_only.reusable_prefix(0, 6, 10) == 0  # nothing held


def _keys(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as s:
            out.update({k: s.get_tensor(k) for k in s.keys()})  # noqa: SIM118
    return out


def test_a_conditional_generation_folder_comes_back_whole(tmp_path: Path) -> None:
    """Qwen3.5's layout: the text model trains, the vision tower and an `mtp.*` head transformers does
    not load are written back unchanged; transformers loads the result as the same class."""
    from transformers import AutoConfig

    src = tmp_path / "src"
    original = generic_dir("qwen3_5_vl")
    src.mkdir()
    for f in original.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    save_file({"mtp.fc.weight": torch.randn(4, 8)}, str(src / "model-mtp.safetensors"))
    model = load_model(src)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["model.norm.weight"] = state["model.norm.weight"] + 1.0  # a trained text weight
    out = save_model(model, tmp_path / "out", state)
    assert AutoConfig.from_pretrained(str(out)).architectures == ["Qwen3_5ForConditionalGeneration"]
    before, after = _keys(src), _keys(out)
    assert set(after) == set(before)
    for k, v in before.items():
        changed = k == "model.language_model.norm.weight"
        assert torch.equal(after[k], v + 1.0 if changed else v), k
    again = load_model(out)
    assert torch.equal(read_weights(again, out)["model.norm.weight"], state["model.norm.weight"])
    assert json.loads((out / "config.json").read_text())["text_config"]["model_type"] == "qwen3_5_text"


def test_an_moe_folder_keeps_its_per_expert_layout(tmp_path: Path) -> None:
    model = load_model(generic_dir("qwen3_moe"))
    assert model.config.moe and any("experts" in k for k in model.state_dict())
    out = save_model(model, tmp_path / "out")
    assert set(_keys(out)) == set(_keys(generic_dir("qwen3_moe")))  # per-expert tensors, as brought
    back = read_weights(model, out)
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())
