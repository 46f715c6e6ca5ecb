"""3x3 conv2d (NHWC, SAME, no bias), InstanceNorm (per sample and channel over H, W; no affine),
leaky ReLU (float32)."""

import jax
import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.float32, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        n, hw, cin, cout = 32, 128, 64, 128
    else:
        n, hw, cin, cout = 2, 16, 64, 128
    k_x, k_w = jax.random.split(jax.random.key(202))
    x = jax.random.normal(k_x, (n, hw, hw, cin), jnp.float32).astype(dtype)
    w = (jax.random.normal(k_w, (3, 3, cin, cout), jnp.float32) * (9 * cin) ** -0.5).astype(dtype)
    return [x, w], [1e-5, 0.2]


def computation(x, w, eps, negative_slope):
    y = lax.conv_general_dilated(
        x,
        w,
        (1, 1),
        "SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    mean = jnp.mean(y, axis=(1, 2), keepdims=True)
    var = jnp.mean(jnp.square(y - mean), axis=(1, 2), keepdims=True)
    y = (y - mean) * lax.rsqrt(var + eps)
    return jax.nn.leaky_relu(y, negative_slope).astype(x.dtype)
