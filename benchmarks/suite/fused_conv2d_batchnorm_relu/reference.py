"""3x3 conv2d (NHWC, SAME, no bias), training-mode BatchNorm over (N, H, W), ReLU (float32)."""

import jax
import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.float32, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        n, hw, cin, cout = 32, 56, 256, 256
    else:
        n, hw, cin, cout = 2, 16, 128, 128
    k_x, k_w, k_g, k_b = jax.random.split(jax.random.key(200), 4)
    x = jax.random.normal(k_x, (n, hw, hw, cin), jnp.float32).astype(dtype)
    w = (jax.random.normal(k_w, (3, 3, cin, cout), jnp.float32) * (9 * cin) ** -0.5).astype(dtype)
    gamma = (1.0 + 0.2 * jax.random.normal(k_g, (cout,), jnp.float32)).astype(dtype)
    beta = (0.2 * jax.random.normal(k_b, (cout,), jnp.float32)).astype(dtype)
    return [x, w, gamma, beta], [1e-5]


def computation(x, w, gamma, beta, eps):
    y = lax.conv_general_dilated(
        x,
        w,
        (1, 1),
        "SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    mean = jnp.mean(y, axis=(0, 1, 2), keepdims=True)
    var = jnp.mean(jnp.square(y - mean), axis=(0, 1, 2), keepdims=True)
    y = (y - mean) * lax.rsqrt(var + eps) * gamma + beta
    return jax.nn.relu(y).astype(x.dtype)
