"""`make bench`: the engine benchmark without baselines that need building (`make bench-engine` and
`make bench-gateway` run the full comparisons); prints a table and writes bench/results/engine_quick.json."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHES = ["engine.py"]


def main() -> int:
    """Run each benchmark script with this interpreter; stop at the first failure."""
    here = Path(__file__).parent
    for name in BENCHES:
        print(f"== {name}", flush=True)
        rc = subprocess.call(
            [sys.executable, str(here / name), "--out", str(here / "results" / "engine_quick.json")]
        )
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
