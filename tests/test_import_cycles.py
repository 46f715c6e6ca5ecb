"""No import circles: every `import` in the package, at module level or deferred inside a function (a
function-level import that dodges a circle is still a circle), read with `ast` and checked for cycles.

The CLI and the run bookkeeping must have none. Elsewhere the circles that remain are listed in
`KNOWN_CIRCLES`, allowed for now; a listed circle that is gone fails too, so that its entry is deleted and
the test only ever tightens. Imports under `if TYPE_CHECKING:` never run and are not counted, nor is the
parent package that Python initialises before a submodule (`maxkernel.cli` before `maxkernel.cli.root`):
`from maxkernel.cli import app` inside a command module would count, as an import of `maxkernel.cli`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "maxkernel"

MUST_BE_ACYCLIC = ("maxkernel.cli", "maxkernel.runs")
"""Modules (and packages, with everything under them) that no import circle may touch."""

KNOWN_CIRCLES: dict[str, frozenset[str]] = {
    "the offline author's region kinds reach the partitioner, and it them, through deferred imports": frozenset(
        f"maxkernel.authors.offline.{m}"
        for m in "attention axes conv_epilogue conv_pool dataflow families online partition trace".split()
    ),
    "task loading reads package versions from the store; the store's leases name threads by safe_task_id": (
        frozenset({"maxkernel.tools.store", "maxkernel.tools.tasks"})
    ),
}
"""Circles allowed for now, each a set of modules a remaining circle lies within (a circle that shrinks
still passes). Delete an entry once its circle is gone; never add one for new code."""


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package's __init__)."""
    found: dict[str, tuple[Path, bool]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _imported(tree: ast.Module, name: str, is_package: bool, known: set[str]) -> Iterator[str]:
    """Every module an import statement anywhere in `tree` names (`from X import Y` names X.Y when that is
    a module, else X), skipping `if TYPE_CHECKING:` blocks."""
    package = name if is_package else name.rpartition(".")[0]
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                yield f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
        todo.extend(ast.iter_child_nodes(node))


@cache
def import_graph() -> dict[str, frozenset[str]]:
    modules = _modules()
    known = set(modules)
    graph: dict[str, frozenset[str]] = {}
    for name, (path, is_package) in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        targets = {t for t in _imported(tree, name, is_package, known) if t in known and t != name}
        graph[name] = frozenset(targets)
    return graph


def circles(graph: dict[str, frozenset[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(frozenset(component))
    return found


def _under(module: str, roots: tuple[str, ...]) -> bool:
    return any(module == r or module.startswith(r + ".") for r in roots)


def test_the_finder_sees_a_deferred_circle() -> None:
    graph = {"a": frozenset({"b"}), "b": frozenset({"c"}), "c": frozenset({"a"}), "d": frozenset({"a"})}
    assert circles(graph) == [frozenset({"a", "b", "c"})]
    tree = ast.parse("from . import root\n\ndef main():\n    from maxkernel.cli import app\n")
    known = {"maxkernel.cli", "maxkernel.cli.root"}
    assert set(_imported(tree, "maxkernel.cli.x", False, known)) == {"maxkernel.cli", "maxkernel.cli.root"}


def test_no_import_circle_touches_the_cli_or_the_run_bookkeeping() -> None:
    graph = import_graph()
    assert "maxkernel.cli.root" in graph and "maxkernel.runs" in graph
    touching = [sorted(c) for c in circles(graph) if any(_under(m, MUST_BE_ACYCLIC) for m in c)]
    assert touching == [], touching


def test_import_circles_elsewhere_are_only_the_known_ones_and_each_is_still_there() -> None:
    found = circles(import_graph())
    unknown = [sorted(c) for c in found if not any(c <= allowed for allowed in KNOWN_CIRCLES.values())]
    assert unknown == [], f"a new import circle: {unknown}"
    gone = [why for why, allowed in KNOWN_CIRCLES.items() if not any(c <= allowed for c in found)]
    assert gone == [], f"fixed, delete from KNOWN_CIRCLES: {gone}"
