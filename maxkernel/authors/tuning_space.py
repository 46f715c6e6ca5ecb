"""The contract between a model-written kernel and the autotuner: a module-level `TUNING_SPACE` literal dict
names top-level constants and the values to try; the autotuner writes each config back into those
constants. Both directions read the source with `ast` and never execute it (it is candidate code).

A constant is settable where the module assigns it a literal at top level, in any of the forms people
write: `BLOCK_M = 128`, `BLOCK_M: int = 128`, or unpacked, `BLOCK_M, BLOCK_N = 128, 256` (parentheses or
brackets too). The literal is replaced in place, so the rest of the line, its comments and the layout stay.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

ParamValue = int | str


def declared_tuning_space(source: str) -> dict[str, list[ParamValue]] | None:
    """The module-level `TUNING_SPACE = {"BLOCK_M": [128, 256], ...}` of a kernel, read with `ast`
    (literal values only; the module is never executed here). None when absent or not a literal dict."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
        if isinstance(node, ast.AnnAssign):
            target = node.target
        if isinstance(target, ast.Name) and target.id == "TUNING_SPACE" and node.value is not None:
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                return None
            if not isinstance(value, dict):
                return None
            space = {
                str(k): [x for x in v if isinstance(x, int | str) and not isinstance(x, bool)]
                for k, v in value.items()
                if isinstance(v, list | tuple)
            }
            return {k: v for k, v in space.items() if v} or None
    return None


def _is_literal(node: ast.expr) -> bool:
    try:
        ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return True


def _sites(tree: ast.Module) -> Iterator[tuple[str, ast.expr]]:
    """(name, literal value node) for every top-level assignment of a literal to a plain name."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name):
            pairs = [(target, value)]
        elif isinstance(target, ast.Tuple | ast.List) and isinstance(value, ast.Tuple | ast.List):
            if len(target.elts) != len(value.elts):
                continue
            pairs = list(zip(target.elts, value.elts, strict=True))
        else:
            continue
        for name, literal in pairs:
            if isinstance(name, ast.Name) and _is_literal(literal):
                yield name.id, literal


def settable_constants(source: str) -> set[str]:
    """Names the autotuner can set in `source` (empty when it does not parse)."""
    try:
        return {name for name, _ in _sites(ast.parse(source))}
    except SyntaxError:
        return set()


def set_constants(source: str, values: dict[str, ParamValue]) -> str:
    """`source` with each named constant's literal replaced by `repr(value)` (every top-level literal
    assignment of it). KeyError names a constant the module does not assign a literal at top level."""
    tree = ast.parse(source)
    edits: list[tuple[int, int, str]] = []  # (start, end) byte offsets into the source, new text
    lines = source.encode().splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    found: set[str] = set()
    for name, node in _sites(tree):
        if name in values:
            assert node.end_lineno is not None and node.end_col_offset is not None
            start = starts[node.lineno - 1] + node.col_offset  # ast offsets are UTF-8 byte columns
            end = starts[node.end_lineno - 1] + node.end_col_offset
            edits.append((start, end, repr(values[name])))
            found.add(name)
    missing = sorted(set(values) - found)
    if missing:
        raise KeyError(", ".join(missing))
    data = source.encode()
    for start, end, text in sorted(edits, reverse=True):
        data = data[:start] + text.encode() + data[end:]
    return data.decode()
