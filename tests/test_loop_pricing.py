"""Loops are priced once per iteration on both sides of a speedup (reference: the compiler's model, which
prices a while body once, corrected; kernels: the block model, in-kernel while loops per trip)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl

from maxkernel.tools import loop_pricing
from maxkernel.tools.estimate import estimate_pallas, estimate_xla, topology_device

F32 = jnp.float32
BF16 = jnp.bfloat16
"""Operands of the XLA test programs: bf16, so XLA hoists no f32->bf16 conversion out of the loops."""
L = 16
"""Trip count of the test loops: large enough that pricing the body once is off by an order of magnitude."""


def _body(x, w):
    # bf16[256, 512] @ bf16[512, 512] -> f32, then a row softmax: MXU work plus a reduction, like attention's body
    y = jnp.dot(x, w, preferred_element_type=F32)
    return jax.nn.softmax(y, axis=-1)


def _mapped(xs, w):
    return lax.map(lambda x: _body(x, w), xs)  # xs: bf16[L, 256, 512]


def test_map_of_length_l_is_priced_l_times_the_body() -> None:
    """A reference written as lax.map over L slices costs at least L x the same body priced as its own
    program, where the compiler's model alone prices it about once."""
    xs = ((L, 256, 512), BF16)
    w = ((512, 512), BF16)
    looped = estimate_xla(_mapped, [xs, w], "v5e")
    body = estimate_xla(_body, [((256, 512), BF16), w], "v5e")
    assert looped.est_loop_extra_seconds > 0
    assert any(f"trip counts {L}:" in n for n in looped.notes)
    assert looped.est_compiler_seconds < 0.5 * L * body.estimated_seconds  # the bug: priced ~once
    assert looped.estimated_seconds >= 0.9 * L * body.estimated_seconds
    # and not more than L x the body as the compiler prices it alone plus its work around the loop
    assert looped.estimated_seconds <= L * body.est_compiler_seconds + looped.est_compiler_seconds


def test_nested_loops_multiply() -> None:
    """A map of 4 over a map of 4 is priced for all 16 inner bodies, not 4 (nor 1)."""
    w = ((512, 512), BF16)

    def nested(xs, w):  # xs: bf16[4, 4, 256, 512]
        return lax.map(lambda x4: lax.map(lambda x: _body(x, w), x4), xs)

    deep = estimate_xla(nested, [((4, 4, 256, 512), BF16), w], "v5e")
    body = estimate_xla(_body, [((256, 512), BF16), w], "v5e")
    assert any("trip counts 4, 4:" in n for n in deep.notes)
    assert deep.estimated_seconds >= 0.9 * L * body.estimated_seconds

    sharding = jax.sharding.SingleDeviceSharding(topology_device("v5e"))
    specs = [jax.ShapeDtypeStruct((4, 4, 256, 512), BF16, sharding=sharding)]
    specs.append(jax.ShapeDtypeStruct((512, 512), BF16, sharding=sharding))
    cycles = loop_pricing.hlo_loop_cycles(jax.jit(nested).trace(*specs).lower().compile().as_text())
    assert cycles.trips == (4, 4)
    # the inner body's cycles count 16 times: more than any single trip count can give
    assert cycles.cycles_per_trip > 4 * cycles.cycles_once


def test_loop_free_program_is_unchanged() -> None:
    """No loop, no correction: the estimate is the compiler's figure (+ its documented precision terms)."""
    est = estimate_xla(_body, [((256, 512), BF16), ((512, 512), BF16)], "v5e")
    assert est.est_loop_extra_seconds == 0.0
    assert not any("loop" in n for n in est.notes)
    # the loop-free figure: the compiler's, possibly re-priced by bytes (documented in estimate_xla), which
    # only ever lowers it
    assert 0 < est.estimated_seconds <= est.est_compiler_seconds + est.est_precision_surcharge_seconds


def test_counter_while_loop_is_priced_per_trip() -> None:
    """A hand-written while_loop with a counter is priced per trip like a scan of the same length."""
    w = ((512, 512), BF16)

    def looped(x, w):
        def step(c):
            i, acc = c
            return i + 1, acc + _body(x, w)

        return lax.while_loop(lambda c: c[0] < L, step, (0, jnp.zeros((256, 512), F32)))[1]

    est = estimate_xla(looped, [((256, 512), BF16), w], "v5e")
    body = estimate_xla(_body, [((256, 512), BF16), w], "v5e")
    assert any(f"trip counts {L}:" in n for n in est.notes)
    assert est.estimated_seconds >= 0.9 * L * body.estimated_seconds


def test_trip_counts_read_from_jaxpr_and_hlo() -> None:
    """Trip counts come from the jaxpr (scan length, counter-form while) and from the compiled HLO."""

    def fori_dynamic(x, n):
        return lax.fori_loop(0, n, lambda i, c: c * 2.0, x)

    jx = jax.make_jaxpr(fori_dynamic)(1.0, 5)
    (eqn,) = [e for e in jx.jaxpr.eqns if e.primitive.name == "while"]
    assert loop_pricing.jaxpr_loop_trips(eqn) is None  # bound is an argument: unknown before run time
    n_var = jx.jaxpr.invars[1]
    known = loop_pricing.while_trip_count(eqn, lambda v: 5 if v is n_var else loop_pricing.literal_value(v))
    assert known is not None and int(known) == 5

    down = jax.make_jaxpr(lambda x: lax.while_loop(lambda c: c[0] > 2, lambda c: (c[0] - 3, c[1]), (20, x)))
    (eqn,) = [e for e in down(1.0).jaxpr.eqns if e.primitive.name == "while"]
    assert loop_pricing.jaxpr_loop_trips(eqn) == 6  # 20, 17, 14, 11, 8, 5 -> stops at 2

    sharding = jax.sharding.SingleDeviceSharding(topology_device("v5e"))
    spec = jax.ShapeDtypeStruct((L, 256, 512), BF16, sharding=sharding)
    w = jax.ShapeDtypeStruct((512, 512), BF16, sharding=sharding)
    hlo = jax.jit(_mapped).trace(spec, w).lower().compile().as_text()
    assert L in loop_pricing.hlo_while_trips(hlo)
    pool = [L, 4]
    assert loop_pricing.match_compiled_loop(L, pool) == 1 and pool == [4]
    assert loop_pricing.match_compiled_loop(8, pool) == 2  # unrolled by 2: two iterations priced per trip
    assert loop_pricing.match_compiled_loop(3, []) == 3  # fully unrolled: all priced already


def _diagonal_loop_kernel(x, w, *, bq: int):
    """x: f32[n * bq, d], w: f32[n * d, d]. Row block i multiplies by the first i + 1 weight blocks with an in-kernel fori_loop whose bound
    depends on the grid position (the shape of a causal attention kernel's inner loop)."""
    n = x.shape[0] // bq

    def kernel(x_ref, w_ref, o_ref):
        i = pl.program_id(0)

        def step(j, acc):
            d = x_ref.shape[1]
            wj = w_ref[pl.ds(pl.multiple_of(j * d, d), d), :]  # f32[d, d]: weight block j
            return acc + jnp.dot(x_ref[...], wj, preferred_element_type=F32)

        o_ref[...] = lax.fori_loop(0, i + 1, step, jnp.zeros(o_ref.shape, F32))

    def row_map(i):
        return i, 0

    def whole_map(i):
        return 0, 0

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), F32),
        grid=(n,),
        in_specs=[pl.BlockSpec((bq, x.shape[1]), row_map), pl.BlockSpec(w.shape, whole_map)],
        out_specs=pl.BlockSpec((bq, w.shape[1]), row_map),
    )(x, w)


def test_in_kernel_fori_loop_is_charged_per_trip() -> None:
    """The block model charges an in-kernel loop with grid-dependent bounds its mean trip count."""
    n, bq, d = 8, 128, 256
    fn = functools.partial(_diagonal_loop_kernel, bq=bq)
    jx = jax.make_jaxpr(fn)(jax.ShapeDtypeStruct((n * bq, d), F32), jax.ShapeDtypeStruct((n * d, d), F32))
    call = estimate_pallas(jx, "v5e").pallas_calls[0]
    one_dot = 2.0 * bq * d * d  # x block [bq, d] @ weight block [d, d]
    trips = np.arange(1, n + 1)
    assert call.est_mxu_flops == pytest.approx(one_dot * trips.sum())
    assert any("per trip" in note for note in call.notes)
