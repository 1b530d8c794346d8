"""Synthesised bugs: deterministic, `ast`-level mutations of working code (SWE-smith style).

A mutation site is one node of a function that an operator can change (a comparison, a binary or
boolean operator, a `not`, a constant, a `range(...)` bound, a slice bound, an index). Sites are
enumerated in a fixed order (`ast.walk` of the function), so `(source, function, site index)`
names one mutant forever; the result is produced with `ast.unparse`, so it always parses.
"""

from __future__ import annotations

import ast
import copy
from dataclasses import dataclass

# comparison swaps: each operator goes to a plausible wrong neighbour
_COMPARE_SWAP: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
}
_BINOP_SWAP: dict[type[ast.operator], type[ast.operator]] = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Add,
    ast.FloorDiv: ast.Mult,
    ast.Mod: ast.FloorDiv,
}
_BOOLOP_SWAP: dict[type[ast.boolop], type[ast.boolop]] = {ast.And: ast.Or, ast.Or: ast.And}


@dataclass(frozen=True)
class Site:
    """One place a mutation operator applies: the operator's name and the node's position."""

    kind: str  # compare_swap | binop_swap | boolop_swap | remove_not | bool_flip | constant | off_by_one
    index: int  # position of the node in `ast.walk(function)` order
    lineno: int


def _function(tree: ast.Module, name: str) -> ast.FunctionDef:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise ValueError(f"no top-level function {name!r} in the module")


def _is_docstring(fn: ast.FunctionDef, node: ast.AST) -> bool:
    first = fn.body[0] if fn.body else None
    return isinstance(first, ast.Expr) and node is first.value


def _kinds(fn: ast.FunctionDef, node: ast.AST, parent: ast.AST | None) -> list[str]:
    """The operators that apply to `node` (in a fixed order)."""
    if isinstance(node, ast.Compare) and type(node.ops[0]) in _COMPARE_SWAP:
        return ["compare_swap"]
    if isinstance(node, ast.BinOp | ast.AugAssign) and type(node.op) in _BINOP_SWAP:
        return ["binop_swap"]
    if isinstance(node, ast.BoolOp) and type(node.op) in _BOOLOP_SWAP:
        return ["boolop_swap"]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return ["remove_not"]
    if isinstance(node, ast.Constant) and isinstance(node.value, bool):
        return ["bool_flip"]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "range"
        and node.args
    ):
        return ["off_by_one"]
    if isinstance(node, ast.Slice) and (node.lower is not None or node.upper is not None):
        return ["off_by_one"]
    if (
        isinstance(node, ast.Constant)
        and type(node.value) is int
        and not _is_docstring(fn, node)
        and not isinstance(parent, ast.Slice)
    ):
        return ["constant"]
    return []


def find_sites(source: str, function: str) -> list[Site]:
    """Every mutation site of `function` in `source`, in a fixed order."""
    fn = _function(ast.parse(source), function)
    parents = {id(c): p for p in ast.walk(fn) for c in ast.iter_child_nodes(p)}
    sites: list[Site] = []
    for i, node in enumerate(ast.walk(fn)):
        for kind in _kinds(fn, node, parents.get(id(node))):
            sites.append(Site(kind, i, getattr(node, "lineno", fn.lineno)))
    return sites


def _shift(expr: ast.expr, delta: int) -> ast.expr:
    """`expr + delta`, folding into an int constant when `expr` is one."""
    if isinstance(expr, ast.Constant) and type(expr.value) is int:
        return ast.Constant(expr.value + delta)
    op: ast.operator = ast.Add() if delta > 0 else ast.Sub()
    return ast.BinOp(left=expr, op=op, right=ast.Constant(abs(delta)))


def _mutate_node(node: ast.AST, kind: str) -> ast.AST:
    """Apply operator `kind` to `node` (a copy of the tree's node) and return the replacement."""
    if kind == "compare_swap" and isinstance(node, ast.Compare):
        node.ops[0] = _COMPARE_SWAP[type(node.ops[0])]()
    elif kind == "binop_swap" and isinstance(node, ast.BinOp | ast.AugAssign):
        node.op = _BINOP_SWAP[type(node.op)]()
    elif kind == "boolop_swap" and isinstance(node, ast.BoolOp):
        node.op = _BOOLOP_SWAP[type(node.op)]()
    elif kind == "remove_not" and isinstance(node, ast.UnaryOp):
        return node.operand
    elif kind == "bool_flip" and isinstance(node, ast.Constant):
        node.value = not node.value
    elif kind == "constant" and isinstance(node, ast.Constant) and type(node.value) is int:
        node.value = node.value + 1 if node.value in (0, 1) else node.value - 1
    elif kind == "off_by_one" and isinstance(node, ast.Call):
        # range(stop) -> range(stop - 1); range(start, ...) -> range(start + 1, ...)
        if len(node.args) == 1:
            node.args[0] = _shift(node.args[0], -1)
        else:
            node.args[0] = _shift(node.args[0], 1)
    elif kind == "off_by_one" and isinstance(node, ast.Slice):
        if node.upper is not None:
            node.upper = _shift(node.upper, -1)
        elif node.lower is not None:
            node.lower = _shift(node.lower, 1)
    else:
        raise ValueError(f"operator {kind!r} does not apply to {type(node).__name__}")
    return node


class _Replace(ast.NodeTransformer):
    """Replace the node at `ast.walk` position `index` of the function by `_mutate_node`'s result."""

    def __init__(self, target: ast.AST, kind: str) -> None:
        self.target, self.kind = target, kind

    def generic_visit(self, node: ast.AST) -> ast.AST:
        if node is self.target:
            return _mutate_node(node, self.kind)
        return super().generic_visit(node)


def apply(source: str, function: str, site: Site) -> str:
    """The source with `site` mutated, as `ast.unparse` writes it (so it parses)."""
    tree = copy.deepcopy(ast.parse(source))
    fn = _function(tree, function)
    target = next(n for i, n in enumerate(ast.walk(fn)) if i == site.index)
    if site.kind not in _kinds(fn, target, None) and site.kind != "off_by_one":
        raise ValueError(f"site {site} does not match the source")
    new_fn = _Replace(target, site.kind).visit(fn)
    tree.body[tree.body.index(fn)] = new_fn
    out = ast.unparse(ast.fix_missing_locations(tree))
    ast.parse(out)
    return out


def normalise(source: str) -> str:
    """The source as `ast.unparse` writes it: the fixed file in the same style as the mutant."""
    return ast.unparse(ast.parse(source))
