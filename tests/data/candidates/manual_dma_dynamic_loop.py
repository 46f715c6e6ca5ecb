"""An honest kernel for tasks/small_abs_scale that copies its input by hand (manual DMA from HBM) inside a
loop whose trip count is a scalar read at run time: the pipeline's block model charges none of those
bytes, so its estimate must be withheld, with the reason, while the kernel is accepted."""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

CHUNK_ROWS = 8


def _abs_scale_kernel(n_chunks_ref, x_hbm_ref, o_ref, buf_ref, sem):
    def copy_chunk(c, carry):
        rows = pl.ds(pl.multiple_of(c * CHUNK_ROWS, CHUNK_ROWS), CHUNK_ROWS)
        dma = pltpu.make_async_copy(x_hbm_ref.at[rows], buf_ref, sem)
        dma.start()
        dma.wait()
        x = buf_ref[...]  # f32[CHUNK_ROWS, cols]
        o_ref[rows, :] = 2.0 * jnp.abs(x) + 1.0
        return carry

    lax.fori_loop(0, n_chunks_ref[0], copy_chunk, 0)


def computation(x):
    rows, cols = x.shape
    n_chunks = jnp.full((1,), rows // CHUNK_ROWS, jnp.int32)
    return pl.pallas_call(
        _abs_scale_kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(1,),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((rows, cols), lambda i, n: (0, 0)),
            scratch_shapes=[pltpu.VMEM((CHUNK_ROWS, cols), jnp.float32), pltpu.SemaphoreType.DMA],
        ),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
    )(n_chunks, x)
