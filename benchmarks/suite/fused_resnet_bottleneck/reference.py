"""ResNet-50 bottleneck block (NHWC): 1x1 conv -> BN -> ReLU -> 3x3 conv -> BN -> ReLU -> 1x1 conv
-> BN -> + identity -> ReLU, with training-mode BatchNorm (bfloat16 in/out, float32 statistics)."""

import jax
import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        n, hw, c, mid = 64, 56, 256, 64
    else:
        n, hw, c, mid = 2, 16, 128, 32
    ks = jax.random.split(jax.random.key(211), 10)

    def conv_w(key, kh, cin, cout):
        w = jax.random.normal(key, (kh, kh, cin, cout), jnp.float32) * (kh * kh * cin) ** -0.5
        return w.astype(dtype)

    def bn(k1, k2, size):
        g = 1.0 + 0.2 * jax.random.normal(k1, (size,), jnp.float32)
        b = 0.2 * jax.random.normal(k2, (size,), jnp.float32)
        return g.astype(dtype), b.astype(dtype)

    x = jax.random.normal(ks[0], (n, hw, hw, c), jnp.float32).astype(dtype)
    w1 = conv_w(ks[1], 1, c, mid)
    g1, b1 = bn(ks[2], ks[3], mid)
    w2 = conv_w(ks[4], 3, mid, mid)
    g2, b2 = bn(ks[5], ks[6], mid)
    w3 = conv_w(ks[7], 1, mid, c)
    g3, b3 = bn(ks[8], ks[9], c)
    return [x, w1, g1, b1, w2, g2, b2, w3, g3, b3], [1e-5]


def computation(x, w1, g1, b1, w2, g2, b2, w3, g3, b3, eps):
    f32 = jnp.float32

    def conv(t, w):
        return lax.conv_general_dilated(
            t, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), preferred_element_type=f32
        )

    def batch_norm(t, g, b):
        mean = jnp.mean(t, axis=(0, 1, 2), keepdims=True)
        var = jnp.mean(jnp.square(t - mean), axis=(0, 1, 2), keepdims=True)
        return (t - mean) * lax.rsqrt(var + eps) * g.astype(f32) + b.astype(f32)

    h = jax.nn.relu(batch_norm(conv(x, w1), g1, b1)).astype(x.dtype)
    h = jax.nn.relu(batch_norm(conv(h, w2), g2, b2)).astype(x.dtype)
    h = batch_norm(conv(h, w3), g3, b3)
    return jax.nn.relu(h + x.astype(f32)).astype(x.dtype)
