"""3x3x3 conv3d (NDHWC, SAME, no bias), training-mode BatchNorm over (N, D, H, W), hard-tanh
(clip to [-1, 1]), 2x2x2 average pool with stride 2 (float32)."""

import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.float32, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        n, d, hw, cin, cout = 4, 32, 64, 64, 64
    else:
        n, d, hw, cin, cout = 1, 8, 16, 32, 32
    k_x, k_w, k_g, k_b = jax.random.split(jax.random.key(209), 4)
    x = jax.random.normal(k_x, (n, d, hw, hw, cin), jnp.float32).astype(dtype)
    w = (jax.random.normal(k_w, (3, 3, 3, cin, cout), jnp.float32) * (27 * cin) ** -0.5).astype(dtype)
    gamma = (1.0 + 0.2 * jax.random.normal(k_g, (cout,), jnp.float32)).astype(dtype)
    beta = (0.2 * jax.random.normal(k_b, (cout,), jnp.float32)).astype(dtype)
    return [x, w, gamma, beta], [1e-5]


def computation(x, w, gamma, beta, eps):
    y = lax.conv_general_dilated(
        x,
        w,
        (1, 1, 1),
        "SAME",
        dimension_numbers=("NDHWC", "DHWIO", "NDHWC"),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    mean = jnp.mean(y, axis=(0, 1, 2, 3), keepdims=True)
    var = jnp.mean(jnp.square(y - mean), axis=(0, 1, 2, 3), keepdims=True)
    y = jnp.clip((y - mean) * lax.rsqrt(var + eps) * gamma + beta, -1.0, 1.0)
    n, d, h, wd, c = y.shape
    y = jnp.mean(y.reshape(n, d // 2, 2, h // 2, 2, wd // 2, 2, c), axis=(2, 4, 6))
    return y.astype(x.dtype)
