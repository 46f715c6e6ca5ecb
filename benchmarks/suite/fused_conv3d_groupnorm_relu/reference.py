"""3x3x3 conv3d (NDHWC, SAME, no bias), GroupNorm (8 groups over D, H, W and the group's
channels) with affine, ReLU (float32)."""

import jax
import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.float32, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        n, d, hw, cin, cout = 4, 16, 64, 64, 64
    else:
        n, d, hw, cin, cout = 1, 8, 16, 32, 32
    k_x, k_w, k_g, k_b = jax.random.split(jax.random.key(207), 4)
    x = jax.random.normal(k_x, (n, d, hw, hw, cin), jnp.float32).astype(dtype)
    w = (jax.random.normal(k_w, (3, 3, 3, cin, cout), jnp.float32) * (27 * cin) ** -0.5).astype(dtype)
    gamma = (1.0 + 0.2 * jax.random.normal(k_g, (cout,), jnp.float32)).astype(dtype)
    beta = (0.2 * jax.random.normal(k_b, (cout,), jnp.float32)).astype(dtype)
    return [x, w, gamma, beta], [8, 1e-5]


def computation(x, w, gamma, beta, groups, eps):
    y = lax.conv_general_dilated(
        x,
        w,
        (1, 1, 1),
        "SAME",
        dimension_numbers=("NDHWC", "DHWIO", "NDHWC"),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    n, d, h, wd, c = y.shape
    yg = y.reshape(n, d, h, wd, groups, c // groups)
    mean = jnp.mean(yg, axis=(1, 2, 3, 5), keepdims=True)
    var = jnp.mean(jnp.square(yg - mean), axis=(1, 2, 3, 5), keepdims=True)
    y = ((yg - mean) * lax.rsqrt(var + eps)).reshape(n, d, h, wd, c) * gamma + beta
    return jax.nn.relu(y).astype(x.dtype)
