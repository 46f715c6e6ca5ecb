"""3x3 conv2d + bias (NHWC, SAME), sigmoid, then sum over H and W -> [N, C_out] (float32)."""

import jax
import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.float32, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        n, hw, cin, cout = 64, 64, 128, 256
    else:
        n, hw, cin, cout = 2, 16, 64, 128
    k_x, k_w, k_b = jax.random.split(jax.random.key(205), 3)
    x = jax.random.normal(k_x, (n, hw, hw, cin), jnp.float32).astype(dtype)
    w = (jax.random.normal(k_w, (3, 3, cin, cout), jnp.float32) * (9 * cin) ** -0.5).astype(dtype)
    b = jax.random.normal(k_b, (cout,), jnp.float32).astype(dtype)
    return [x, w, b], []


def computation(x, w, b):
    y = lax.conv_general_dilated(
        x,
        w,
        (1, 1),
        "SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    return jnp.sum(jax.nn.sigmoid(y + b), axis=(1, 2)).astype(x.dtype)
