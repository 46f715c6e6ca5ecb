"""Block-model arithmetic checked against hand counts; compiler estimates checked against known flops."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from maxkernel.tools.estimate import (
    PER_STEP_OVERHEAD_S,
    PallasEstimate,
    estimate_pallas,
    estimate_xla,
    estimated_speedup,
    topology_device,
)
from maxkernel.tools.tpu_specs import get_spec

BF16 = jnp.bfloat16


def _matmul_kernel(x_ref, y_ref, o_ref, acc_ref, *, k_axis: int):
    @pl.when(pl.program_id(k_axis) == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

    @pl.when(pl.program_id(k_axis) == pl.num_programs(k_axis) - 1)
    def _store():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def tiled_matmul(x, y, *, bm=128, bn=128, bk=128, k_middle=False):
    """(m, k) @ (k, n). Grid (i, j, kk) by default; k_middle puts kk in the middle: (i, kk, j)."""
    m, k = x.shape
    n = y.shape[1]
    if k_middle:
        grid = (m // bm, k // bk, n // bn)

        def x_map(i, kk, j):
            return i, kk

        def y_map(i, kk, j):
            return kk, j

        def o_map(i, kk, j):
            return i, j

        k_axis = 1
    else:
        grid = (m // bm, n // bn, k // bk)

        def x_map(i, j, kk):
            return i, kk

        def y_map(i, j, kk):
            return kk, j

        def o_map(i, j, kk):
            return i, j

        k_axis = 2
    return pl.pallas_call(
        functools.partial(_matmul_kernel, k_axis=k_axis),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        grid=grid,
        in_specs=[pl.BlockSpec((bm, bk), x_map), pl.BlockSpec((bk, bn), y_map)],
        out_specs=pl.BlockSpec((bm, bn), o_map),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
    )(x, y)


def _sds(shape, dtype=BF16):
    return jax.ShapeDtypeStruct(shape, dtype)


def _estimate(fn, *shapes, gen="v5e", dtype=BF16) -> PallasEstimate:
    return estimate_pallas(jax.make_jaxpr(fn)(*(_sds(s, dtype) for s in shapes)), gen)


def test_matmul_refetch_count_matches_hand_count() -> None:
    # Grid (2, 3, 4), last axis (k) fastest. x block (i, k) and y block (k, j) change on every one of the
    # 24 steps; the output block (i, j) changes only when j or i does: 6 write-backs.
    est = _estimate(tiled_matmul, (256, 512), (512, 384))
    (call,) = est.pallas_calls
    assert call.grid == (2, 3, 4)
    assert call.est_grid_steps == 24
    block = 128 * 128 * 2
    assert [op.est_transfers for op in call.operands] == [24, 24, 6]
    assert [op.role for op in call.operands] == ["input", "input", "output"]
    assert call.est_hbm_bytes == (24 + 24 + 6) * block
    assert est.est_hbm_bytes == call.est_hbm_bytes
    assert call.est_mxu_flops == 2 * 256 * 512 * 384
    # 24 tiny steps: per-step overhead (8.4 us) dwarfs 1.8 MB of traffic and 0.1 GFLOP.
    assert call.est_overhead_seconds == pytest.approx(24 * PER_STEP_OVERHEAD_S)
    assert call.bound == "overhead"
    assert est.kind == "estimate" and est.method


def test_pallas_call_inside_jit_is_found() -> None:
    est = _estimate(jax.jit(tiled_matmul), (256, 512), (512, 384))
    assert len(est.pallas_calls) == 1 and est.pallas_calls[0].name == "_matmul_kernel"
    assert est.xla_op_count == 0


def test_grid_order_changes_refetches() -> None:
    # Grid (i, kk, j) with j fastest: x (i, kk) stays put across j -> 2*4 = 8 fetches; y (kk, j) and the
    # output (i, j) change every step -> 24 each.
    est = _estimate(functools.partial(tiled_matmul, k_middle=True), (256, 512), (512, 384))
    (call,) = est.pallas_calls
    assert call.grid == (2, 4, 3)
    assert [op.est_transfers for op in call.operands] == [8, 24, 24]
    assert call.est_hbm_bytes == (8 + 24 + 24) * 128 * 128 * 2


def test_vmem_footprint_is_double_buffered_blocks_plus_scratch() -> None:
    bm, bn, bk = 256, 512, 128
    est = _estimate(functools.partial(tiled_matmul, bm=bm, bn=bn, bk=bk), (512, 1024), (1024, 1024))
    (call,) = est.pallas_calls
    expected = 2 * (bm * bk + bk * bn + bm * bn) * 2 + bm * bn * 4
    assert call.est_vmem_bytes == expected
    assert not call.vmem_exceeds_limit and not call.vmem_exceeds_capacity


def test_vmem_limits_are_flagged_per_generation() -> None:
    big = functools.partial(tiled_matmul, bm=2048, bn=2048, bk=2048)
    shapes = ((4096, 4096), (4096, 4096))
    v5e = _estimate(big, *shapes, gen="v5e", dtype=jnp.float32).pallas_calls[0]
    assert v5e.est_vmem_bytes == 2 * 3 * 2048 * 2048 * 4 + 2048 * 2048 * 4  # 112 MiB
    assert v5e.vmem_exceeds_limit and not v5e.vmem_exceeds_capacity  # 16 MiB scoped, 128 MiB VMEM
    v4 = _estimate(big, *shapes, gen="v4", dtype=jnp.float32)
    assert v4.vmem_exceeds_capacity and any("will not compile" in n for n in v4.pallas_calls[0].notes)


def test_large_blocks_are_compute_bound() -> None:
    est = _estimate(functools.partial(tiled_matmul, bm=1024, bn=1024, bk=512), (4096, 4096), (4096, 4096))
    (call,) = est.pallas_calls
    assert call.bound == "compute"
    spec = get_spec("v5e")
    assert call.est_mxu_seconds == pytest.approx(2 * 4096**3 / spec.device_peak_flops)


def _add_kernel(x_ref, y_ref, o_ref):
    o_ref[...] = jnp.tanh(x_ref[...] + y_ref[...])


def tiled_add_tanh(x, y, *, block=(8, 128), row_major_map=None):
    rows, cols = x.shape
    grid = (rows // block[0], cols // block[1])

    def index_map(i, j):
        return (i, j) if row_major_map is None else row_major_map(i, j)

    spec = pl.BlockSpec(block, index_map)
    return pl.pallas_call(
        _add_kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=grid,
        in_specs=[spec, spec],
        out_specs=spec,
    )(x, y)


def test_tiny_elementwise_tiles_are_overhead_bound_and_count_transcendentals() -> None:
    est = _estimate(tiled_add_tanh, (1024, 1024), (1024, 1024), dtype=jnp.float32)
    (call,) = est.pallas_calls
    assert call.est_grid_steps == 128 * 8
    assert call.est_hbm_bytes == 3 * 1024 * 1024 * 4  # each block read/written exactly once
    assert call.est_transcendentals == 1024 * 1024
    assert call.est_vpu_elementwise_ops == 1024 * 1024  # the add
    assert call.bound == "overhead"


def test_index_map_arithmetic_is_evaluated() -> None:
    # Block row i // 2: rows 0,0,1,1,... -> a fetch every second step (grid (8, 1)).
    def halve(i, j):
        return i // 2, j

    est = _estimate(
        functools.partial(tiled_add_tanh, block=(8, 128), row_major_map=halve),
        (64, 128),
        (64, 128),
        dtype=jnp.float32,
    )
    (call,) = est.pallas_calls
    assert [op.est_transfers for op in call.operands] == [4, 4, 4]
    assert all(op.index_map_exact for op in call.operands)


def test_scan_multiplies_and_outside_ops_are_charged() -> None:
    def layered(x, y):
        def body(carry, _):
            return tiled_matmul(carry, y), None

        out, _ = jax.lax.scan(body, x, None, length=3)
        return out + 1

    est = _estimate(layered, (256, 256), (256, 256))
    (call,) = est.pallas_calls
    assert call.multiplicity == 3
    assert est.est_hbm_bytes >= 3 * call.est_hbm_bytes
    assert est.xla_op_count >= 1 and est.est_xla_seconds > 0
    assert est.estimated_seconds == pytest.approx(3 * call.estimated_seconds + est.est_xla_seconds)
    assert "estimate" in est.to_markdown().lower()


def test_transposes_that_cancel_between_kernels_cost_nothing() -> None:
    """A channels-first kernel fed the NHWC transpose of an NCHW input transposes it back: XLA folds the
    pair, so no HBM copy is charged; a pair that composes to a real permutation is charged once."""

    def round_trip(x, y):
        nhwc = jnp.transpose(x, (0, 2, 3, 1))
        back = jnp.transpose(nhwc, (0, 3, 1, 2)).reshape(256, 256)
        return tiled_matmul(back, y)

    def one_real(x, y):
        nhwc = jnp.transpose(x, (0, 2, 3, 1))
        other = jnp.transpose(nhwc, (0, 2, 1, 3)).reshape(256, 256)  # composed: (0, 2, 3, 1) -> one copy
        return tiled_matmul(other, y)

    x = (1, 4, 128, 128)
    plain = _estimate(lambda a, b: tiled_matmul(a.reshape(256, 256), b), x, (256, 256))
    folded = _estimate(round_trip, x, (256, 256))
    assert folded.est_xla_bytes == plain.est_xla_bytes
    assert folded.estimated_seconds == pytest.approx(plain.estimated_seconds)
    assert any("folded" in n for n in folded.notes)
    once = _estimate(one_real, x, (256, 256))
    assert once.est_xla_bytes == pytest.approx(plain.est_xla_bytes + 2 * 4 * 128 * 128 * 2)


def test_estimate_xla_matmul_flops() -> None:
    m, k, n = 256, 512, 128
    est = estimate_xla(lambda a, b: a @ b, [((m, k), BF16), ((k, n), BF16)], "v6e")
    assert est.kind == "estimate"
    assert est.est_flops == pytest.approx(2 * m * n * k)
    assert est.estimated_seconds is not None and est.estimated_seconds > 0
    assert est.est_cycles_total and est.est_cycles_total > 0
    assert est.est_bytes_accessed and est.est_bytes_accessed >= (m * k + k * n + m * n) * 2
    assert est.opaque_custom_calls == []
    assert est.device_kind == "TPU v6 lite"


def test_estimate_xla_is_blind_to_pallas_without_cost_estimate() -> None:
    est = estimate_xla(tiled_matmul, [_sds((256, 256)), _sds((256, 256))], "v5e")
    assert "tpu_custom_call" in est.opaque_custom_calls
    assert est.estimated_seconds is None and est.est_flops is None
    assert est.notes


def test_estimated_speedup() -> None:
    assert estimated_speedup(2e-6, 1e-6) == pytest.approx(2.0)
    ref = _estimate(tiled_matmul, (256, 512), (512, 384))
    cand = _estimate(functools.partial(tiled_matmul, bm=256, bn=384, bk=512), (256, 512), (512, 384))
    assert estimated_speedup(ref, cand) > 1.0  # one big step beats 24 tiny ones
    with pytest.raises(ValueError):
        estimated_speedup(1.0, 0.0)


@pytest.mark.parametrize(("rows", "fits"), [(512, True), (1024, False)])
def test_vmem_flag_agrees_with_mosaic(rows: int, fits: bool) -> None:
    """Three f32 (rows, 1024) blocks, double-buffered: 12 MiB fits v5e's 16 MiB scoped VMEM, 24 MiB does not."""
    fn = functools.partial(tiled_add_tanh, block=(rows, 1024))
    shapes = [_sds((2048, 1024), jnp.float32)] * 2
    call = estimate_pallas(jax.make_jaxpr(fn)(*shapes), "v5e").pallas_calls[0]
    assert call.est_vmem_bytes == 2 * 3 * rows * 1024 * 4
    assert call.vmem_exceeds_limit is (not fits)
    sharding = jax.sharding.SingleDeviceSharding(topology_device("v5e"))
    specs = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding) for s in shapes]
    if fits:
        jax.jit(fn).trace(*specs).lower().compile()
    else:
        with pytest.raises(Exception, match="(?i)vmem"):
            jax.jit(fn).trace(*specs).lower().compile()


def test_reference_pays_for_the_precision_it_asks_for() -> None:
    """The compiler's model prices f32 dots as one pass whatever the precision; estimate_xla adds the extra
    passes of HIGHEST, so a kernel and its reference pay for the same precision."""

    def mm(precision):
        return lambda a, b: jnp.dot(a, b, precision=precision)

    f32 = [((1024, 1024), jnp.float32)] * 2
    default = estimate_xla(mm(None), f32, "v5e")
    highest = estimate_xla(mm(jax.lax.Precision.HIGHEST), f32, "v5e")
    bf16 = estimate_xla(mm(jax.lax.Precision.HIGHEST), [((1024, 1024), jnp.bfloat16)] * 2, "v5e")
    assert default.est_compiler_seconds == pytest.approx(highest.est_compiler_seconds)  # blind to precision
    assert default.est_precision_surcharge_seconds == 0.0 and bf16.est_precision_surcharge_seconds == 0.0
    one_pass = 2 * 1024**3 / get_spec("v5e").device_peak_flops
    assert highest.est_precision_surcharge_seconds > 3 * one_pass
    assert highest.estimated_seconds == pytest.approx(
        default.estimated_seconds + highest.est_precision_surcharge_seconds
    )


def test_reference_pays_for_the_precision_of_its_convolutions() -> None:
    """Convolutions too: the compiler's optimal_seconds is the same for a 3x3 f32 conv at DEFAULT and
    HIGHEST (its per-fusion cycle counts are not), so the extra five passes of HIGHEST are added, counted
    from the conv's own flops (output elements x window x input channels per group)."""

    def conv(precision, groups=1):
        return lambda x, w: jax.lax.conv_general_dilated(
            x,
            w,
            (1, 1),
            "SAME",
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
            feature_group_count=groups,
            precision=precision,
        )

    shapes = [((8, 32, 32, 128), jnp.float32), ((3, 3, 128, 256), jnp.float32)]
    default = estimate_xla(conv(None), shapes, "v5e")
    highest = estimate_xla(conv(jax.lax.Precision.HIGHEST), shapes, "v5e")
    assert default.est_compiler_seconds == pytest.approx(highest.est_compiler_seconds)  # blind to precision
    assert default.est_precision_surcharge_seconds == 0.0
    one_pass = 2 * (8 * 32 * 32 * 256) * (3 * 3 * 128) / get_spec("v5e").device_peak_flops
    assert 4 * one_pass <= highest.est_precision_surcharge_seconds <= 5 * one_pass
    bf16 = [((8, 32, 32, 128), jnp.bfloat16), ((3, 3, 128, 256), jnp.bfloat16)]
    assert estimate_xla(conv(jax.lax.Precision.HIGHEST), bf16, "v5e").est_precision_surcharge_seconds == 0.0
    # grouped (depthwise): each output reads one input channel, so far fewer flops to surcharge
    dw = [((8, 32, 32, 128), jnp.float32), ((3, 3, 1, 128), jnp.float32)]
    grouped = estimate_xla(conv(jax.lax.Precision.HIGHEST, groups=128), dw, "v5e")
    assert (
        grouped.est_precision_surcharge_seconds
        <= 5 * 2 * (8 * 32 * 32 * 128) * 9 / get_spec("v5e").device_peak_flops
    )


def _causal_scores(q, k, *, bq: int, clamp: bool, guard: bool):
    """s[i] = sum over visible kv blocks j <= i of q_i @ k_j^T: the skeleton of causal attention."""
    n_q, n_k = q.shape[0] // bq, k.shape[0] // bq

    def kernel(q_ref, k_ref, o_ref):
        qi, kj = pl.program_id(0), pl.program_id(1)

        @pl.when(kj == 0)
        def _init():
            o_ref[...] = jnp.zeros_like(o_ref)

        def body():
            o_ref[...] += jax.lax.dot_general(
                q_ref[...], k_ref[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
            )

        if guard:
            pl.when(kj <= qi)(body)
        else:
            body()

    def q_index_map(qi, kj):
        return qi, 0

    def k_index_map(qi, kj):
        return (jnp.minimum(kj, qi) if clamp else kj), 0

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((q.shape[0], bq), jnp.float32),
        grid=(n_q, n_k),
        in_specs=[pl.BlockSpec((bq, q.shape[1]), q_index_map), pl.BlockSpec((bq, k.shape[1]), k_index_map)],
        out_specs=pl.BlockSpec((bq, bq), q_index_map),
    )(q, k)


def test_masked_blocks_skip_compute_and_fetch() -> None:
    """A pl.when guard on the grid position is charged only where it runs, and a K index map clamped to
    the last visible block fetches nothing for the masked steps."""
    spec = jax.ShapeDtypeStruct((1024, 128), jnp.bfloat16)
    n = 1024 // 128

    def est(**kw):
        fn = functools.partial(_causal_scores, bq=128, **kw)
        return estimate_pallas(jax.make_jaxpr(fn)(spec, spec), "v5e").pallas_calls[0]

    full, guarded, clamped = (
        est(clamp=False, guard=False),
        est(clamp=False, guard=True),
        est(clamp=True, guard=True),
    )
    visible = n * (n + 1) / 2
    assert guarded.est_mxu_flops == pytest.approx(full.est_mxu_flops * visible / n**2)
    assert any("fraction of grid steps" in note for note in guarded.notes)
    k_full = next(o for o in full.operands if o.role == "input" and o.est_transfers == n * n)
    k_clamped = [o for o in clamped.operands if o.role == "input"][1]
    # clamped: within each q row the block index stops changing after the diagonal; the next row restarts at 0
    assert k_clamped.est_transfers < k_full.est_transfers
    assert k_clamped.est_transfers == 1 + sum(
        1
        for i in range(n)
        for j in range(n)
        if (i, j) != (0, 0) and (min(j, i) != (min(j - 1, i) if j else min(n - 1, i - 1)))
    )


def _scaled_tanh(x, *, semantics: tuple[str, ...] | None):
    def kernel(x_ref, o_ref):
        o_ref[...] = jnp.tanh(x_ref[...]) * 2.0

    def index_map(i, j):
        return i, j

    params = pltpu.CompilerParams(dimension_semantics=semantics) if semantics else None
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(x.shape[0] // 256, x.shape[1] // 512),
        in_specs=[pl.BlockSpec((256, 512), index_map)],
        out_specs=pl.BlockSpec((256, 512), index_map),
        compiler_params=params,
    )(x)


def test_megacore_splits_only_parallel_dimensions() -> None:
    """v5p exposes two TensorCores as one device: 'parallel' grid steps are shared, others run on one core."""
    shape = (4096, 4096)

    def call(gen, semantics):
        fn = functools.partial(_scaled_tanh, semantics=semantics)
        return _estimate(fn, shape, gen=gen, dtype=jnp.float32).pallas_calls[0]

    split = call("v5p", ("parallel", "parallel"))
    alone = call("v5p", ("arbitrary", "arbitrary"))
    assert alone.est_eup_seconds == pytest.approx(2 * split.est_eup_seconds)
    assert alone.est_overhead_seconds == pytest.approx(2 * split.est_overhead_seconds)
    assert alone.est_memory_seconds == pytest.approx(split.est_memory_seconds)  # HBM is shared
    assert any("one of the 2 TensorCores" in n for n in alone.notes)
    # single-core devices are unaffected by the semantics
    assert call("v5e", ("parallel", "parallel")).est_eup_seconds == pytest.approx(
        call("v5e", ("arbitrary", "arbitrary")).est_eup_seconds
    )


def _gather_rows(idx, x, w):
    """out[i] = x[idx[i]] @ w: a scalar-prefetched row-block gather; w's index map ignores the table."""

    def kernel(idx_ref, x_ref, w_ref, o_ref):
        o_ref[...] = jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32).astype(o_ref.dtype)

    def x_index_map(i, idx_ref):
        return idx_ref[i], 0

    def w_index_map(i, idx_ref):
        return 0, 0

    def o_index_map(i, idx_ref):
        return i, 0

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((idx.shape[0] * 128, w.shape[1]), x.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(idx.shape[0],),
            in_specs=[pl.BlockSpec((128, 256), x_index_map), pl.BlockSpec((256, 256), w_index_map)],
            out_specs=pl.BlockSpec((128, 256), o_index_map),
        ),
    )(idx, x, w)


def test_scalar_prefetch_maps_that_ignore_the_table_are_exact() -> None:
    jaxpr = jax.make_jaxpr(_gather_rows)(_sds((16,), jnp.int32), _sds((4096, 256)), _sds((256, 256)))
    call = estimate_pallas(jaxpr, "v5e").pallas_calls[0]
    x_op, w_op = [o for o in call.operands if o.role == "input"][-2:]
    assert not x_op.index_map_exact and x_op.est_transfers == 16  # data-dependent: upper bound
    assert w_op.index_map_exact and w_op.est_transfers == 1  # constant map: fetched once


def test_reference_bytes_are_counted_like_the_block_model_counts_kernel_bytes() -> None:
    """A memory-bound reference is re-priced with each op's operands and result moved once (the compiler's
    byte count multiplies them by how often the fusion uses each element); compute-bound and plain
    elementwise programs keep the compiler's own figure."""
    spec = get_spec("v5e")
    gemm = estimate_xla(
        lambda x, w, b: jnp.maximum(x @ w + b, 0.0),
        [((512, 1024), jnp.float32), ((1024, 1024), jnp.float32), ((1024,), jnp.float32)],
        "v5e",
    )
    minimum = (512 * 1024 + 1024 * 1024 + 1024 + 512 * 1024) * 4
    assert gemm.est_once_bytes == minimum
    assert gemm.estimated_seconds == pytest.approx(minimum / spec.device_hbm_bytes_per_s)
    assert gemm.est_compiler_seconds > 2 * gemm.estimated_seconds
    big = estimate_xla(jnp.matmul, [((4096, 4096), jnp.bfloat16)] * 2, "v5e")
    assert big.estimated_seconds == big.est_compiler_seconds  # compute-bound: the compiler's figure
    ew = estimate_xla(lambda x: x * 2 + 1, [((1024, 1024), jnp.float32)], "v5e")
    assert ew.estimated_seconds == pytest.approx(ew.est_compiler_seconds)


def _f32_matmul_panels(x, y, *, precision):
    """f32[m, k] @ f32[k, n] in row panels of 512 with the whole of k and n per step: compute-bound, each
    operand fetched about once, so the estimate is the MXU term at the dot's precision."""
    m, k = x.shape
    n = y.shape[1]

    def kernel(x_ref, y_ref, o_ref):
        o_ref[...] = jnp.dot(x_ref[...], y_ref[...], precision=precision, preferred_element_type=jnp.float32)

    def row_map(i):
        return i, 0

    def whole_map(i):
        return 0, 0

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
        grid=(m // 512,),
        in_specs=[pl.BlockSpec((512, k), row_map), pl.BlockSpec((k, n), whole_map)],
        out_specs=pl.BlockSpec((512, n), row_map),
    )(x, y)


@pytest.mark.parametrize(
    ("gen", "n"),
    [("v5e", 2048), pytest.param("v6e", 4096, marks=pytest.mark.slow)],  # 4096: compute-bound on v6e
)
def test_same_f32_matmul_is_charged_alike_on_both_sides(gen: str, n: int) -> None:
    """Precision costs the same in a kernel and in XLA: one bf16 MXU pass at DEFAULT (Mosaic rounds the
    f32 operands, XLA computes f32 dots in bf16 on TPU), six at HIGHEST on both sides - so going from
    DEFAULT to HIGHEST adds five passes to either estimate."""
    spec = jax.ShapeDtypeStruct((n, n), jnp.float32)
    kernel, xla = {}, {}
    for name, prec in (("default", None), ("highest", jax.lax.Precision.HIGHEST)):
        fn = functools.partial(_f32_matmul_panels, precision=prec)
        kernel[name] = estimate_pallas(jax.make_jaxpr(fn)(spec, spec), gen)
        xla[name] = estimate_xla(lambda a, b, p=prec: jnp.dot(a, b, precision=p), [spec, spec], gen)
        assert kernel[name].bound == "compute"
    one_pass = 2 * n**3 / get_spec(gen).device_peak_flops
    assert kernel["default"].pallas_calls[0].est_mxu_seconds == pytest.approx(one_pass, rel=0.05)
    assert kernel["highest"].pallas_calls[0].est_mxu_seconds == pytest.approx(6 * one_pass, rel=0.05)
    added_kernel = kernel["highest"].estimated_seconds - kernel["default"].estimated_seconds
    added_xla = xla["highest"].estimated_seconds - xla["default"].estimated_seconds
    assert added_kernel == pytest.approx(5 * one_pass, rel=0.1)
    assert added_xla == pytest.approx(added_kernel, rel=0.1)
    # XLA's DEFAULT figure also holds its f32->bf16 conversion passes over HBM, which the kernel (rounding
    # in the MXU's path) does not make: never cheaper than the kernel at the same precision
    assert xla["default"].estimated_seconds >= kernel["default"].estimated_seconds


def _times_two_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0


def _times_two(x, block):
    return pl.pallas_call(
        _times_two_kernel,
        grid=(x.shape[0] // block[0],),
        in_specs=[pl.BlockSpec(block, lambda i: (i, 0))],
        out_specs=pl.BlockSpec(block, lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
    )(x)


def test_vpu_work_is_counted_in_whole_vregs() -> None:
    """A (rows, 1) column occupies as many vregs as a (rows, 128) tile, and the VPU spends as much on it:
    counted by logical elements it was 128 times cheaper, which hid layouts that strand values in columns."""
    column = jax.ShapeDtypeStruct((4096, 1), jnp.float32)
    tile = jax.ShapeDtypeStruct((4096, 128), jnp.float32)
    narrow = estimate_pallas(jax.make_jaxpr(functools.partial(_times_two, block=(512, 1)))(column), "v5e")
    wide = estimate_pallas(jax.make_jaxpr(functools.partial(_times_two, block=(512, 128)))(tile), "v5e")
    assert narrow.est_vpu_elementwise_ops == wide.est_vpu_elementwise_ops == 4096 * 128
    odd = jax.ShapeDtypeStruct((4096, 200), jnp.float32)  # 200 lanes fill two vregs' worth: 256
    padded = estimate_pallas(jax.make_jaxpr(functools.partial(_times_two, block=(512, 200)))(odd), "v5e")
    assert padded.est_vpu_elementwise_ops == 4096 * 256


def test_a_gather_outside_kernels_is_charged_for_what_it_picks() -> None:
    """Gathering 64 rows of a 65536-row table reads 64 rows, not the table: indices + picked rows + output."""
    table = jax.ShapeDtypeStruct((65536, 256), jnp.float32)
    idx = jax.ShapeDtypeStruct((64,), jnp.int32)
    est = estimate_pallas(jax.make_jaxpr(lambda t, i: t[i])(table, idx), "v5e")
    picked = 64 * 256 * 4
    assert est.est_xla_bytes <= 2 * picked + 64 * 8 * 4 + 1024, est.est_xla_bytes
    assert est.est_xla_bytes >= 2 * picked


def _mix(y):
    """32 rounds of a uint32 add / shift / xor mix: 3 elementwise ops per element per round."""
    for r in range(32):
        y = (y ^ (y << 13)) + jnp.uint32(r + 1)
    return y


def _mix_kernel(x_ref, o_ref):
    o_ref[...] = _mix(x_ref[...])


def _mix_in_kernel(x, block_rows):
    spec = pl.BlockSpec((block_rows, x.shape[1]), lambda i: (i, 0))
    return pl.pallas_call(
        _mix_kernel,
        grid=(x.shape[0] // block_rows,),
        in_specs=[spec],
        out_specs=spec,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
    )(x)


@pytest.mark.parametrize("gen", ["v5e", "v6e"])
def test_elementwise_work_is_priced_alike_in_a_kernel_and_in_xla(gen: str) -> None:
    """The compiler's model prices elementwise ops at the MXU peak, the block model at the VPU rate (32x
    slower on v5e, 128x on v6e): the same uint32 mix written as a kernel came out slower than in XLA. The reference now pays for its own elementwise ops at the kernel's VPU rate, so the two agree."""
    spec = jax.ShapeDtypeStruct((2048, 1024), jnp.uint32)
    xla = estimate_xla(_mix, [spec], gen)
    kernel = estimate_pallas(jax.make_jaxpr(functools.partial(_mix_in_kernel, block_rows=256))(spec), gen)
    assert kernel.bound == "compute"
    assert xla.est_compute_floor_seconds is not None
    assert xla.est_compute_floor_extra_seconds > 0
    assert xla.est_compiler_seconds < 0.7 * kernel.estimated_seconds  # what the compiler alone says
    assert xla.estimated_seconds == pytest.approx(xla.est_compute_floor_seconds)
    assert xla.estimated_seconds == pytest.approx(kernel.estimated_seconds, rel=0.2)  # + steps, DMA
    assert any("elementwise work at the MXU peak" in n for n in xla.notes)


def test_the_compute_floor_leaves_matmuls_and_byte_bound_programs_alone() -> None:
    """A bf16 matmul is MXU-priced by the compiler already, and a single add is bound by its bytes: the
    floor (the same work at the block model's rates) is below both, so neither estimate moves."""
    mm = estimate_xla(jnp.dot, [((1024, 1024), BF16)] * 2, "v6e")
    add = estimate_xla(lambda a: a + 1.0, [((2048, 2048), jnp.float32)], "v6e")
    for est in (mm, add):
        assert est.est_compute_floor_seconds is not None
        assert est.est_compute_floor_extra_seconds == 0.0
        assert est.estimated_seconds >= est.est_compute_floor_seconds
    assert mm.est_compute_floor_seconds == pytest.approx(2 * 1024**3 / get_spec("v6e").device_peak_flops)


def _erfc_kernel(x_ref, o_ref):
    o_ref[...] = jax.lax.erfc(x_ref[...])


def _exp_kernel(x_ref, o_ref):
    o_ref[...] = jnp.exp(x_ref[...])


def test_erfc_in_a_kernel_pays_the_polynomial_xla_pays() -> None:
    """The compiler counts erfc as one transcendental plus a 60-flop polynomial (exp as one and none); a
    kernel's erfc is charged the same polynomial on the VPU, not one EUP op as if it were an exp."""
    spec = jax.ShapeDtypeStruct((512, 256), jnp.float32)

    def call(kernel):
        block = pl.BlockSpec((128, 256), lambda i: (i, 0))
        return lambda x: pl.pallas_call(kernel, grid=(4,), in_specs=[block], out_specs=block, out_shape=spec)(
            x
        )

    erfc = estimate_pallas(jax.make_jaxpr(call(_erfc_kernel))(spec), "v5e")
    exp = estimate_pallas(jax.make_jaxpr(call(_exp_kernel))(spec), "v5e")
    assert erfc.est_transcendentals == exp.est_transcendentals == 512 * 256
    assert exp.est_vpu_elementwise_ops == 0
    assert erfc.est_vpu_elementwise_ops == 60 * 512 * 256
    ref = estimate_xla(jax.lax.erfc, [spec], "v5e")
    assert ref.est_flops == pytest.approx(60 * 512 * 256)  # the compiler's own count the table copies


def test_a_highest_dot_fused_with_its_epilogue_pays_all_six_passes() -> None:
    """The precision surcharge counts a dot's own output bytes as already paid; when XLA fuses the
    epilogue (tanh, then a max over rows) that output never reaches HBM, and the surcharge came short of the
    six passes (fused_bmm_tanh_max on v6e: 734 us against 898 us of MXU work). The compute floor holds
    the reference to its full MXU time, which is what a kernel running the same dot pays."""
    a = ((4, 2048, 512), jnp.float32)
    c = ((4, 512, 1024), jnp.float32)

    def fn(x, y):
        prod = jnp.einsum("bmk,bkn->bmn", x, y, precision=jax.lax.Precision.HIGHEST)
        return jnp.max(jnp.tanh(prod), axis=1)

    est = estimate_xla(fn, [a, c], "v6e")
    six_passes = 6 * 2 * 4 * 2048 * 512 * 1024 / get_spec("v6e").device_peak_flops
    assert est.est_compute_floor_seconds == pytest.approx(six_passes, rel=0.01)
    assert est.estimated_seconds >= six_passes
    assert est.est_compute_floor_extra_seconds > 0  # the surcharge alone came short


def test_random_bits_cost_the_reference_what_the_compiler_counts() -> None:
    """A reference's `random_bits` is one equation; the compiler expands it into threefry's rounds (116
    flops per word with the xor below). The floor charges the reference RANDOM_BITS_VPU_OPS per word, the
    count a kernel computing the same bits is charged op by op, so the two sides pay for the same rounds."""
    from maxkernel.tools.estimate import RANDOM_BITS_VPU_OPS, _vpu_rate

    n = 1024 * 1024
    est = estimate_xla(
        lambda x: jax.random.bits(jax.random.key(3), x.shape, jnp.uint32) ^ x,
        [((1024, 1024), jnp.uint32)],
        "v5e",
    )
    assert est.est_flops == pytest.approx((RANDOM_BITS_VPU_OPS + 1) * n, rel=0.01)
    assert est.est_compute_floor_seconds == pytest.approx(
        (RANDOM_BITS_VPU_OPS + 1) * n / _vpu_rate(get_spec("v5e"))
    )
    assert est.estimated_seconds == pytest.approx(est.est_compute_floor_seconds)


def test_a_scatter_add_floor_counts_its_updates_not_the_array() -> None:
    """XLA scatters in place: the VPU work is the updates. Counted by the array it returns, a 64-row
    scatter-add into 65536 rows would charge the reference 1000x its work; counted through its combiner
    jaxpr alone, nothing."""
    from maxkernel.tools.estimate import _vpu_rate

    est = estimate_xla(
        lambda big, idx, upd: big.at[idx].add(upd),
        [((1 << 16, 128), jnp.float32), ((64,), jnp.int32), ((64, 128), jnp.float32)],
        "v5e",
    )
    ops = est.est_compute_floor_seconds * _vpu_rate(get_spec("v5e"))
    assert 64 * 128 <= ops <= 2 * 64 * 128


def _chain(kind: str, x):
    """One block of 512 x 1024 through eight multiply-adds (or eight exps), in x's dtype."""

    def body(x_ref, o_ref):
        y = x_ref[...]
        for _ in range(8):
            y = y * 1.25 + 0.5 if kind == "fma" else jnp.exp(y)
        o_ref[...] = y

    spec = pl.BlockSpec((512, 1024), lambda i: (i, 0))
    return pl.pallas_call(
        body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2,), in_specs=[spec], out_specs=spec
    )(x)


@pytest.mark.parametrize("gen", ["v5e", "v6e", "v4"])
def test_bf16_elementwise_is_priced_per_generation(gen: str) -> None:
    """The VPU cost of bf16 arithmetic follows the compiler's schedule (benchmarks/calibrate_vpu_slots.py):
    ~2.5x f32 where the VPU unpacks bf16 (v4, v5e), 0.7x where it computes on packed vregs (v6e); exps
    keep the EUP, which the unpack and repack slow down where there is no bf16 VPU."""
    spec = get_spec(gen)
    calls = {}
    for kind in ("fma", "exp"):
        for dtype in (jnp.float32, jnp.bfloat16):
            closed = jax.make_jaxpr(functools.partial(_chain, kind))(
                jax.ShapeDtypeStruct((1024, 1024), dtype)
            )
            (calls[kind, dtype],) = estimate_pallas(closed, gen).pallas_calls
    f32, bf16 = calls["fma", jnp.float32], calls["fma", jnp.bfloat16]
    assert bf16.est_vpu_seconds == pytest.approx(f32.est_vpu_seconds * spec.bf16_valu_cost)
    f32, bf16 = calls["exp", jnp.float32], calls["exp", jnp.bfloat16]
    assert bf16.est_eup_seconds == pytest.approx(f32.est_eup_seconds * spec.bf16_eup_cost)
    assert (spec.bf16_valu_cost > 2) == (gen in ("v4", "v5e"))


def test_glue_between_kernels_is_priced_as_xla_loop_fusions() -> None:
    """Slices, maps and a concatenation between two kernels are one XLA loop fusion: it reads the slices it
    takes of the first kernel's output and writes the concatenation once (op by op it would be charged
    every intermediate's write and read again). A value the fusion makes that a kernel also reads is
    written too; reshapes alone move nothing."""
    rows, cols = 1024, 256
    full = rows * cols * 2  # bf16 bytes of one [rows, cols] value

    def swap_halves(x):
        y = _times_two(x, (128, cols))
        a, b = y[:, : cols // 2], y[:, cols // 2 :]
        z = jnp.concatenate([b * 3.0, a], axis=1)
        return _times_two(z, (128, cols))

    est = _estimate(swap_halves, (rows, cols))
    assert est.est_xla_bytes == pytest.approx(2 * full)  # read y once (as two slices), write z once
    assert est.xla_op_count == 1
    assert any("loop fusion" in n for n in est.notes)

    def also_read(x):
        y = _times_two(x, (128, cols))
        b = y[:, cols // 2 :] * 3.0  # read by the second kernel and by the concatenation
        z = jnp.concatenate([b, y[:, : cols // 2]], axis=1)
        return _times_two(z, (128, cols)), _times_two(b, (128, cols // 2))

    est = _estimate(also_read, (rows, cols))
    assert est.est_xla_bytes == pytest.approx(2 * full + full // 2)

    def reshapes_only(x):
        y = _times_two(x, (128, cols))
        return _times_two(y.reshape(rows // 2, 2, cols).reshape(rows, cols), (128, cols))

    assert _estimate(reshapes_only, (rows, cols)).est_xla_bytes == 0
