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


def _busy_kernel(x_ref, o_ref):
    def busy(_i, acc):
        return jnp.tanh(acc * 1.0001 + 0.5)

    noise = jax.lax.fori_loop(0, 16, busy, x_ref[...])
    o_ref[...] = x_ref[...] * 2.0 + noise * 0.0


def test_kernel_work_that_reaches_no_output_earns_nothing() -> None:
    honest, _ = check(lambda x: _call(_scale_kernel, x))
    busy, _ = check(lambda x: _call(_busy_kernel, x))
    # the add of the product counts; the product with zero (a zero whatever it multiplies) and the 16 tanh
    # steps of the busy loop do not
    assert busy.ok and busy.work_inside == honest.work_inside + 256 * 256


def test_platform_dependent_lowering_is_refused() -> None:
    def kernel(x_ref, o_ref):
        o_ref[...] = jax.lax.platform_dependent(x_ref[...], cpu=lambda v: v * 2.0, default=lambda v: v)

    c, _ = check(lambda x: _call(kernel, x))
    assert not c.ok and "platform-dependent" in c.reason
    outside, _ = check(
        lambda x: jax.lax.platform_dependent(_call(_scale_kernel, x), cpu=jnp.abs, default=jnp.sin)
    )
    assert not outside.ok and "platform-dependent" in outside.reason


def test_glue_is_judged_by_cost() -> None:
    small, warnings = check(lambda x: jnp.mean(_call(_scale_kernel, x)[:, :8]))
    assert small.ok, small.reason  # 2048 elements after a kernel over 65536: glue
    assert any("small glue" in w for w in warnings)
    whole, _ = check(lambda x: jnp.sum(_call(_scale_kernel, x)))
    assert not whole.ok and "glue may process at most" in whole.reason

    # a matmul as a broadcast multiply and an add tree: elementwise only, far over the program's I/O
    def bmm(x):
        prod = x[:, :, None] * x[None, :, :]
        y = prod[:, 0, :]
        for k in range(1, 64):
            y = y + prod[:, k, :]
        return _call(_busy_kernel, y)

    c, _ = check(bmm)
    assert not c.ok and "work, not glue" in c.reason


def test_tpu_program_text_costs_glue_and_sees_complex_reduces() -> None:
    from jax import export

    from maxkernel.tools.stablehlo_check import _boolean_only, check_tpu_program, tensor_types

    def text(fn):
        return export.export(jax.jit(fn), platforms=("tpu",))(X).mlir_module()

    line = "%5 = stablehlo.reduce(%4 init: %c) applies stablehlo.and across dimensions = [1] : " \
        "(tensor<8x4xcomplex<f32>>, tensor<i1>) -> tensor<8xi1>"  # fmt: skip
    assert [t for _d, t in tensor_types(line)] == ["complex<f32>", "i1", "i1"]
    assert not _boolean_only(line)
    small = check_tpu_program(text(lambda x: jnp.mean(_call(_scale_kernel, x)[:, :8])), expected_kernels=1)
    assert small.ok, small.reason
    cplx = check_tpu_program(
        text(lambda x: _call(_scale_kernel, jnp.sum(x.astype(jnp.complex64)[:, :, None] * x[None], 1).real)),
        1,
    )
    assert not cplx.ok and "stablehlo.reduce" in cplx.reason
    # a cumsum is a reduce_window on the TPU, its types after its region: small (offsets of 16 groups), it
    # is glue; over the whole input (a running sum of 256 x 256 windows of 256), work outside the kernel
    groups = jnp.arange(16, dtype=jnp.int32)
    offsets = check_tpu_program(
        text(lambda x: _call(_scale_kernel, x) + jnp.cumsum(groups)[:, None].astype(x.dtype).sum()), 1
    )
    assert offsets.ok, offsets.reason
    assert any("reduce_window (256 elements)" in g for g in offsets.glue_outside), offsets.glue_outside
    running = check_tpu_program(text(lambda x: _call(_scale_kernel, jnp.cumsum(x, axis=1))), 1)
    assert not running.ok and "stablehlo.reduce_window" in running.reason, running.reason


def test_a_scatter_that_adds_or_writes_rows_is_elementwise_work_and_any_other_is_heavy() -> None:
    """`buf.at[rows].add(kernel_rows)` / `.set(...)` put a kernel's rows into a buffer: one add or write per
    update element, judged as elementwise work outside the kernels, in the jaxpr and in the TPU program.
    A scatter with a function (`scatter_apply`) or a multiplying one computes: heavy, whatever its size."""
    from jax import export, lax

    from maxkernel.tools.stablehlo_check import check_tpu_program

    dn = lax.ScatterDimensionNumbers(
        update_window_dims=(1,), inserted_window_dims=(0,), scatter_dims_to_operand_dims=(0,)
    )
    rows = jnp.array([[7], [3], [7]], jnp.int32)  # a repeated row: the adds collide

    def put(add):
        fn = lax.scatter_add if add else lax.scatter
        return lambda x: fn(jnp.zeros((512, 256), x.dtype), rows, _call(_scale_kernel, x)[:3], dn)

    cases = {
        "add": (put(True), True),
        "set": (put(False), True),
        "mul": (lambda x: jnp.ones((512, 256), x.dtype).at[rows[:, 0]].mul(_call(_scale_kernel, x)[:3]), False),
        "apply": (lambda x: lax.scatter_apply(_call(_scale_kernel, x), rows, jnp.sin, dn, update_shape=(3, 256)), False),
    }  # fmt: skip
    for name, (fn, allowed) in cases.items():
        c, _ = check(fn)
        tpu = check_tpu_program(export.export(jax.jit(fn), platforms=("tpu",))(X).mlir_module(), 1)
        assert c.ok is allowed and tpu.ok is allowed, (name, c.reason, tpu.reason)
        if allowed:
            assert c.work_outside == 3 * 256 and tpu.elementwise_cost >= 3 * 256, name
        else:
            assert "scatter" in c.reason and "stablehlo.scatter" in tpu.reason, name
    # a reduction done by scatter-adding a whole input into one row is more work than the kernel does
    dump = check(
        lambda x: lax.scatter_add(_call(_scale_kernel, x)[:1], jnp.zeros((256, 1), jnp.int32), x * x, dn)
    )
    assert not dump[0].ok


def test_the_checked_programs_platform_sites_must_be_its_kernels() -> None:
    from jax import export

    from maxkernel.tools import program_artifacts as artifacts
    from maxkernel.tools.stablehlo_check import check_tpu_program, tpu_view

    def checked(fn):
        closed = artifacts.trace_once(fn, [X], "TPU v5 lite")
        return export.deserialize(
            bytearray(artifacts.export_checked(closed, [X], "TPU v5 lite"))
        ).mlir_module()

    view = tpu_view(checked(lambda x: jnp.tanh(_call(_scale_kernel, x))))
    assert view.problem is None and view.sites == view.kernel_sites == 1
    assert check_tpu_program(view.text, 1).ok  # the interpreter's loop (CPU side) is not in the TPU view

    def two_outputs(x_ref, o_ref, p_ref):
        o_ref[...] = x_ref[...] * 2.0
        p_ref[...] = x_ref[...] + 1.0

    def pair(x):  # a kernel with two results: its site is `%r:2 = stablehlo.case(...)`
        shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
        return pl.pallas_call(two_outputs, out_shape=(shape, shape))(x)

    both = tpu_view(checked(lambda x: sum(pair(x))))
    assert both.problem is None and both.kernel_sites == 1
    branchy = tpu_view(checked(lambda x: jax.lax.platform_dependent(_call(_scale_kernel, x), cpu=jnp.abs,
                                                                    default=jnp.sin)))  # fmt: skip
    assert branchy.problem is not None and "differently per platform" in branchy.problem
