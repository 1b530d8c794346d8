"""`harnessrl doctor` through the real command (a subprocess), and its findings when a piece is missing
(a PATH without bubblewrap or Chromium, as on a bare machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harnessrl.runs import doctor

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _doctor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {**os.environ, "PYTHONPATH": SRC, **(env or {})}
    return subprocess.run([sys.executable, "-m", "harnessrl.cli", "doctor", *args], env=base,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_doctor_reports_every_piece() -> None:
    proc = _doctor("--json")
    assert proc.returncode == 0, proc.stderr
    found = {f["name"]: f for f in json.loads(proc.stdout)}
    assert list(found) == ["python", "torch", "model paths", "SmolLM2 weights", "openai SDK", "bubblewrap",
                           "Chromium", "free memory", "cores"]  # fmt: skip
    import transformers

    assert f"transformers {transformers.__version__} implements" in found["model paths"]["found"]
    assert sys.version.split()[0] in found["python"]["found"] and found["python"]["ok"]
    import torch

    assert torch.__version__ in found["torch"]["found"]
    assert ("CPU build" in found["torch"]["found"]) == (torch.version.cuda is None and not getattr(torch.version, "hip", None))  # fmt: skip
    assert found["cores"]["found"] == f"{len(os.sched_getaffinity(0))} usable"
    text = _doctor().stdout
    assert all(name in text for name in found)


def test_a_missing_piece_says_what_it_disables(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no chromium, no chromedriver, no bwrap on PATH
    chromium = doctor.check_chromium()
    assert chromium.found is None and not chromium.ok
    report = doctor.render([chromium])
    assert (
        report.startswith("MISSING") and "dashboard's browser test" in report and "apt-get install" in report
    )
    monkeypatch.setattr(doctor, "memory_available_gib", lambda: 1.0)
    memory = next(f for f in doctor.check_resources() if f.name == "free memory")
    assert not memory.ok and "SHORT" in doctor.render([memory]) and "1.0 GiB" in memory.found  # type: ignore[operator]


def test_memory_matches_proc_meminfo() -> None:
    lines = Path("/proc/meminfo").read_text().splitlines()
    kib = next(int(line.split()[1]) for line in lines if line.startswith("MemAvailable:"))
    got = doctor.memory_available_gib()
    assert got is not None and abs(got - kib / 2**20) < 0.5  # read a moment apart
