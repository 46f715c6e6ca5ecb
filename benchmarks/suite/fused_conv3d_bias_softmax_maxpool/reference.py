"""3x3x3 conv3d + bias (NDHWC, SAME), softmax over channels, 2x2x2 max pool with stride 2
(bfloat16 in/out, float32 math)."""

import jax
import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        n, d, hw, cin, cout = 8, 32, 64, 32, 64
    else:
        n, d, hw, cin, cout = 2, 8, 16, 16, 32
    k_x, k_w, k_b = jax.random.split(jax.random.key(208), 3)
    x = jax.random.normal(k_x, (n, d, hw, hw, cin), jnp.float32).astype(dtype)
    w = (jax.random.normal(k_w, (3, 3, 3, cin, cout), jnp.float32) * 2.0 * (27 * cin) ** -0.5).astype(dtype)
    b = (0.5 * jax.random.normal(k_b, (cout,), jnp.float32)).astype(dtype)
    return [x, w, b], []


def computation(x, w, b):
    f32 = jnp.float32
    y = lax.conv_general_dilated(
        x, w, (1, 1, 1), "SAME", dimension_numbers=("NDHWC", "DHWIO", "NDHWC"), preferred_element_type=f32
    ) + b.astype(f32)
    y = jax.nn.softmax(y, axis=-1)
    n, d, h, wd, c = y.shape
    y = jnp.max(y.reshape(n, d // 2, 2, h // 2, 2, wd // 2, 2, c), axis=(2, 4, 6))
    return y.astype(x.dtype)
