"""ConvNeXt block (NHWC): 7x7 depthwise conv + bias, LayerNorm over channels, Linear C->4C + GELU,
Linear 4C->C, per-channel layer scale, residual add (bfloat16 in/out, float32 math)."""

import jax
import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        n, hw, c = 128, 56, 128
    else:
        n, hw, c = 2, 16, 128
    ks = jax.random.split(jax.random.key(204), 10)
    x = jax.random.normal(ks[0], (n, hw, hw, c), jnp.float32).astype(dtype)
    dw_w = (jax.random.normal(ks[1], (7, 7, 1, c), jnp.float32) / 7.0).astype(dtype)
    dw_b = (0.2 * jax.random.normal(ks[2], (c,), jnp.float32)).astype(dtype)
    ln_g = (1.0 + 0.2 * jax.random.normal(ks[3], (c,), jnp.float32)).astype(dtype)
    ln_b = (0.2 * jax.random.normal(ks[4], (c,), jnp.float32)).astype(dtype)
    w1 = (jax.random.normal(ks[5], (c, 4 * c), jnp.float32) * c**-0.5).astype(dtype)
    b1 = (0.2 * jax.random.normal(ks[6], (4 * c,), jnp.float32)).astype(dtype)
    w2 = (jax.random.normal(ks[7], (4 * c, c), jnp.float32) * (4 * c) ** -0.5).astype(dtype)
    b2 = (0.2 * jax.random.normal(ks[8], (c,), jnp.float32)).astype(dtype)
    layer_scale = (0.5 + 0.1 * jax.random.normal(ks[9], (c,), jnp.float32)).astype(dtype)
    return [x, dw_w, dw_b, ln_g, ln_b, w1, b1, w2, b2, layer_scale], [1e-6]


def computation(x, dw_w, dw_b, ln_g, ln_b, w1, b1, w2, b2, layer_scale, eps):
    f32 = jnp.float32
    c = x.shape[-1]
    y = lax.conv_general_dilated(
        x,
        dw_w,
        (1, 1),
        "SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
        feature_group_count=c,
        preferred_element_type=f32,
    ) + dw_b.astype(f32)
    mean = jnp.mean(y, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(y - mean), axis=-1, keepdims=True)
    y = (y - mean) * lax.rsqrt(var + eps) * ln_g.astype(f32) + ln_b.astype(f32)
    h = jnp.dot(y.astype(x.dtype), w1, preferred_element_type=f32) + b1.astype(f32)
    h = jax.nn.gelu(h, approximate=False).astype(x.dtype)
    y = jnp.dot(h, w2, preferred_element_type=f32) + b2.astype(f32)
    return (x.astype(f32) + y * layer_scale.astype(f32)).astype(x.dtype)
