"""Checkpoints that are models: a trainer checkpoint (and `harnessrl export-model`'s copy of it) is a
complete HF folder that transformers loads as it is, with logits equal to the trainer's within 1e-4, and
its tokenizer + chat template; the optimizer state lies apart and resume restores it. A SmolLM2-shaped
tiny Llama and a Qwen3 tiny model (real tokenizers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harnessrl.cli import main as cli_main
from harnessrl.modeling.causal_lm import CausalLM
from harnessrl.modeling.loading import load_model, make_tiny_model_dir
from harnessrl.trainer.checkpoint import TRAINING_STATE, load_checkpoint, save_checkpoint
from harnessrl.trainer.export_model import export_model
from tests.support.families import have_tokenizer, hf_model, tiny_family_dir

MODEL_FILES = {
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
}


@pytest.fixture(scope="module", params=["smollm2", "qwen3"])
def base_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ckpt-models")
    if request.param == "smollm2":
        return make_tiny_model_dir(root / "smollm2-tiny")
    if not have_tokenizer("qwen3"):
        pytest.skip("real Qwen3 tokenizer missing: run make install")
    return tiny_family_dir("qwen3", root)


def _trained(base_dir: Path) -> tuple[CausalLM, torch.optim.Optimizer]:
    """The base model after one AdamW step on a next-token loss (weights moved off the base folder's)."""
    model = load_model(base_dir).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(3, 1000, (1, 16), generator=torch.Generator().manual_seed(0))
    logits = model(ids)
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
    loss.backward()
    opt.step()
    return model.eval(), opt


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (2, 32), generator=torch.Generator().manual_seed(1))


def test_checkpoint_is_a_model_transformers_loads(base_dir: Path, tmp_path: Path) -> None:
    model, opt = _trained(base_dir)
    ckpt = save_checkpoint(tmp_path / "checkpoints", 1, model, opt, {"note": "x"})
    assert {p.name for p in ckpt.iterdir()} >= MODEL_FILES
    assert (ckpt / TRAINING_STATE).is_file() and not (ckpt / "optimizer.pt").exists()
    ids = _ids(model.config.vocab_size)
    with torch.no_grad():
        want = model(ids)
        got = hf_model(ckpt)(ids).logits
        assert (got - want).abs().max().item() < 1e-4
        base = load_model(base_dir)(ids)
        assert (base - want).abs().max().item() > 1e-3  # the checkpoint holds the trained weights
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpt))
    messages = [{"role": "user", "content": "2+2?"}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert json.loads((ckpt / "generation_config.json").read_text())["eos_token_id"] is not None


def test_resume_restores_weights_and_optimizer(base_dir: Path, tmp_path: Path) -> None:
    model, opt = _trained(base_dir)
    ckpt = save_checkpoint(tmp_path / "checkpoints", 1, model, opt, {"next_group": 4})
    fresh = load_model(base_dir).train()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    state = load_checkpoint(ckpt, fresh, fresh_opt)
    assert state == {"step": 1, "next_group": 4}
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    saved, loaded = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert saved.keys() == loaded.keys() and all(
        torch.equal(saved[k]["exp_avg"], loaded[k]["exp_avg"]) for k in saved
    )


def test_export_model_writes_only_the_model(base_dir: Path, tmp_path: Path) -> None:
    model, opt = _trained(base_dir)
    run_dir = tmp_path / "run"
    save_checkpoint(run_dir / "checkpoints", 1, model, opt, {})
    save_checkpoint(run_dir / "checkpoints", 2, model, opt, {})
    out = tmp_path / "exported"
    assert cli_main(["export-model", str(run_dir), "--step", "1", "--out", str(out)]) == 0
    assert {p.name for p in out.iterdir()} == MODEL_FILES | {
        p.name for p in base_dir.glob("chat_template.jinja")
    }
    ids = _ids(model.config.vocab_size)
    with torch.no_grad():
        assert (hf_model(out)(ids).logits - model(ids)).abs().max().item() < 1e-4
        assert torch.equal(load_model(out)(ids), model(ids))  # and harnessrl reads it back as it wrote it
    assert export_model(run_dir, tmp_path / "newest") == tmp_path / "newest"


def test_export_model_errors_name_the_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["export-model", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "holds no checkpoint" in capsys.readouterr().err
    (tmp_path / "checkpoints" / "step-3").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-3" / "config.json").write_text("{}")
    assert cli_main(["export-model", str(tmp_path), "--step", "7", "--out", str(tmp_path / "o")]) == 2
    assert "kept: ['step-3']" in capsys.readouterr().err
