"""A tiny random Qwen3.5 through the calc example on this CPU, with the CLI a user runs (issue 47).

The folder is drawn by transformers itself (`Qwen3_5ForCausalLM`, 3 Gated DeltaNet layers + 1 full
attention layer, hidden 64, random weights; tests/support/generic_families.py) with the real Qwen3
tokenizer, then:

1. `harnessrl check`: one graded attempt of the calc harness through engine + gateway;
2. `harnessrl train`: held-out eval, a few RL steps, held-out eval again (summary.json);
3. `harnessrl export-model`: the last checkpoint as an HF folder, loaded back by transformers;
4. `harnessrl eval` on that folder.

A random model answers nothing right, so the rewards are ~0: what this shows is that the loop runs on
the transformers path (exact token IDs, the update, the checkpoint, the export, the eval) and what each
part costs here.

    PYTHONPATH=src:. python bench/generic_calc.py [--steps 3] [--out bench/results/generic_calc.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.support.generic_families import generic_family_dir

from harnessrl.examples import get_example

SMALL = [
    "engine.max_batch=8", "engine.max_model_len=2048", "engine.threads=1", "controller.concurrency=8",
    "gateway.default_max_tokens=32", "eval.extra_temperatures=[]", "data.n_train=32",
]  # fmt: skip


def cli(args: list[str], log: Path) -> dict[str, Any]:
    """Run `harnessrl ARGS` (this interpreter), its output into `log`; the command, rc and seconds."""
    cmd = [sys.executable, "-m", "harnessrl.cli", *args]
    t0 = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False).returncode
    seconds = time.perf_counter() - t0
    shown = " ".join(["harnessrl", *args])
    print(f"rc={rc} {seconds:.1f}s  {shown}")
    if rc != 0:
        raise SystemExit(f"{shown} failed (rc {rc}); see {log}")
    return {"command": shown, "rc": rc, "seconds": round(seconds, 1)}


def loads_in_transformers(folder: Path) -> str:
    """The class transformers loads the exported folder as."""
    import torch
    from transformers import AutoModelForCausalLM

    return type(AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)).__name__


def main() -> None:
    """Draw the folder, run the four commands, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--heldout", type=int, default=8)
    parser.add_argument("--work", type=Path, default=None, help="folder for the model, run and logs")
    parser.add_argument("--out", type=Path, default=Path("bench/results/generic_calc.json"))
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-generic-calc-"))
    work.mkdir(parents=True, exist_ok=True)
    model = generic_family_dir("qwen3_5", work)
    config = str(get_example("calc").config_path)
    common = [*SMALL, f"engine.model={model}", f"eval.n_heldout={args.heldout}"]
    run_dir, export = work / "run", work / "export"
    train = [f"run_dir={run_dir}", f"train.steps={args.steps}", "train.batch_groups=2", "train.group_size=4",
             f"train.checkpoint_every={args.steps}", "train.lr=1e-3"]  # fmt: skip
    started = time.time()
    commands = {
        "check": cli(["check", "--config", config, *common], work / "check.log"),
        "train": cli(["train", "--config", config, "--fresh", *common, *train], work / "train.log"),
        "export_model": cli(["export-model", str(run_dir), "--out", str(export)], work / "export.log"),
    }
    exported_class = loads_in_transformers(export)
    eval_json = work / "eval.json"
    commands["eval"] = cli(["eval", "--config", config, "--model", str(export), "--out", str(eval_json),
                            *common], work / "eval.log")  # fmt: skip
    summary = json.loads((run_dir / "summary.json").read_text())
    keep = ("heldout_reward_before", "heldout_reward_after", "heldout_ci95_before", "heldout_ci95_after",
            "train_steps", "train_wall_seconds", "wall_seconds")  # fmt: skip
    result = {
        "model": "tiny random Qwen3_5ForCausalLM (tests/support/generic_families.py, seed 0), Qwen3 tokenizer",
        "commands": commands,
        "train_summary": {k: summary.get(k) for k in keep},
        "steps": [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()],
        "exported_class": exported_class,
        "exported_files": sorted(p.name for p in export.iterdir()),
        "eval": json.loads(eval_json.read_text()),
        "wall_seconds": round(time.time() - started, 1),
        "machine": {"cpus": os.cpu_count(), "load_avg_1m_end": os.getloadavg()[0]},
        "command": "PYTHONPATH=src:. python bench/generic_calc.py " + " ".join(sys.argv[1:]),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
