"""Class 6: its outputs file is a zip bomb (a member that inflates to 256 MiB from a few hundred KiB, where
the expected array is 128 KiB). The agent must check the decompressed size before inflating it."""

import io
import zipfile

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def _kernel(x_ref, w_ref, b_ref, o_ref):
    o_ref[...] = jnp.maximum(jnp.dot(x_ref[...], w_ref[...]) + b_ref[...], 0.0)


def computation(x, w, b):
    m, n = x.shape[0], w.shape[1]
    return pl.pallas_call(_kernel, out_shape=jax.ShapeDtypeStruct((m, n), x.dtype))(x, w, b.reshape(1, n))


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
