"""The config reference (docs/config.md), generated from the pydantic models in `harnessrl.config`:
every key with its type, default, allowed values and the comment written beside it in the source.

    python -m harnessrl.config.doc > docs/config.md     # a test checks the file is up to date
"""

from __future__ import annotations

import ast
import enum
import inspect
import sys
import typing
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from harnessrl import config

HEADER = """# Config reference

Generated from `src/harnessrl/config/` by `python -m harnessrl.config.doc > docs/config.md`
(a test keeps this file and the models in step). A config is a YAML file of these sections; any key
can also be set on the command line as a dotted override (`train.lr=2e-5`) or from Python
(`harnessrl.train("config.yaml", train={"lr": 2e-5})`). Relative paths in `harness`, `tasks` and
`grader` are resolved against the config file's folder; `run_dir` against the current folder.
Values are checked when the config is loaded, and every problem is reported at once.
Walkthrough: [your-harness.md](your-harness.md).
"""


def field_comments(cls: type) -> dict[str, str]:
    """{field: the comment on its line, or the comment lines right above it} from the class source."""
    lines, _ = inspect.getsourcelines(cls)
    tree = ast.parse(inspect.cleandoc("".join(lines)) if lines[0].startswith(" ") else "".join(lines))
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef)).body
    out: dict[str, str] = {}
    for node in body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        first, last = node.lineno - 1, (node.end_lineno or node.lineno) - 1
        trailing = _comment(lines[last])
        above: list[str] = []
        i = first - 1
        while i >= 0 and lines[i].strip().startswith("#"):
            above.insert(0, lines[i].strip().lstrip("#").strip())
            i -= 1
        out[node.target.id] = " ".join([*above, trailing]).strip()
    return out


def _comment(line: str) -> str:
    """The `# ...` part of a source line (not inside a string; good enough for config.py)."""
    quote = None
    for i, ch in enumerate(line):
        if ch in "\"'" and quote in (None, ch):
            quote = None if quote else ch
        elif ch == "#" and quote is None:
            return line[i + 1 :].strip()
    return ""


def type_name(annotation: Any) -> str:
    """A short, readable type: `int`, `float | None`, `list[str]`, `"sync" | "async"`."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(type_name(a) for a in args)}]"
    if annotation is type(None):
        return "None"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " | ".join(repr(m.value) for m in annotation)
    return getattr(annotation, "__name__", str(annotation))


def default_text(f: FieldInfo) -> str:
    """The default as YAML would spell it."""
    if f.default_factory is not None:
        value: Any = f.default_factory()  # type: ignore[call-arg]
        if isinstance(value, BaseModel):
            return "(section)"
    else:
        value = f.default
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, str) else str(value)


def constraints(f: FieldInfo) -> str:
    """`≥ 1`, `> 0`, … from the field's metadata."""
    out = []
    for m in f.metadata:
        for attr, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
            v = getattr(m, attr, None)
            if v is not None:
                out.append(f"{sign} {v}")
    return ", ".join(out)


def sections() -> list[tuple[str, type[BaseModel]]]:
    """(key, model) of the top level, then every section in the order `RunConfig` declares them."""
    out: list[tuple[str, type[BaseModel]]] = [("(top level)", config.RunConfig)]
    for name, f in config.RunConfig.model_fields.items():
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
            out.append((name, f.annotation))
    return out


def render() -> str:
    """docs/config.md."""
    parts = [HEADER]
    for key, model in sections():
        doc = (model.__doc__ or "").strip().splitlines()[0]
        parts.append(
            f"\n## `{key}`\n\n{doc}\n\n| key | type | default | allowed | meaning |\n|---|---|---|---|---|"
        )
        comments = field_comments(model)
        for name, f in model.model_fields.items():
            if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
                continue
            meaning = comments.get(name, "").replace("|", "\\|")
            row = [f"`{name}`", type_name(f.annotation).replace("|", "\\|"), f"`{default_text(f)}`",
                   constraints(f), meaning]  # fmt: skip
            parts.append("| " + " | ".join(row) + " |")
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
