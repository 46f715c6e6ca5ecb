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
