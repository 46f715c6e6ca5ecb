"""A batch norm over a linear layer's rows (training mode: statistics over the batch, M) with more rows
than a row-wise kernel holds as whole columns: the one-pass moments make both statistics column sums of the
product, accumulated in the matmul kernel's epilogue with M walked sequentially, and one elementwise kernel
normalises (before: a row-wise kernel over (M, 128) column blocks that outgrew VMEM at 16384 rows). Correct
in TPU interpret mode at small shapes (several M blocks, a ragged last one), compiled for v5e and v6e at
the task's shape. Fewer rows keep the two-pass form in a row-wise kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from offline_helpers import check_on_normal_inputs, compiles_at, conv_program, load_module

from maxkernel.authors.offline.partition import COLUMN_WHOLE_ELEMS
from maxkernel.authors.offline.tuning import default_config


def gemm_batchnorm_gelu(x, w, b, g, beta):
    y = jnp.matmul(x, w.T) + b
    mean = jnp.mean(y, axis=0, keepdims=True)
    var = jnp.mean((y - mean) ** 2, axis=0, keepdims=True)
    return jax.nn.gelu((y - mean) / jnp.sqrt(var + 1e-5) * g + beta)


def _shapes(m: int, k: int, n: int):
    return [(m, k), (n, k), (n,), (n,), (n,)]


TASK = _shapes(2 * COLUMN_WHOLE_ELEMS, 256, 512)
SMALL = [_shapes(40, 64, 256), _shapes(24, 32, 128)]


def test_long_batch_norm_statistics_come_from_the_matmul_pass() -> None:
    program = conv_program(gemm_batchnorm_gelu, [TASK, *SMALL], "float32", names=("x", "w", "b", "g", "beta"))
    assert [k.family for k in program.kernels] == ["matmul_colreduce", "elementwise"]
    default = default_config(program, ["v5e", "v6e"])
    rows = next(k for k, _ in default.params if k.endswith("block_m"))
    for seed, config in enumerate([default, default.replace(**{rows: 16})]):  # then several M blocks, ragged
        _, kernel = load_module(program, config)
        check_on_normal_inputs(
            gemm_batchnorm_gelu,
            kernel,
            SMALL,
            jnp.float32,
            np.random.default_rng(seed + 1),
            scale=1.0,
            atol=1e-4,
            rtol=1e-4,
        )
    compiles_at(kernel, [TASK], jnp.float32)


def test_short_batch_norm_keeps_the_two_pass_row_wise_kernel() -> None:
    program = conv_program(
        gemm_batchnorm_gelu,
        [_shapes(COLUMN_WHOLE_ELEMS // 2, 256, 512)],
        "float32",
        names=("x", "w", "b", "g", "beta"),
    )
    assert [k.family for k in program.kernels] == ["matmul", "rowwise"]
