"""The shared jaxpr walk and catalogs (`maxkernel.tools.jaxpr`), and the plain-data tree walk."""

from __future__ import annotations

import ast
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from maxkernel.tools import jaxpr as J
from maxkernel.tools.program_tree import size_of, skeleton, to_tree, tree_eqns

REPO = Path(__file__).resolve().parents[1]


def _double(x_ref, o_ref):  # noqa: ANN001 - Pallas refs
    o_ref[...] = x_ref[...] * 2.0


def _program(x: jax.Array) -> jax.Array:
    @jax.jit
    def inner(y: jax.Array) -> jax.Array:
        return pl.pallas_call(_double, out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype), interpret=True)(y)

    def body(c: jax.Array, _: None) -> tuple[jax.Array, None]:
        return jnp.tanh(c), None

    z = lax.cond(x[0, 0] > 0, lambda a: a + 1.0, lambda a: a - 1.0, inner(x))
    return lax.scan(body, z, None, length=2)[0]


def test_walk_eqns_visits_nested_jaxprs_in_program_order() -> None:
    closed = jax.make_jaxpr(_program)(jnp.ones((8, 128), jnp.float32))
    names = [e.primitive.name for e in J.walk_eqns(closed)]
    # an equation, then what is nested in it: the jit body (the kernel, then its body), the cond's branches
    # (false first), the scan's body
    assert names == [
        "slice", "squeeze", "gt", "jit", "pallas_call", "get", "mul", "swap", "convert_element_type",
        "cond", "sub", "add", "scan", "tanh",
    ]  # fmt: skip
    outside = [e.primitive.name for e in J.walk_eqns(closed, J.outside_kernels)]
    assert "pallas_call" in outside and "mul" not in outside  # the kernel body is not entered
    assert [e.primitive.name for e in J.iter_pallas_eqns(closed)] == ["pallas_call"]


def test_tree_walk_matches_the_jaxpr_walk_and_survives_deep_nesting() -> None:
    closed = jax.make_jaxpr(_program)(jnp.ones((8, 128), jnp.float32))
    tree = to_tree(closed)
    assert [e["p"] for e in tree_eqns(tree, kernels=True)] == [e.primitive.name for e in J.walk_eqns(closed)]
    assert size_of(tree) == len(list(J.walk_eqns(closed)))
    assert skeleton(tree)["kernels"][0]["prims"].get("mul") == 1
    deep: dict = {"eqns": [{"p": "add", "out": [[1]]}]}
    for _ in range(5000):  # deeper than Python's recursion limit: a hostile tree is walked, not a crash
        deep = {"eqns": [{"p": "pjit", "out": [], "subs": [deep]}]}
    assert size_of(deep) == 5001


def test_catalogs_that_differ_on_purpose_are_not_merged_by_accident() -> None:
    # random-number generation is allowed outside kernels, but the offline author does not re-emit it
    assert "threefry2x32" in J.ELEMENTWISE_OUTSIDE and "threefry2x32" not in J.ELEMENTWISE
    assert "add_any" in J.ELEMENTWISE and "add_any" not in J.ELEMENTWISE_OUTSIDE
    assert J.GLUE <= J.LAYOUT_OUTSIDE  # glue the offline author leaves to XLA passes the Pallas check
    assert J.FREE_IN_XLA <= J.LAYOUT_OUTSIDE
    assert "transpose" in J.KERNEL_DATA_MOVEMENT and "transpose" not in J.FREE_IN_KERNEL
    assert J.STRUCTURAL == set(J.CALL_PRIMITIVES) | {"cond"}


def test_tools_never_import_authors() -> None:
    """Dependencies point graph → nodes → authors/tools: nothing in tools/ may import an author."""
    for path in sorted((REPO / "maxkernel" / "tools").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            mods = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not any(m.startswith("maxkernel.authors") for m in mods), f"{path.name} imports {mods}"
