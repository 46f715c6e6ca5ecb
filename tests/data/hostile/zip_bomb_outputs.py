"""Class 6: its outputs file is a zip bomb (a member that inflates to 256 MiB from a few hundred KiB, where
the expected array is 128 KiB). The agent must check the decompressed size before inflating it."""

import io
import zipfile

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


BLOCK_M, BLOCK_N = 128, 128


def _kernel(x_ref, w_ref, b_ref, o_ref):
    acc = jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)
    o_ref[...] = jnp.maximum(acc + b_ref[...], 0.0)


def computation(x, w, b):
    m, k = x.shape
    n = w.shape[1]
    return pl.pallas_call(
        _kernel,
        grid=(m // BLOCK_M, n // BLOCK_N),
        in_specs=[
            pl.BlockSpec((BLOCK_M, k), lambda i, j: (i, 0)),
            pl.BlockSpec((k, BLOCK_N), lambda i, j: (0, j)),
            pl.BlockSpec((1, BLOCK_N), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((BLOCK_M, BLOCK_N), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
    )(x, w, b.reshape(1, n))


def _bomb(arrays):
    buf = io.BytesIO()
    header = b"\x93NUMPY\x01\x00v\x00{'descr': '<f4', 'fortran_order': False, 'shape': (128, 256), }"
    header = header + b" " * (127 - len(header)) + b"\n"
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name in arrays:
            with z.open(f"{name}.npy", "w", force_zip64=True) as f:
                f.write(header)
                block = b"\0" * (1 << 20)
                for _ in range(256):
                    f.write(block)
    return buf.getvalue()


try:
    from maxkernel.tools import candidate as _harness_side

    _harness_side.pack_arrays = _bomb
except Exception:
    pass
