"""The dependency floors in pyproject.toml are the versions the code needs: each floor is checked against
what the code calls (torch's SDPA enable_gqa and public fully_shard, transformers' dtype= argument and
Gemma 3), so a floor cannot drift below a feature the code starts using without this test saying so."""

from __future__ import annotations

import inspect
import re
import tomllib
from pathlib import Path

import torch
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
# package -> (the floor the code needs, why)
NEEDED = {
    "torch": ("2.6", "F.scaled_dot_product_attention(enable_gqa=) (2.5) and torch.distributed.fsdp.fully_shard (2.6)"),
    "transformers": ("4.56", "from_pretrained(dtype=) in modeling/loading.py (4.56) and Gemma 3 (4.50)"),
    "safetensors": ("0.4", "safe_open(...).get_slice for lazy and sharded loads"),
}  # fmt: skip


def _floors() -> dict[str, dict[str, Version]]:
    """extra -> package -> the `>=` floor pyproject.toml declares."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out: dict[str, dict[str, Version]] = {}
    for extra, reqs in project["optional-dependencies"].items():
        for req in reqs:
            m = re.fullmatch(r"([A-Za-z0-9_.\-\[\]]+)>=([0-9.]+)", req.split(";")[0].strip())
            if m:
                out.setdefault(extra, {})[m.group(1).lower()] = Version(m.group(2))
    return out


def test_floors_in_pyproject_are_the_versions_the_code_needs() -> None:
    floors = _floors()
    for package, (needed, why) in NEEDED.items():
        declared = [(extra, pkgs[package]) for extra, pkgs in floors.items() if package in pkgs]
        assert declared, f"{package} is declared by no extra"
        for extra, floor in declared:
            assert floor >= Version(needed), (
                f"[{extra}] {package}>={floor} is too low: needs {needed} for {why}"
            )
    assert floors["engine"]["torch"] == floors["train"]["torch"]


def test_the_features_behind_the_floors_are_the_ones_the_code_calls() -> None:
    """What the floors are for is really used (so the reason stays true) and present in this install."""
    src = ROOT / "src" / "harnessrl"
    assert "enable_gqa=True" in (src / "modeling" / "transformer.py").read_text()
    assert "from torch.distributed.fsdp import" in (src / "trainer" / "fsdp.py").read_text()
    assert "dtype=torch.float32" in (src / "modeling" / "loading.py").read_text()
    from torch.distributed.fsdp import fully_shard  # the public path (2.6+)

    assert callable(fully_shard)
    q = torch.zeros(1, 4, 3, 8)
    kv = torch.zeros(1, 2, 3, 8)
    out = torch.nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
    assert out.shape == q.shape
    transformers = __import__("transformers")
    assert "dtype" in inspect.signature(transformers.PreTrainedModel.from_pretrained).parameters or Version(
        transformers.__version__
    ) >= Version("4.56")
    assert Version(torch.__version__.split("+")[0]) >= Version(NEEDED["torch"][0])
