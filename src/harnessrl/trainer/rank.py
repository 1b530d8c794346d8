"""`python -m harnessrl.trainer.rank`: the command a trainer rank runs. Started by `DataParallel`
(`--rank r --spec JSON`), or by torchrun: then rank 0 runs `harnessrl <args>` (the run itself, e.g.
`train --config run.yaml train.world_size=2 train.parallel=fsdp`) and the other ranks join by the
environment and serve (harnessrl.trainer.distributed). An entry point only: nothing imports it."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from harnessrl.trainer import launch
from harnessrl.trainer.distributed import JOIN_TIMEOUT_S, serve_from_env, worker


def main(argv: list[str] | None = None) -> int:
    """Entry point of a worker rank: started by `DataParallel` (--rank, --spec) or by torchrun (rank 0
    runs `harnessrl <args>`, e.g. `train --config run.yaml ...`; the other ranks serve)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    by_env = launch.launched_by_env() and "--rank" not in argv
    if by_env and int(os.environ["RANK"]) == 0:  # the run itself (its own logging)
        from harnessrl.cli import main as cli_main

        return cli_main(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if by_env:
        serve_from_env()
        return 0
    p = argparse.ArgumentParser(prog="python -m harnessrl.trainer.rank")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--spec", required=True, help="JSON settings from rank 0")
    args = p.parse_args(argv)
    spec = json.loads(args.spec)
    launch.join(spec["init"], args.rank, int(spec["world_size"]), JOIN_TIMEOUT_S)
    worker(args.rank, spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
