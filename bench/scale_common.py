"""What the scale benchmarks' parts share (`bench/scale_bf16.py`, `bench/scale_load.py`): peak RSS of this
process, a phase run in a fresh process that prints its result as its last JSON line, and writing a result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

NOTE = "measured on a shared 2-core machine with other work running beside it: ratios within this run"


def status_mb(key: str) -> int:
    """A /proc/self/status memory field (VmRSS, VmHWM) in MB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) // 1024


def reset_peak() -> None:
    """VmHWM := VmRSS, so the next peak read is that of what runs from now on."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def run_json(script: str, *args: str) -> dict[str, Any]:
    """Run `python script *args` in a fresh process (this checkout's src first on its path) and return
    the JSON object its last line prints."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    proc = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"{Path(script).name} {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def finish(res: dict[str, Any], out: Path | None) -> int:
    """Stamp a standalone run's result (command, note, load average), write it to `out` and print it."""
    res["command"] = "python " + " ".join(sys.argv)
    res["note"] = NOTE
    res["load_avg_at_end"] = os.getloadavg()
    text = json.dumps(res, indent=2)
    if out is not None:
        out.write_text(text + "\n")
    print(text)
    return 0
