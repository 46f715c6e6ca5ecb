"""The 'Pallas does the work' rules on jaxprs of known programs (no sandbox needed: our own code)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from maxkernel.tools.checks import check_pallas_does_work

X = jax.ShapeDtypeStruct((256, 256), jnp.float32)


def _scale_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0


def _copy_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]


def _call(kernel, x):
    return pl.pallas_call(
        kernel,
        grid=(2,),
        in_specs=[pl.BlockSpec((128, 256), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((128, 256), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
    )(x)


def check(fn):
    return check_pallas_does_work(jax.make_jaxpr(fn)(X))


def test_kernel_with_layout_ops_outside_passes() -> None:
    c, warnings = check(lambda x: _call(_scale_kernel, jnp.pad(x.T, ((0, 0), (0, 0))).reshape(256, 256)))
    assert c.ok, c.reason
    assert c.pallas_calls == 1
    assert c.work_inside == 256 * 256  # one multiply per element, over both grid steps
    assert not warnings


def test_reduction_outside_is_heavy() -> None:
    c, _ = check(lambda x: _call(_scale_kernel, x) + jnp.sum(x))
    assert not c.ok and "reduce_sum" in c.reason


def test_dot_inside_jit_wrapper_is_found() -> None:
    c, _ = check(jax.jit(lambda x: _call(_scale_kernel, x @ x)))
    assert not c.ok and "dot_general" in c.reason


def test_unknown_primitives_count_as_heavy() -> None:
    c, _ = check(lambda x: _call(_scale_kernel, jnp.sort(x, axis=-1)))
    assert not c.ok and "sort" in c.reason


def test_loops_outside_are_heavy() -> None:
    c, _ = check(lambda x: jax.lax.fori_loop(0, 3, lambda i, y: _call(_scale_kernel, y), x))
    assert not c.ok


def test_callbacks_are_forbidden() -> None:
    def fn(x):
        y = jax.pure_callback(lambda a: a * 2, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        return _call(_scale_kernel, y)

    c, _ = check(fn)
    assert not c.ok and "callback" in c.reason


def test_copy_kernel_is_rejected() -> None:
    c, warnings = check(lambda x: _call(_copy_kernel, jnp.tanh(x)))
    assert not c.ok and "only move data" in c.reason
    assert any("tanh" in w for w in warnings)


def test_dominant_elementwise_outside_is_rejected() -> None:
    c, _ = check(lambda x: _call(_scale_kernel, jnp.exp(jnp.tanh(jnp.sin(x)))))
    assert not c.ok and "outside Pallas" in c.reason
    small, _ = check(lambda x: _call(_scale_kernel, x) * 0.5)
    assert small.ok  # equal work inside and outside is still allowed


def test_no_pallas() -> None:
    c, _ = check(lambda x: x * 2)
    assert not c.ok and "no pallas_call" in c.reason


# --- no credit for work that may never run ------------------------------------------------------------------


def _dead_branch_kernel(x_ref, o_ref):
    def big(v):
        return jax.lax.fori_loop(0, 64, lambda i, acc: acc + jnp.dot(v, jnp.ones((256, 256), v.dtype)), v)

    o_ref[...] = jax.lax.cond(pl.program_id(0) < 0, big, lambda v: v * 2.0, x_ref[...])


def test_dead_branch_earns_no_credit() -> None:
    # Outside: a broadcast-multiply matmul (elementwise ops only); inside: a dot in a branch never taken.
    def fn(x):
        prod = x[:, :8, None] * x[None, :8, :]
        return _call(_dead_branch_kernel, prod[:, 0, :] + prod[:, 1, :] + prod[:, 2, :])

    c, _ = check(fn)
    assert not c.ok and "whichever way a branch goes" in c.reason
    assert c.work_inside < 256 * 256 + 16  # the cheap branch (and the predicate) only


def test_kernel_under_a_top_level_cond_earns_nothing() -> None:
    c, _ = check(lambda x: jax.lax.cond(x[0, 0] > 0, lambda y: _call(_scale_kernel, y), lambda y: y, x))
    assert not c.ok and "conditional" in c.reason


def test_same_program_across_modes_and_shapes() -> None:
    from maxkernel.tools.program_tree import same_program, skeleton, to_tree

    small = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    big = jax.ShapeDtypeStruct((512, 256), jnp.float32)
    honest = lambda x: _call(_scale_kernel, x)  # noqa: E731
    a = skeleton(to_tree(jax.make_jaxpr(honest)(small)))
    b = skeleton(to_tree(jax.make_jaxpr(honest)(big)))
    assert same_program(a, b, exact=False) is None
    branchy = lambda x: _call(_scale_kernel, x) if x.shape[0] <= 256 else x * 0.0  # noqa: E731
    c = skeleton(to_tree(jax.make_jaxpr(branchy)(big)))
    assert "pallas_call" in same_program(a, c, exact=False)


def test_tpu_program_text_rules() -> None:
    from jax import export

    from maxkernel.tools.stablehlo_check import check_tpu_program

    def text(fn):
        return export.export(jax.jit(fn), platforms=("tpu",))(X).mlir_module()

    ok = check_tpu_program(text(lambda x: _call(_scale_kernel, x)), expected_kernels=1)
    assert ok.ok and ok.mosaic_calls == 1
    heavy = check_tpu_program(text(lambda x: _call(_scale_kernel, x) + jnp.sum(x)), expected_kernels=1)
    assert not heavy.ok and "stablehlo.reduce" in heavy.reason
    cond = check_tpu_program(
        text(lambda x: jax.lax.cond(x[0, 0] > 0, lambda y: _call(_scale_kernel, y), lambda y: y * 2.0, x)), 1
    )
    assert not cond.ok and cond.conditional_mosaic_calls == 1
    none = check_tpu_program(text(lambda x: x * 2.0), expected_kernels=1)
    assert not none.ok and "no Pallas" in none.reason
    nested = check_tpu_program(text(jax.jit(lambda x: _call(_scale_kernel, x) * 2.0)), expected_kernels=1)
    assert nested.ok
