"""`python -m harnessrl.inspection RUN_DIR ...`: the same as `harnessrl inspect RUN_DIR ...`."""

from __future__ import annotations

import sys

from harnessrl.inspection.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
