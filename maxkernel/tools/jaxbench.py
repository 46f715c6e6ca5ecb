"""The JAXBench workload format, read as it is, without executing the workload in this process.

A JAXBench checkout has `benchmark/<id>/baseline.py` (`CONFIG`, `create_inputs(dtype=...)`,
`workload(*inputs)`, optional `get_flops()`) and, for some workloads, a hand-written Pallas kernel in
`optimized.py` exporting `workload`. This module answers the questions the parent process needs before any
sandbox runs: is this path a workload (or a suite of them), what is its task id, which tolerances does its
`CONFIG` set, and is there a hand-written kernel next to it.

`CONFIG` is read with `ast` (literal values only): the parent never imports task code, and a value that is
not a literal (`jnp.bfloat16`, an expression) is simply not a tolerance.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

BASELINE_FILE = "baseline.py"
OPTIMIZED_FILE = "optimized.py"
SUITE_DIR = "benchmark"
# JAXBench's own correctness check uses atol = rtol = 1e-2 when a workload's CONFIG sets neither.
DEFAULT_TOLERANCE = 1e-2
TOLERANCE_KEYS = ("atol", "rtol")
# The functions that make a module a workload; both must be defined at module level.
REQUIRED_FUNCTIONS = ("create_inputs", "workload")


def _module_functions(tree: ast.Module) -> set[str]:
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)} | {
        t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)
    }


def _parse(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_text(errors="replace"), filename=str(path))
    except (SyntaxError, ValueError, OSError):
        return None


def is_workload_module(path: Path) -> bool:
    """A `.py` file that defines `create_inputs` and `workload` (a syntax error is decided by the sandbox)."""
    if path.suffix != ".py" or not path.is_file():
        return False
    tree = _parse(path)
    if tree is None:
        text = path.read_text(errors="replace")
        return all(f"def {name}" in text for name in REQUIRED_FUNCTIONS)
    return set(REQUIRED_FUNCTIONS) <= _module_functions(tree)


def is_workload_dir(path: Path) -> bool:
    """`benchmark/<id>/`: a directory whose `baseline.py` is a workload module."""
    return path.is_dir() and is_workload_module(path / BASELINE_FILE)


def task_id(module: Path) -> str:
    """The workload's directory name for `<id>/baseline.py` (what JAXBench calls the workload), else the
    file's stem (a bare workload module)."""
    return module.parent.name if module.name == BASELINE_FILE else module.stem


def read_config(module: Path) -> dict[str, Any]:
    """The literal entries of the module-level `CONFIG = {...}` dict; non-literal values are left out."""
    tree = _parse(module)
    if tree is None:
        return {}
    config: dict[str, Any] = {}
    for node in tree.body:
        value = None
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "CONFIG" for t in node.targets
        ):
            value = node.value
        elif (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id == "CONFIG"
        ):
            value = node.value
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "dict":
            entries = [(ast.Constant(kw.arg), kw.value) for kw in value.keywords if kw.arg]
        elif isinstance(value, ast.Dict):
            entries = [(k, v) for k, v in zip(value.keys, value.values, strict=True) if k is not None]
        else:
            continue
        for key_node, value_node in entries:
            try:
                key = ast.literal_eval(key_node)
                config[str(key)] = ast.literal_eval(value_node)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                continue
    return config


def _numeric(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def tolerances(config: dict[str, Any]) -> dict[str, float]:
    """`CONFIG`'s atol/rtol where the workload sets them (numbers only), else JAXBench's own: its harness
    compares every kernel at atol = rtol = 1e-2. A hand-written kernel's `optimized.py` may carry a
    tolerance of its own (its self-test's); JAXBench never applies it, and neither does this."""
    return {
        key: float(config[key]) if _numeric(config.get(key)) else DEFAULT_TOLERANCE for key in TOLERANCE_KEYS
    }


def task_meta(module: Path) -> dict[str, Any]:
    """What `load_task` takes from a workload without running it: id, description, tolerances."""
    config = read_config(module)
    tree = _parse(module)
    doc = (ast.get_docstring(tree) or "") if tree is not None else ""
    name = config.get("name")
    described = [str(name)] if isinstance(name, str) and name else []
    if doc:
        described.append(doc.strip())
    category = config.get("category")
    return {
        "task_id": task_id(module),
        "description": "\n\n".join(described),
        "category": str(category) if isinstance(category, str) else "jaxbench",
        **tolerances(config),
    }


def hand_written_kernel(task_path: Path) -> Path | None:
    """`optimized.py` next to a workload's baseline, if there is one (task path: the dir or the module)."""
    folder = task_path if task_path.is_dir() else task_path.parent
    if task_path.is_file() and task_path.name != BASELINE_FILE:
        return None  # a bare module has no workload dir, so no hand-written kernel of its own
    candidate = folder / OPTIMIZED_FILE
    return candidate if candidate.is_file() else None


def suite_root(path: Path) -> Path:
    """A JAXBench checkout's root stands for its `benchmark/` directory."""
    inner = path / SUITE_DIR
    if path.is_dir() and inner.is_dir() and not any(is_workload_dir(p) for p in path.iterdir() if p.is_dir()):
        return inner
    return path
