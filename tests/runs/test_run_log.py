"""A run logs to `<run_dir>/harnessrl.log` through the `harnessrl` logger only: the logging of a program
that embeds a run (a notebook, a script with its own handlers) is left as it was."""

from __future__ import annotations

import logging
from pathlib import Path

from harnessrl.runs.flow import run_log


def test_a_run_logs_to_its_file_and_leaves_the_callers_logging_alone(tmp_path: Path) -> None:
    root = logging.getLogger()
    mine = logging.StreamHandler()
    root.addHandler(mine)
    before_root = list(root.handlers)
    before_level = root.level
    pkg = logging.getLogger("harnessrl")
    pkg_handlers = list(pkg.handlers)
    try:
        with run_log(tmp_path / "run"):
            logging.getLogger("harnessrl.runs.flow").info("event=probe value=%d", 7)
            assert root.handlers == before_root  # the caller's handlers: the same objects, none added
        assert root.handlers == before_root and root.level == before_level
        assert pkg.handlers == pkg_handlers  # the run's file handler is gone after the run
        text = (tmp_path / "run" / "harnessrl.log").read_text()
        assert "harnessrl.runs.flow event=probe value=7" in text
    finally:
        root.removeHandler(mine)
