"""`harnessrl dashboard --run RUN_DIR | --store FILE [--host H] [--port P] [--admin-key KEY]`."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from pathlib import Path

from harnessrl.inspection.runview import RunError

DEFAULT_PORT = 8765
KEY_ENV = "HARNESSRL_DASHBOARD_KEY"


def parser() -> argparse.ArgumentParser:
    """The argument parser of `harnessrl dashboard`."""
    p = argparse.ArgumentParser(
        prog="harnessrl dashboard",
        description="Browse what a run recorded in a web browser: steps with plots, groups and rollouts "
        "with filters, each rollout's calls, tool calls and rows token by token. Read-only; it follows a "
        "run that is still training.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", type=Path, metavar="RUN_DIR", help="the run's directory (e.g. runs/demo)")
    src.add_argument(
        "--store", type=Path, metavar="FILE", help="a store.sqlite file (its folder's run files, if any)"
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    p.add_argument("--admin-key", default=os.environ.get(KEY_ENV),
                   help=f"key every request must carry (default ${KEY_ENV}); required off loopback")  # fmt: skip
    return p


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: list[str]) -> int:
    """Entry point of `harnessrl dashboard`; returns the exit code."""
    try:
        args = parser().parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    if not is_loopback(args.host) and not args.admin_key:
        print(f"harnessrl dashboard: --host {args.host} lets other machines read the run; pass --admin-key KEY "
              f"(or set {KEY_ENV}) to require a key, or keep the default --host 127.0.0.1", file=sys.stderr)  # fmt: skip
        return 2
    import uvicorn

    from harnessrl.dashboard.app import create_dashboard
    from harnessrl.dashboard.data import STORE_FILE, RunData

    try:
        if args.run is not None:
            run_dir = args.run.expanduser().resolve()
            if not run_dir.is_dir():
                raise RunError(
                    f"no run directory at {run_dir}; pass the run_dir of a run (for example runs/demo)"
                )
            data = RunData(run_dir / STORE_FILE, run_dir)
        else:
            data = RunData(args.store.expanduser().resolve())
    except RunError as e:
        print(f"harnessrl dashboard: {e}", file=sys.stderr)
        return 2
    app = create_dashboard(data, args.admin_key)
    shown = "localhost" if args.host in ("127.0.0.1", "::1") else args.host
    key = f"/?key={args.admin_key}" if args.admin_key else "/"
    print(f"harnessrl dashboard: http://{shown}:{args.port}{key}  (Ctrl-C to stop)", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=2)
    return 0
