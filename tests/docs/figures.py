"""Tracing the figures of a Markdown page to result files (used by test_docs.py).

A *figure* is a number with a unit (`4.15 GB`, `318.3 tok/s`, `24 min 54 s`, `2.14×`, `87%`). A figure
traces when a result file named in its section (a `bench/results/...` or `docs/img/...json` path
anywhere from the page's top through its own heading's section, parents included) holds that value,
in that unit or a unit it converts to (GB ↔ MB, kB, bytes; s ↔ ms, min; % ↔ a fraction), equal up to
the rounding of the figure as written. A figure in a quote block (a line starting with `>`) is a quote
from elsewhere and is not traced: the quote says where from.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

NUMBER = r"(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?"
DURATION = re.compile(r"(?:(\d+) h )?(\d+) min (\d+) s\b|(\d+) h (\d+) min\b")
FIGURE = re.compile(NUMBER + r"\s?(ms|min|s|h|GB/s|GB|MB|kB|KB|GiB|MiB|KiB|tok/s|req/s|%|×)(?![\w/])")
SCALE = {  # unit -> the factors by which a value in that unit may be written in a file
    "ms": (1.0, 1e-3),
    "s": (1.0, 1e3),
    "min": (1.0, 60.0),
    "h": (1.0, 3600.0, 60.0),
    "GB": (1.0, 1e3, 1e6, 1e9, 1e9 / 2**20, 1e9 / 2**30),
    "GB/s": (1.0, 1e3, 1e9),
    "MB": (1.0, 1e-3, 1e3, 1e6, 1e6 / 2**20),
    "kB": (1.0, 1e-3, 1e3, 1e-6),
    "KB": (1.0, 1e-3, 1e3, 1e-6),
    "GiB": (1.0, 1024.0, 2.0**20, 2.0**30),
    "MiB": (1.0, 1024.0, 2.0**20, 1 / 1024),
    "KiB": (1.0, 1024.0, 1 / 1024),
    "tok/s": (1.0,),
    "req/s": (1.0,),
    "%": (1.0, 0.01),
    "×": (1.0,),
}
RESULT = re.compile(r"(?:bench/results|docs/img)/[A-Za-z0-9_./-]+\.jsonl?")


@dataclass(frozen=True)
class Figure:
    """A number with a unit as written on a page, where, and the files its section names."""

    text: str
    value: float
    unit: str
    half_step: float  # half of the last written digit: the rounding allowance
    line: int
    files: tuple[str, ...]
    quoted: bool


def numbers_in(path: Path) -> list[float]:
    """Every number a result file holds: JSON numbers, and numbers written inside its strings."""
    text = path.read_text()
    found: list[float] = []
    rows = [text] if path.suffix == ".json" else text.splitlines()

    def walk(v: object) -> None:
        if isinstance(v, bool):
            return
        if isinstance(v, int | float):
            found.append(float(v))
        elif isinstance(v, str):
            found.extend(float(m.replace(",", "")) for m in re.findall(r"-?\d[\d,]*\.?\d*(?:e-?\d+)?", v) if m.replace(",", "").rstrip(".").replace(".", "", 1).lstrip("-").isdigit())  # fmt: skip
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(k)
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)

    for row in rows:
        try:
            walk(json.loads(row))
        except ValueError:
            walk(row)
    return found


def figures(page: Path) -> Iterator[Figure]:
    """The figures of a Markdown page with the result files their sections name (code blocks skipped)."""
    lines = page.read_text().splitlines()
    named: list[set[str]] = [set() for _ in range(7)]  # files named per heading level, 0 = page top
    sections: list[tuple[int, int]] = []  # (line index, heading level)
    for i, line in enumerate(lines):
        if m := re.match(r"(#{1,6}) ", line):
            sections.append((i, len(m.group(1))))
    level_of = {i: lvl for i, lvl in sections}
    bounds = [i for i, _ in sections] + [len(lines)]
    in_code = False
    starts = [0] + [i for i, _ in sections]
    for s, start in enumerate(starts):
        end = bounds[s] if s < len(bounds) else len(lines)
        if start in level_of:
            lvl = level_of[start]
            for deeper in range(lvl, 7):
                named[deeper] = set()
        else:
            lvl = 0
        body = lines[start:end]
        named[lvl] = set(RESULT.findall("\n".join(body)))
        files = tuple(sorted(set().union(*named[: lvl + 1])))
        for j, line in enumerate(body, start):
            if line.startswith("```"):
                in_code = not in_code
            if in_code or line.startswith("#"):
                continue
            yield from _line_figures(line, j + 1, files)


def _line_figures(line: str, number: int, files: tuple[str, ...]) -> Iterator[Figure]:
    quoted = line.lstrip().startswith(">")
    text = re.sub(r"`[^`]*`", "", line)  # commands, settings, paths: not figures
    for m in DURATION.finditer(text):
        h, mi, s, h2, mi2 = (int(g) if g else 0 for g in m.groups())
        seconds = (h + h2) * 3600 + (mi + mi2) * 60 + s
        yield Figure(m.group(0), float(seconds), "s", 0.5 if s or not mi2 else 30.0, number, files, quoted)
    text = DURATION.sub(" ", text)
    for m in FIGURE.finditer(text):
        whole, frac, unit = m.group(1).replace(",", ""), m.group(2) or "", m.group(3)
        if m.start() > 0 and text[m.start() - 1] in "-–/.":  # the far end of a range is checked as written
            pass
        step = 10.0 ** -(len(frac) - 1) if frac else 1.0
        yield Figure(m.group(0), float(whole + frac), unit, step / 2, number, files, quoted)


def traces(figure: Figure, values: list[float]) -> bool:
    """Whether a file value equals the figure in one of its unit's scales, up to its rounding."""
    for f in SCALE[figure.unit]:
        lo, hi = (figure.value - figure.half_step) * f, (figure.value + figure.half_step) * f
        tol = 1e-9 * max(1.0, abs(hi))
        if any(lo - tol <= v <= hi + tol for v in values if math.isfinite(v)):
            return True
    return False


def untraced(page: Path, root: Path) -> list[str]:
    """The page's figures that no result file of their section holds, as `line: figure (files)`."""
    cache: dict[str, list[float]] = {}
    bad = []
    for fig in figures(page):
        if fig.quoted:
            continue
        values: list[float] = []
        for name in fig.files:
            if name not in cache:
                p = root / name
                cache[name] = numbers_in(p) if p.is_file() else []
            values += cache[name]
        if not traces(fig, values):
            bad.append(
                f"{page.name}:{fig.line}: {fig.text!r} (files named: {', '.join(fig.files) or 'none'})"
            )
    return bad
