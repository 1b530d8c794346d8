"""`python -m harnessrl.engine`: run the builtin engine server."""

from __future__ import annotations

from harnessrl.engine.server import main

if __name__ == "__main__":
    raise SystemExit(main())
