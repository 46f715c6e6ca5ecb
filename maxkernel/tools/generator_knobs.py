"""The size knobs of a task's input generator: the integer literals that decide its inputs' shapes.

A task without CPU-scale inputs (a JAXBench workload, a MaxKernel problem dir whose `get_inputs` takes no
`scale`) is validated at smaller shapes than its own. Shrinking the *arrays* by a factor and drawing
random values for them loses what only the task's generator knows: page tables that index a smaller
pool, group sizes that sum to the new row count, a batch of 128 that is not the 128 output channels, a
static size the generator derives from the others. So the validation sizes are set where the task sets
them: the generator's integer literals are its knobs, and the generator is run again with some of them
changed (`apply`), in the sandbox, producing inputs as the task itself would at that size.

A knob is an integer literal (>= 2) in the generator function's body, or in a module-level assignment
the generator can read (`CONFIG = {'seq_len': 4096}`, `SEQ = 4096`). Literals inside other functions
(the computation's own locals) are never knobs: changing them would change the problem, not its size.
Which literals really are sizes is not guessed here: `validation_sizing` changes each one and keeps those
that change an input's shape.

Pure `ast` and text: nothing here imports JAX or runs task code.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

MODULE = "module"
INPUT_GEN_CODE = "input_gen_code"


@dataclass(frozen=True)
class Knob:
    """One integer literal of a task's source that may set a size."""

    key: str = ""
    """`where:line:col`: stable for a given source text, the key an assignment uses."""
    where: str = MODULE
    """Which text: the reference module (`module`) or the task yaml's `input_gen_code`."""
    line: int = 0
    col: int = 0
    end_col: int = 0
    value: int = 0
    label: str = ""
    """What a person calls it: `CONFIG['seq_len']`, `batch_size`, or `literal 128 (line 12)`."""


def _label(parents: dict[int, ast.AST], node: ast.Constant) -> str:
    parent = parents.get(id(node))
    if isinstance(parent, ast.Dict):
        for k, v in zip(parent.keys, parent.values, strict=True):
            if v is node and isinstance(k, ast.Constant):
                owner = parents.get(id(parent))
                name = _target_name(owner) or "dict"
                return f"{name}[{k.value!r}]"
    if isinstance(parent, ast.keyword) and parent.arg:
        return f"{parent.arg}="
    if isinstance(parent, ast.Assign | ast.AnnAssign):
        name = _target_name(parent)
        if name:
            return name
    if isinstance(parent, ast.Tuple):
        owner = parents.get(id(parent))
        if (
            isinstance(owner, ast.Assign)
            and len(owner.targets) == 1
            and isinstance(owner.targets[0], ast.Tuple)
        ):
            index = next(i for i, e in enumerate(parent.elts) if e is node)
            targets = owner.targets[0].elts
            if index < len(targets) and isinstance(targets[index], ast.Name):
                return targets[index].id
    return f"literal {node.value} (line {node.lineno})"


def _target_name(node: ast.AST | None) -> str | None:
    if isinstance(node, ast.Assign) and node.targets:
        names = [t.id for t in node.targets if isinstance(t, ast.Name)]
        return " = ".join(names) if names else None
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return node.target.id
    return None


def _int_literals(root: ast.AST) -> list[ast.Constant]:
    return [
        n
        for n in ast.walk(root)
        if isinstance(n, ast.Constant)
        and type(n.value) is int
        and n.value >= 2
        and n.end_col_offset is not None
    ]


def find_knobs(text: str, where: str, generator: str) -> list[Knob]:
    """Every integer literal of `text` that may set a size of what `generator` returns: those in the
    generator's body (nested functions included) and in module-level assignments. Empty when the text
    does not parse or has no such function."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    parents: dict[int, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[id(child)] = node
    roots: list[ast.AST] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == generator:
            roots.extend(node.body)  # the body, not the defaults (`dtype=...`) or decorators
        elif isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            roots.append(node.value)
    out: list[Knob] = []
    seen: set[tuple[int, int]] = set()
    for root in roots:
        for lit in _int_literals(root):
            pos = (lit.lineno, lit.col_offset)
            if pos in seen or lit.lineno != lit.end_lineno:
                continue
            seen.add(pos)
            out.append(
                Knob(
                    key=f"{where}:{lit.lineno}:{lit.col_offset}",
                    where=where,
                    line=lit.lineno,
                    col=lit.col_offset,
                    end_col=int(lit.end_col_offset or 0),
                    value=int(lit.value),
                    label=_label(parents, lit),
                )
            )
    return sorted(out, key=lambda k: (k.line, k.col))


def apply(text: str, knobs: list[Knob], values: dict[str, int]) -> str:
    """`text` with each knob named in `values` set to its new value; everything else byte for byte the
    same (line numbers in tracebacks stay right). Offsets are `ast`'s: UTF-8 bytes within the line."""
    by_key = {k.key: k for k in knobs}
    lines = text.splitlines(keepends=True)
    edits: dict[int, list[tuple[Knob, int]]] = {}
    for key, value in values.items():
        knob = by_key.get(key)
        if knob is None:
            raise KeyError(f"no knob {key!r} in this source")
        if type(value) is not int or value < 1:
            raise ValueError(f"knob {knob.label} must be a positive int; got {value!r}")
        edits.setdefault(knob.line - 1, []).append((knob, value))
    for index, changes in edits.items():
        raw = lines[index].encode()
        for knob, value in sorted(changes, key=lambda kv: kv[0].col, reverse=True):
            original = raw[knob.col : knob.end_col].decode(errors="replace")
            try:
                same = ast.literal_eval(original) == knob.value
            except (ValueError, SyntaxError):
                same = False
            if not same:
                raise ValueError(f"line {index + 1} changed since its knobs were read ({original!r})")
            raw = raw[: knob.col] + str(value).encode() + raw[knob.end_col :]
        lines[index] = raw.decode()
    return "".join(lines)


def describe(knobs: list[Knob], values: dict[str, int]) -> str:
    """`batch_size 128->8, CONFIG['seq_len'] 4096->512`: the changes, for a person."""
    by_key = {k.key: k for k in knobs}
    parts = [
        f"{by_key[key].label} {by_key[key].value}->{value}"
        for key, value in values.items()
        if key in by_key and by_key[key].value != value
    ]
    return ", ".join(parts)
