"""3x3 conv2d + bias (NHWC, SAME), hard-swish, 2x2 average pool with stride 2 (bfloat16 in/out)."""

import jax
import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        n, hw, cin, cout = 32, 112, 96, 192
    else:
        n, hw, cin, cout = 2, 16, 64, 128
    k_x, k_w, k_b = jax.random.split(jax.random.key(203), 3)
    x = jax.random.normal(k_x, (n, hw, hw, cin), jnp.float32).astype(dtype)
    w = (jax.random.normal(k_w, (3, 3, cin, cout), jnp.float32) * 2.0 * (9 * cin) ** -0.5).astype(dtype)
    b = (0.5 * jax.random.normal(k_b, (cout,), jnp.float32)).astype(dtype)
    return [x, w, b], []


def computation(x, w, b):
    f32 = jnp.float32
    y = lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), preferred_element_type=f32
    ) + b.astype(f32)
    y = jax.nn.hard_swish(y)
    n, h, wd, c = y.shape
    y = jnp.mean(y.reshape(n, h // 2, 2, wd // 2, 2, c), axis=(2, 4))
    return y.astype(x.dtype)
