"""`harnessrl inspect RUN_DIR [--rollout ID] [--step N] [--eval] [--limit N] [--tokens] [--json]`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rich.console import Console

from harnessrl.inspection.index_file import write_rollout_index
from harnessrl.inspection.render import render_index, render_rollout
from harnessrl.inspection.report import index_report, rollout_report
from harnessrl.inspection.runview import RunError

DEFAULT_LIMIT = 200

DESCRIPTION = """Read what a run recorded. Without --rollout: the index of rollouts per step (task, group,
reward, advantage, attempts, calls, rows, merge breaks by cause). With --rollout ID: that rollout's calls
(status, finish reason, weight version, token counts, decoded completion, tool calls) and rows (decoded
tokens marked by loss mask, with logprobs). Rows are recomputed from the stored calls by the adapter."""


def parser() -> argparse.ArgumentParser:
    """The argument parser of `harnessrl inspect`."""
    p = argparse.ArgumentParser(prog="harnessrl inspect", description=DESCRIPTION)
    p.add_argument("run_dir", type=Path, help="the run's directory (its run_dir, e.g. runs/demo)")
    p.add_argument("--rollout", metavar="ID", help="show one rollout (its id, client id, or a unique prefix)")
    p.add_argument(
        "--step", type=int, metavar="N", help="only the rollouts of step N (numbered as in metrics.jsonl)"
    )
    p.add_argument(
        "--eval", action="store_true", help="held-out evaluation rollouts instead of training ones"
    )
    p.add_argument(
        "--limit", type=int, default=None, metavar="N",
        help=f"show at most N rollouts in the index (default {DEFAULT_LIMIT}; 0: all; with --json: all)",
    )  # fmt: skip
    p.add_argument("--tokens", action="store_true", help="with --rollout: also a line per token of each row")
    p.add_argument(
        "--tokenizer", type=Path, metavar="PATH", help="tokenizer.json (or its folder) to decode with"
    )
    p.add_argument("--write-index", action="store_true", help="(re)write RUN_DIR/rollouts/index.tsv and exit")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of tables")
    return p


def _error(message: str) -> int:
    print(f"harnessrl inspect: {message}", file=sys.stderr)
    return 2


def main(argv: list[str]) -> int:
    """Entry point of `harnessrl inspect`; returns the exit code (2 for a bad run dir or rollout id)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        args = parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2, message already printed)
        return int(e.code or 0)
    if args.limit is not None and args.limit < 0:
        return _error(f"--limit must be 0 (all) or more, not {args.limit}")
    run_dir: Path = args.run_dir.expanduser().resolve()
    try:
        if args.write_index:
            print(write_rollout_index(run_dir))
            return 0
        if args.rollout is not None:
            report = rollout_report(run_dir, args.rollout, args.tokenizer)
        else:
            limit = args.limit if args.limit is not None else (0 if args.json else DEFAULT_LIMIT)
            report = index_report(run_dir, args.step, args.eval, limit or None)
    except RunError as e:
        return _error(str(e))
    if args.json:
        print(json.dumps(report, allow_nan=False, ensure_ascii=False))
        return 0
    console = Console(highlight=False)
    if args.rollout is not None:
        render_rollout(console, report, tokens=args.tokens)
    else:
        render_index(console, report)
    return 0
