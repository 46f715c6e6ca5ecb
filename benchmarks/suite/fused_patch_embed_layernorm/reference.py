"""ViT patch embedding: 16x16 stride-16 conv2d (NHWC, 3 input channels) + bias, flatten patches to
tokens, add learned position embeddings, LayerNorm (bfloat16 in/out, float32 math)."""

import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        n, img, patch, cin, e = 512, 224, 16, 3, 768
    else:
        n, img, patch, cin, e = 2, 64, 16, 3, 128
    ks = jax.random.split(jax.random.key(210), 6)
    tokens = (img // patch) ** 2
    x = jax.random.normal(ks[0], (n, img, img, cin), jnp.float32).astype(dtype)
    fan_in = patch * patch * cin
    w = (jax.random.normal(ks[1], (patch, patch, cin, e), jnp.float32) * fan_in**-0.5).astype(dtype)
    b = (0.2 * jax.random.normal(ks[2], (e,), jnp.float32)).astype(dtype)
    pos = (0.5 * jax.random.normal(ks[3], (tokens, e), jnp.float32)).astype(dtype)
    gamma = (1.0 + 0.2 * jax.random.normal(ks[4], (e,), jnp.float32)).astype(dtype)
    beta = (0.2 * jax.random.normal(ks[5], (e,), jnp.float32)).astype(dtype)
    return [x, w, b, pos, gamma, beta], [1e-6]


def computation(x, w, b, pos, gamma, beta, eps):
    f32 = jnp.float32
    patch = w.shape[0]
    y = lax.conv_general_dilated(
        x, w, (patch, patch), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"), preferred_element_type=f32
    )
    n, gh, gw, e = y.shape
    y = y.reshape(n, gh * gw, e) + b.astype(f32) + pos.astype(f32)[None]
    mean = jnp.mean(y, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(y - mean), axis=-1, keepdims=True)
    y = (y - mean) * lax.rsqrt(var + eps) * gamma.astype(f32) + beta.astype(f32)
    return y.astype(x.dtype)
