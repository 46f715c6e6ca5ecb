"""The block model and scalar prefetch (issue 12): with the task's own small integer inputs, index maps and
`pl.when` guards that read scalar prefetch are replayed step by step, so fetches a clamped index map skips
(the block index repeats: the pipeline issues no copy) and compute a guard skips are not charged; without
the values the model keeps its labelled upper bound. Small shapes, no execution of the kernels needed."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from maxkernel.authors.base import TileConfig
from maxkernel.authors.offline.lower import lower_program
from maxkernel.authors.offline.render import render
from maxkernel.authors.offline.trace import Config, trace_reference
from maxkernel.authors.offline.tuning import default_config
from maxkernel.tools import taskcode
from maxkernel.tools.estimate import estimate_pallas, topology_device

SUITE = Path(__file__).resolve().parents[1] / "benchmarks" / "suite"
BLOCK = (8, 128)


def _double_valid_rows(x, lengths):
    """x * 2 over the first sum(lengths) rows (in whole row blocks), zeros after: the row-block index map
    is clamped to the last block holding valid rows, and the compute is guarded by `pl.when`."""
    n_blocks = x.shape[0] // BLOCK[0]
    n_valid = jnp.sum(lengths).astype(jnp.int32).reshape(1)  # an XLA op between input and prefetch

    def last_block(n_ref):
        return jnp.maximum(lax.div(n_ref[0] + BLOCK[0] - 1, BLOCK[0]) - 1, 0)

    def x_index_map(i, n_ref):
        return (jnp.minimum(i, last_block(n_ref)), 0)

    def out_index_map(i, n_ref):
        return (i, 0)

    def kernel(n_ref, x_ref, o_ref):
        i = pl.program_id(0)

        @pl.when(i <= last_block(n_ref))
        def _work():
            o_ref[...] = jnp.exp(x_ref[...]) * 2.0

        @pl.when(i > last_block(n_ref))
        def _zero():
            o_ref[...] = jnp.zeros_like(o_ref)

    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(n_blocks,),
            in_specs=[pl.BlockSpec(BLOCK, x_index_map)],
            out_specs=pl.BlockSpec(BLOCK, out_index_map),
        ),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
    )(n_valid, x)


@pytest.mark.parametrize(("lengths", "n_rows"), [([20, 4, 0], 64), ([3], 40), ([40, 80], 120)])
def test_clamped_prefetch_index_map_and_guard_are_credited(lengths, n_rows) -> None:
    specs = (
        jax.ShapeDtypeStruct((n_rows, 128), jnp.float32),
        jax.ShapeDtypeStruct((len(lengths),), jnp.int32),
    )
    closed = jax.make_jaxpr(_double_valid_rows)(*specs)
    n_blocks = n_rows // BLOCK[0]
    needed = min(n_blocks, max(1, -(-sum(lengths) // BLOCK[0])))  # row blocks holding valid rows

    blind = estimate_pallas(closed, "v5e").pallas_calls[0]
    seen = estimate_pallas(closed, "v5e", {1: np.array(lengths, np.int32)}).pallas_calls[0]

    # Without the values: every step counted as a fetch, the dearer branch every step; both flagged.
    assert blind.operands[0].est_transfers == n_blocks and not blind.operands[0].index_map_exact
    assert any("upper bound" in n for n in blind.notes)
    # With them: exactly the blocks the clamped map asks for, and the exp only on the guarded steps.
    assert seen.operands[0].est_transfers == needed
    assert any("task's own prefetch values" in n for n in seen.notes)
    per_step_exp = BLOCK[0] * BLOCK[1]
    assert seen.est_transcendentals == pytest.approx(needed * per_step_exp)
    assert blind.est_transcendentals == pytest.approx(n_blocks * per_step_exp)
    assert seen.operands[1].est_transfers == n_blocks  # every output block is still written


def _grouped(lhs, rhs, group_sizes):
    return lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)


def _visits(sizes: list[int], m: int, bm: int) -> list[tuple[int, int, bool]]:
    """(group, row block, computes) of each live visit of the grouped matmul: every (group, row block) pair
    the group has rows in, in group order, then each row block past the last group's rows (zeros only)."""
    n_m = -(-m // bm)
    out, start = [], 0
    for g, size in enumerate(sizes):
        if size:
            out += [(g, b, True) for b in range(start // bm, (start + size - 1) // bm + 1)]
        start += size
    out += [(len(sizes) - 1, b, False) for b in range(-(-start // bm), n_m)]
    return out


def _fetches(seq: list[tuple[int, ...]]) -> int:
    """Copies a TPU pipeline issues for a block-index sequence: one where the index differs from the last."""
    return 1 + sum(a != b for a, b in zip(seq, seq[1:], strict=False))


def _generated_grouped(specs: list, bm: int, bn: int) -> dict:
    """The offline author's grouped matmul for `specs`, rendered with the given M and N blocks (K 128)."""
    program = lower_program(
        trace_reference(_grouped, [Config(dynamic=specs, static=[])], ["lhs", "rhs", "group_sizes"]), "t"
    )
    vals = default_config(program, ["v5e", "v6e"]).as_dict()
    vals.update({key: bm for key in vals if key.endswith("block_m")})
    vals.update({key: bn for key in vals if key.endswith("block_n")})
    vals.update({key: 128 for key in vals if key.endswith("block_k")})
    src = render(program, TileConfig.of(vals), ["v5e", "v6e"])
    ns: dict = {}
    exec(compile(src, "generated", "exec"), ns)
    return ns


@pytest.mark.parametrize(
    ("m", "k", "n", "sizes", "bm", "bn"),
    [
        (512, 256, 256, [100, 0, 300, 112], 128, 256),
        (400, 136, 300, [0, 50, 7, 37, 200, 0], 64, 128),  # empty first/last groups; rows past the last
        (1100, 128, 256, [100, 300, 0, 150, 500], 512, 128),  # 256-row chunks: partial visits skip some
    ],
)
def test_grouped_matmul_is_priced_from_its_group_sizes(m, k, n, sizes, bm, bn) -> None:
    """The generated grouped matmul at small shapes: its grid walks (N block, visit, K block) with at most
    M/bm + groups - 1 visits; with the group sizes the model charges the MXU only for the visits that
    compute and counts exactly the copies the repeated block indices leave out."""
    g = len(sizes)
    specs = [((m, k), "bfloat16"), ((g, k, n), "bfloat16"), ((g,), "int32")]
    ns = _generated_grouped(specs, bm, bn)
    closed = jax.make_jaxpr(ns["computation"])(*(jax.ShapeDtypeStruct(s, jnp.dtype(d)) for s, d in specs))

    blind = estimate_pallas(closed, "v5e").pallas_calls[0]
    seen = estimate_pallas(closed, "v5e", {2: np.array(sizes, np.int32)}).pallas_calls[0]
    n_n, n_t, n_k = blind.grid
    n_m = -(-m // bm)
    assert n_t == n_m + g - 1  # the visit axis, not row blocks x groups
    visits = _visits(sizes, m, bm)
    dead = [visits[-1]] * (n_t - len(visits))  # repeat the last live visit
    lhs_seq, rhs_seq = [], []
    for j in range(n_n):
        for t, (group, block, _) in enumerate(visits + dead):
            for kk in range(n_k):
                k_eff = kk if t < len(visits) else n_k - 1
                lhs_seq.append((block, k_eff))
                rhs_seq.append((group, k_eff, j))
    assert seen.operands[0].est_transfers == _fetches(lhs_seq)
    assert seen.operands[1].est_transfers == _fetches(rhs_seq)
    assert blind.operands[1].est_transfers == blind.est_grid_steps  # labelled upper bound without sizes
    chunk = 256 if bm % 256 == 0 else bm  # the kernel's guarded MXU chunk of rows
    chunk_flops = 2.0 * chunk * 128 * bn  # one guarded chunk: [chunk, bk] x [bk, bn]
    ends = np.cumsum(sizes)
    computing = 0  # (visit, chunk) pairs whose rows meet the visit's group
    for group, block, works in visits:
        for c in range(bm // chunk):
            lo = block * bm + c * chunk
            computing += works and ends[group] - sizes[group] < lo + chunk and ends[group] > lo
    assert seen.est_mxu_flops == pytest.approx(computing * n_k * n_n * chunk_flops)
    assert blind.est_mxu_flops == pytest.approx(blind.est_grid_steps * bm // chunk * chunk_flops)
    assert seen.estimated_seconds < blind.estimated_seconds


@pytest.mark.parametrize(
    ("m", "k", "n", "sizes", "bm", "bn"),
    [
        (256, 256, 256, [64, 0, 100, 92], 64, 128),  # aligned; an empty group; groups straddling blocks
        (300, 200, 300, [0, 45, 0, 100, 64, 0], 32, 128),  # odd; empty first/last; 91 rows in no group
        (96, 128, 128, [0, 0, 0], 32, 128),  # no rows in any group: all zeros
        (1100, 128, 128, [100, 300, 0, 150, 500], 512, 128),  # 256-row MXU chunks, each under its own guard
    ],
)
def test_grouped_matmul_visits_are_correct_and_compile(m, k, n, sizes, bm, bn) -> None:
    """Several N and K blocks, row blocks shared by up to three groups, rows in no group: interpret mode
    against lax.ragged_dot, then an ahead-of-time Mosaic compile for v5e and v6e."""
    g = len(sizes)
    specs = [((m, k), "float32"), ((g, k, n), "float32"), ((g,), "int32")]
    ns = _generated_grouped(specs, bm, bn)
    kernel = ns["computation"]
    rng = np.random.default_rng(3)
    lhs = rng.standard_normal((m, k)).astype(np.float32)
    rhs = (rng.standard_normal((g, k, n)) * k**-0.5).astype(np.float32)
    group_sizes = np.array(sizes, np.int32)
    with pltpu.force_tpu_interpret_mode():
        got = np.asarray(kernel(lhs, rhs, group_sizes))
    want = np.asarray(_grouped(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(group_sizes)))
    np.testing.assert_allclose(got, want, atol=2e-2, rtol=1e-2)
    for gen in ("v5e", "v6e"):
        sharding = jax.sharding.SingleDeviceSharding(topology_device(gen))
        avals = [jax.ShapeDtypeStruct(s, jnp.dtype(d), sharding=sharding) for s, d in specs]
        jax.jit(kernel).trace(*avals).lower().compile()


def test_small_integer_inputs_are_read_without_building_the_big_ones() -> None:
    """The suite's grouped matmul at its own (TPU) scale: 256 MiB of operands that jit's dead-code
    elimination never computes; the group sizes come back and sum to the row count."""
    ref = taskcode.Reference.of_task({"path": str(SUITE / "op_grouped_matmul"), "format": "maxkernel",
                                      "reference_path": str(SUITE / "op_grouped_matmul" / "reference.py")})  # fmt: skip
    (values,) = taskcode.small_int_inputs(ref, "tpu")
    assert set(values) == {2}
    sizes = np.array(values[2])
    assert sizes.shape == (8,) and sizes.min() >= 0 and sizes.sum() == 16384


def test_index_values_round_trip_for_scalars_and_vectors() -> None:
    """A scalar length and a vector of group sizes survive the JSON trip of a task's input configuration."""
    from maxkernel.tools.results import ArraySpec, InputConfig

    cfg = InputConfig(
        dynamic=[ArraySpec(shape=(), dtype="int32"), ArraySpec(shape=(3,), dtype="int32")],
        atol=1e-3,
        rtol=1e-3,
        index_values={0: np.asarray(np.int32(7)).tolist(), 1: np.array([1, 0, 5], np.int32).tolist()},
    )
    back = InputConfig.model_validate_json(cfg.model_dump_json())
    assert back.index_values == {0: 7, 1: [1, 0, 5]}


def test_prefetch_tables_built_while_tracing_are_read_as_constants() -> None:
    """A schedule table the wrapper computes while tracing (the live block pairs of a masked attention) is a
    constant of the program: the block model replays the index maps with it and charges one fetch per
    change of block index, not one per step (the labelled upper bound it keeps for data it cannot see)."""
    n_rows = 64
    rows = np.repeat(np.arange(n_rows // BLOCK[0], dtype=np.int32), 3)  # each row block visited 3 times

    def visit(x):
        table = jnp.asarray(rows)  # concrete while tracing: closed over as a constant

        def kernel(t_ref, x_ref, o_ref):
            o_ref[...] = x_ref[...] * 2.0

        return pl.pallas_call(
            kernel,
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1,
                grid=(len(rows),),
                in_specs=[pl.BlockSpec(BLOCK, lambda i, t: (t[i], 0))],
                out_specs=pl.BlockSpec(BLOCK, lambda i, t: (t[i], 0)),
            ),
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        )(table, x)

    closed = jax.make_jaxpr(visit)(jax.ShapeDtypeStruct((n_rows, 128), jnp.float32))
    assert closed.consts, "the table should be a constant of the traced program"
    call = estimate_pallas(closed, "v5e").pallas_calls[0]
    assert [o.est_transfers for o in call.operands] == [n_rows // BLOCK[0]] * 2
    assert all(o.index_map_exact for o in call.operands)
    assert not any("upper bound" in n for n in call.notes)
