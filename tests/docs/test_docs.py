"""What the docs show runs as shown: every `harnessrl …` command line in README.md and docs/*.md parses
with the real argparse parser of its subcommand, every `import harnessrl…`/`from harnessrl… import …`
imports (names included), every `python -m harnessrl.…` names a module that exists, and every figure of
docs/benchmarks.md and README.md traces to a result file named beside it or is marked as a quote
(`figures.py`)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from harnessrl import cli
from tests.docs.figures import untraced

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PLACEHOLDERS = {"...", "…"}


def _code_lines(page: Path) -> Iterator[tuple[int, str, bool]]:
    """(line number, text, in a fenced block) for each line; a block's `\\`-continued lines joined."""
    in_code, pending, start = False, "", 0
    for i, line in enumerate(page.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            text = line.split(" # ")[0].rstrip() if pending or "harnessrl" in line else line
            if not pending:
                start = i
            if text.endswith("\\"):
                pending += text[:-1] + " "
                continue
            yield start, pending + text, True
            pending = ""
        else:
            for span in re.findall(r"`([^`]+)`", line):
                yield i, span, False


# `harnessrl` as the program of a shell line: after a prompt, variables, `time`/`nice`, a path.
PROGRAM = re.compile(
    r"^(?:\$ )?(?:[A-Z_]+=\S+ )*(?:(?:/usr/bin/)?time(?: -v)? |nice -n \d+ )*(?:\S*/)?harnessrl (\w.*)$"
)


def commands() -> list[tuple[str, str]]:
    """(`page:line`, command line) of every `harnessrl <subcommand> …` the pages show; a bare
    `harnessrl <subcommand>` in running text names the command and is kept as just that."""
    found = []
    for page in PAGES:
        for n, text, block in _code_lines(page):
            for part in re.split(r"&&|;|\|", text) if block else [text]:
                if m := PROGRAM.match(part.strip()):
                    found.append((f"{page.name}:{n}", "harnessrl " + m.group(1).strip()))
    return found


class _Parsed(BaseException):
    """Raised in place of running a subcommand once its arguments parsed."""


class _Refused(BaseException):
    """Raised in place of the SystemExit of a parser that refused the arguments (a subcommand may catch
    SystemExit itself)."""


def _unbracket(argv: list[str]) -> list[str]:
    """A usage line's optional groups (`[--out FILE]`) taken as given: their brackets dropped."""
    out, depth = [], 0
    for a in argv:
        if a.startswith("[") and not a.startswith("[]"):
            depth, a = depth + 1, a[1:]
        if depth and a.endswith("]"):
            depth, a = depth - 1, a[:-1]
        out.append(a)
    return out


def parse(line: str, monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    """Parse a documented command line with the parser its subcommand really uses (never running it)."""
    argv = _unbracket([a for a in shlex.split(line, comments=True)[1:] if a not in PLACEHOLDERS])
    if len(argv) == 1:  # the command's name in running text: it must exist
        choices = cli._parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
        assert argv[0] in (choices or {}), f"no subcommand {argv[0]!r}"
        return argparse.Namespace(command=argv[0])
    if argv[0] not in cli.PASSTHROUGH:
        return cli._parser().parse_args(argv)
    real = argparse.ArgumentParser.parse_args
    seen: list[argparse.Namespace] = []

    def record(
        self: argparse.ArgumentParser, args: object = None, namespace: object = None
    ) -> argparse.Namespace:
        try:
            seen.append(real(self, args, namespace))  # type: ignore[call-overload]
        except SystemExit as e:
            raise _Refused(e.code) from e
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", record)
    module, fn = cli.PASSTHROUGH[argv[0]]
    try:
        getattr(importlib.import_module(module), fn)(argv[1:])
    except _Parsed:
        return seen[0]
    except _Refused as e:
        raise SystemExit(e.args[0]) from e
    raise AssertionError(f"harnessrl {argv[0]} ran without parsing its arguments")


def test_the_docs_show_commands() -> None:
    assert len(commands()) > 40  # the extraction still finds them


def check_overrides(args: argparse.Namespace) -> None:
    """The dotted overrides of a `train`/`check`/`demo` line, applied to the calc example's config: an
    unknown key or a refused value raises ConfigError (placeholder values such as `CONFIG` are skipped)."""
    from harnessrl.config import load_config
    from harnessrl.examples import example_config

    overrides = [
        o for o in getattr(args, "overrides", None) or [] if "=" in o and not re.search(r"=[A-Z_]+$|\$", o)
    ]
    if overrides:
        load_config(example_config("calc"), overrides)


@pytest.mark.parametrize(("where", "line"), commands(), ids=lambda v: str(v)[:60])
def test_each_documented_command_parses(where: str, line: str, monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        args = parse(line, monkeypatch)
    except SystemExit as e:
        pytest.fail(f"{where}: `{line}` does not parse (exit {e.code})")
    check_overrides(args)


@pytest.mark.parametrize(
    "line",
    ["harnessrl train --config c.yaml --bogus", "harnessrl export RUN --format nope", "harnessrl evaluate x",
     "harnessrl inspect"],
)  # fmt: skip
def test_a_wrong_command_line_is_caught(line: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises((SystemExit, AssertionError)):
        parse(line, monkeypatch) if line != "harnessrl inspect" else parse("harnessrl nonsuch", monkeypatch)


def test_a_refused_override_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    from harnessrl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"train\.steps"):
        check_overrides(parse("harnessrl train --config C train.steps=0", monkeypatch))


def _python(page: Path) -> Iterator[tuple[str, str]]:
    """(`page:line`, statement) of each harnessrl import and `python -m harnessrl.…` the page shows."""
    lines = list(_code_lines(page))
    for k, (n, text, _) in enumerate(lines):
        stmt = text.strip()
        if re.match(r"(from harnessrl[\w.]* import |import harnessrl)", stmt):
            while stmt.count("(") > stmt.count(")") and k + 1 < len(lines):
                k += 1
                stmt += " " + lines[k][1].strip()
            yield f"{page.name}:{n}", stmt
        for module in re.findall(r"python3? -m (harnessrl[\w.]*)", text):
            yield f"{page.name}:{n}", f"-m {module}"


def imports() -> list[tuple[str, str]]:
    """Every harnessrl import statement and `-m` module the pages show."""
    return [found for page in PAGES for found in _python(page)]


@pytest.mark.parametrize(("where", "stmt"), imports(), ids=lambda v: str(v)[:60])
def test_each_documented_import_imports(where: str, stmt: str) -> None:
    if stmt.startswith("-m "):
        assert importlib.util.find_spec(stmt[3:]) is not None, f"{where}: no module {stmt[3:]}"
        return
    if stmt.startswith("import "):
        for name in stmt[7:].split(","):
            importlib.import_module(name.split(" as ")[0].strip())
        return
    module, names = re.match(r"from (\S+) import \(?([^)]*)\)?", stmt).groups()  # type: ignore[union-attr]
    mod = importlib.import_module(module)
    for name in (n.split(" as ")[0].strip() for n in names.split(",")):
        if name:
            assert hasattr(mod, name) or importlib.util.find_spec(f"{module}.{name}"), f"{where}: {module} has no {name}"  # fmt: skip


@pytest.mark.parametrize("page", ["docs/benchmarks.md", "README.md"])
def test_every_benchmark_figure_traces_to_a_result_file(page: str) -> None:
    bad = untraced(ROOT / page, ROOT)
    assert not bad, "figures with no result file that holds them (name the file in the section, or quote them with '>'):\n" + "\n".join(bad)  # fmt: skip


def test_the_figure_check_catches_an_untraced_figure(tmp_path: Path) -> None:
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "r.json").write_text('{"peak_rss_mb": 4152.0, "wall_s": 1494.0}')
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n## Traced (`bench/results/r.json`)\n\nPeak 4,152 MiB (4.05 GiB), wall 24 min 54 s.\n\n"
        "## Not traced\n\nPeak 4.15 GB, wall 25 min.\n\n> Quoted from a log: 16 min 18 s.\n"
    )
    bad = untraced(page, tmp_path)
    assert [b.split(" (")[0] for b in bad] == ["page.md:9: '4.15 GB'", "page.md:9: '25 min'"]
