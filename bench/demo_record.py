"""A demo run's record for bench/results: its summary.json, the per-step figures a precision comparison
reads (reward, engine/trainer gap, TIS ratios, gradient norm, times) from metrics.jsonl, and what the
caller says about how it ran (command, commit, machine).

    python bench/demo_record.py RUN_DIR --bench demo_bf16_sr --commit 8affe2c \
        --command "harnessrl demo train.dtype=bfloat16 ..." --note "..." --out bench/results/demo_bf16_sr.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

PER_STEP = ("step", "reward", "mismatch", "mismatch_max", "tis_ratio_mean", "tis_ratio_max", "grad_norm",
            "clip_frac", "time_update_s", "time_step_s")  # fmt: skip


def record(run_dir: Path) -> dict[str, object]:
    """summary.json and the per-step figures of one finished run."""
    summary_file = run_dir / "summary.json"
    if not summary_file.is_file():
        raise SystemExit(
            f"{summary_file} does not exist: the run has not finished (or this is not a run folder)"
        )
    steps = [
        json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()
    ]
    per_step = [{k: s.get(k) for k in PER_STEP} for s in steps if "reward" in s]
    return {"summary": json.loads(summary_file.read_text()), "per_step": per_step}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--bench", required=True)
    p.add_argument("--commit", required=True)
    p.add_argument("--command", required=True)
    p.add_argument("--note", action="append", default=[], help="key=value, kept as given (repeatable)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    out: dict[str, object] = {"bench": args.bench, "date": datetime.date.today().isoformat(),
                              "commit": args.commit, "command": args.command}  # fmt: skip
    for note in args.note:
        key, sep, value = note.partition("=")
        if not sep:
            raise SystemExit(f"--note {note!r}: expected key=value")
        out[key] = value
    out.update(record(args.run_dir))
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    s = out["summary"]
    assert isinstance(s, dict)
    t1 = s.get("heldout_by_temperature", {}).get("1", {})
    print(f"greedy {s['heldout_reward_before']} -> {s['heldout_reward_after']}; "
          f"T=1 {t1.get('before', {}).get('mean')} -> {t1.get('after', {}).get('mean')}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
