"""Every log call in src/ speaks one style: `log.info("event=name key=%s", value)` (CONVENTIONS.md).

The scan reads the source with `ast`: a call of `debug`/`info`/`warning`/`error`/`exception`/`critical`
(or `log(level, ...)`) on a name that holds a logger (`log`, `logger`, `logging`, `root`, `self._log`...) must
have a plain string as its message, and that string must start with `event=`.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "harnessrl"
LEVELS = {"debug", "info", "warning", "warn", "error", "exception", "critical", "log"}
LOGGERS = {"log", "logger", "logging", "root"}


def off_style_calls(source: str, filename: str = "<string>") -> list[str]:
    """`file:line: call` for each log call whose message is not a literal starting with `event=`."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in LEVELS:
            continue
        owner = node.func.value
        name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
        if name.lstrip("_").lower() not in LOGGERS:
            continue
        args = node.args[1:] if node.func.attr == "log" else node.args
        message = args[0] if args else None
        if not (
            isinstance(message, ast.Constant)
            and isinstance(message.value, str)
            and message.value.startswith("event=")
        ):
            found.append(f"{filename}:{node.lineno}: {ast.unparse(node)[:120]}")
    return found


def test_the_scan_finds_calls_off_style() -> None:
    source = """
import logging
log = logging.getLogger(__name__)
log.info("event=ok key=%s", 1)
log.info("started key=%s", 1)
logger.warning(f"event=x {y}")
self.log.error("failed")
logging.log(logging.INFO, "event=fine")
logging.log(logging.INFO, "not fine")
catalog.info("not a logger: %s", 1)
"""
    lines = [hit.split(":")[1] for hit in off_style_calls(source)]
    assert lines == ["5", "6", "7", "9"]


def test_every_log_call_in_src_starts_with_event() -> None:
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 50
    found = [hit for f in files for hit in off_style_calls(f.read_text(), str(f.relative_to(SRC.parent)))]
    assert not found, "log calls not in `event=name key=value` style:\n" + "\n".join(found)
