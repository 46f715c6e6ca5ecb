"""The block model prices a manual DMA by the view it copies. A `pl.ds(start, rows)` view of an HBM operand
with a start computed in the kernel used to be priced as the smallest ref of the copy (a semaphore: 28
bytes), so a kernel that streams its weights by hand looked as if it moved nothing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from maxkernel.tools.estimate import estimate_pallas

ROWS, K = 64, 512


def _kernel(starts_ref, x_hbm, o_ref, buf, sem):
    start = jnp.clip(starts_ref[pl.program_id(0)], 0, x_hbm.shape[0] - ROWS)
    copy = pltpu.make_async_copy(x_hbm.at[pl.ds(start, ROWS)], buf, sem.at[0])
    copy.start()
    copy.wait()
    o_ref[...] = buf[...] * 2.0


def windows(starts, x):
    steps = starts.shape[0]
    return pl.pallas_call(
        _kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(steps,),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((None, ROWS, K), lambda t, s: (t, 0, 0)),
            scratch_shapes=[pltpu.VMEM((ROWS, K), jnp.float32), pltpu.SemaphoreType.DMA((1,))],
        ),
        out_shape=jax.ShapeDtypeStruct((steps, ROWS, K), jnp.float32),
    )(starts, x)


def test_a_copy_of_rows_at_a_computed_start_is_priced_by_its_rows() -> None:
    steps = 16
    jaxpr = jax.make_jaxpr(windows)(
        jax.ShapeDtypeStruct((steps,), jnp.int32), jax.ShapeDtypeStruct((4096, K), jnp.float32)
    )
    call = estimate_pallas(jaxpr, "v5e").pallas_calls[0]
    assert call.est_manual_dma_bytes == steps * ROWS * K * 4
    assert call.est_hbm_bytes >= call.est_manual_dma_bytes
