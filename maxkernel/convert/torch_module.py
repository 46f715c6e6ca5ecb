"""Read a PyTorch task file: its size constants (without running it), and the module at a chosen scale.

A KernelBench task keeps its sizes in module-level constants (`batch_size = 128`, `N = 2048 * 2`) that
`get_inputs` and `get_init_inputs` read. A smaller copy of the task is the same file with those constants
rewritten before it runs, so derived globals (`bias_shape = (out_channels, 1, 1)`) follow. Only
assignments whose right-hand side is integer arithmetic on literals are rewritten, and only values of
at least `MIN_SCALED` (kernel sizes, strides, paddings and group counts stay as they are).

`load_scaled` executes the file: it runs only inside the sandboxed conversion child.
"""

from __future__ import annotations

import ast
import math
import types
from pathlib import Path
from typing import Any

MIN_SCALED = 16
"""Constants below this are structure (kernel 3, stride 2, 4 groups, 8 heads), not sizes."""

KERNELBENCH_NAMES = ("Model", "get_inputs", "get_init_inputs")


def _int_value(node: ast.expr) -> int | None:
    """The value of integer arithmetic on literals (`2048 * 2`, `4096 // 4`), else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return int(node.value)
    if isinstance(node, ast.BinOp) and isinstance(
        node.op, ast.Mult | ast.Add | ast.Sub | ast.FloorDiv | ast.Pow
    ):
        left, right = _int_value(node.left), _int_value(node.right)
        if left is None or right is None:
            return None
        if isinstance(node.op, ast.Mult):
            return left * right
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Pow):
            return left**right if 0 <= right <= 64 else None
        return left // right if right else None
    return None


def _constant_values(node: ast.expr) -> list[int] | None:
    """An int expression as [value], a tuple of int expressions as its values, else None."""
    value = _int_value(node)
    if value is not None:
        return [value]
    if isinstance(node, ast.Tuple) and node.elts:
        values = [_int_value(e) for e in node.elts]
        if all(v is not None for v in values):
            return [int(v) for v in values if v is not None]
    return None


def _assignments(tree: ast.Module) -> list[tuple[str, ast.expr, bool]]:
    """(name, value node, is_tuple) for module-level constant assignments, in file order."""
    found: list[tuple[str, ast.expr, bool]] = []
    for node in tree.body:
        targets: list[ast.expr] = []
        value: ast.expr | None = None
        if isinstance(node, ast.Assign):
            targets, value = list(node.targets), node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        if value is None or _constant_values(value) is None:
            continue
        for t in targets:
            if isinstance(t, ast.Name):
                found.append((t.id, value, isinstance(value, ast.Tuple)))
    return found


def size_constants(source: str) -> dict[str, int]:
    """Module-level integer constants in file order (last assignment wins); a tuple of ints gives one entry
    per element, `name[i]` (`input_shape = (32768,)` is a size too)."""
    found: dict[str, int] = {}
    for name, value, is_tuple in _assignments(ast.parse(source)):
        values = _constant_values(value) or []
        if is_tuple:
            for i, v in enumerate(values):
                found[f"{name}[{i}]"] = v
        else:
            found[name] = values[0]
    return found


def scalable(constants: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in constants.items() if v >= MIN_SCALED}


def defines(source: str) -> set[str]:
    """Top-level names a file defines (classes, functions, assignments), read without running it."""
    tree = ast.parse(source)
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def is_kernelbench_source(source: str) -> bool:
    try:
        return set(KERNELBENCH_NAMES) <= defines(source)
    except SyntaxError:
        return False


def shrink_value(value: int, factor: float) -> int:
    """A size constant times `factor`, keeping its power-of-two grain (up to 128) so tile-friendly sizes stay
    tile-friendly, never below min(value, 8)."""
    if factor >= 1 or value < MIN_SCALED:
        return value
    grain = min(value & -value, 128 if value >= 1024 else 8)
    shrunk = max(grain, int(math.floor(value * factor / grain)) * grain)
    return max(min(value, 8), shrunk)


def rewrite_constants(source: str, overrides: dict[str, int]) -> str:
    """The file with the named module-level size constants (`name` or `name[i]`) set to new values."""
    if not overrides:
        return source
    tree = ast.parse(source)
    for node in tree.body:
        value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
        if value is None or _constant_values(value) is None:
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        names = [t.id for t in targets if isinstance(t, ast.Name)]
        if isinstance(value, ast.Tuple):
            for name in names:
                for i, elt in enumerate(value.elts):
                    if f"{name}[{i}]" in overrides:
                        value.elts[i] = ast.copy_location(ast.Constant(overrides[f"{name}[{i}]"]), elt)
        else:
            hit = [n for n in names if n in overrides]
            if hit:
                node.value = ast.copy_location(ast.Constant(overrides[hit[0]]), value)
    return ast.unparse(tree)


def load_scaled(
    path: Path, overrides: dict[str, int], name: str = "maxkernel_torch_task"
) -> types.ModuleType:
    """Execute the file with its size constants overridden (sandboxed child only)."""
    import sys

    source = path.read_text()
    code = compile(rewrite_constants(source, overrides) if overrides else source, str(path), "exec")
    module = types.ModuleType(name)
    module.__file__ = str(path)
    sys.modules[name] = module
    sys.path.insert(0, str(path.parent))
    try:
        exec(code, module.__dict__)
    finally:
        sys.path.remove(str(path.parent))
    return module


def entry_points(module: types.ModuleType, class_name: str | None) -> tuple[Any, Any, Any]:
    """(model class, get_inputs, get_init_inputs) of a KernelBench-style file, or of a named module in
    any file that also defines `get_inputs` (and, if its constructor takes arguments, `get_init_inputs`)."""
    cls_name = class_name or "Model"
    cls = getattr(module, cls_name, None)
    get_inputs = getattr(module, "get_inputs", None)
    get_init_inputs = getattr(module, "get_init_inputs", None) or (lambda: [])
    missing = [n for n, v in ((cls_name, cls), ("get_inputs", get_inputs)) if v is None]
    if missing:
        raise LookupError(
            f"the file defines no {' and no '.join(missing)}: a PyTorch task needs an nn.Module class "
            f"(`Model`, or the one named with --module) and `get_inputs()` returning its forward arguments "
            "(plus `get_init_inputs()` if the constructor takes arguments)"
        )
    return cls, get_inputs, get_init_inputs
