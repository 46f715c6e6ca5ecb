"""UNet ResNet-block style: 3x3 conv2d + bias (NHWC, SAME), GroupNorm (32 groups over H, W and the
group's channels), SiLU (bfloat16 in/out, float32 math)."""

import jax
import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        n, hw, cin, cout = 32, 64, 320, 320
    else:
        n, hw, cin, cout = 2, 16, 128, 128
    ks = jax.random.split(jax.random.key(201), 5)
    x = jax.random.normal(ks[0], (n, hw, hw, cin), jnp.float32).astype(dtype)
    w = (jax.random.normal(ks[1], (3, 3, cin, cout), jnp.float32) * (9 * cin) ** -0.5).astype(dtype)
    b = (0.5 * jax.random.normal(ks[2], (cout,), jnp.float32)).astype(dtype)
    gamma = (1.0 + 0.2 * jax.random.normal(ks[3], (cout,), jnp.float32)).astype(dtype)
    beta = (0.2 * jax.random.normal(ks[4], (cout,), jnp.float32)).astype(dtype)
    return [x, w, b, gamma, beta], [32, 1e-5]


def computation(x, w, b, gamma, beta, groups, eps):
    f32 = jnp.float32
    y = lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), preferred_element_type=f32
    ) + b.astype(f32)
    n, h, wd, c = y.shape
    yg = y.reshape(n, h, wd, groups, c // groups)
    mean = jnp.mean(yg, axis=(1, 2, 4), keepdims=True)
    var = jnp.mean(jnp.square(yg - mean), axis=(1, 2, 4), keepdims=True)
    y = ((yg - mean) * lax.rsqrt(var + eps)).reshape(n, h, wd, c)
    y = y * gamma.astype(f32) + beta.astype(f32)
    return jax.nn.silu(y).astype(x.dtype)
