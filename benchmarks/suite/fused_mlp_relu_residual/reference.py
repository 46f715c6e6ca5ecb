"""Two-layer MLP block with residual: x + (relu(x @ w1 + b1) @ w2 + b2) (bfloat16 in/out)."""

import jax
import jax.numpy as jnp


def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        m, d, f = 8192, 2048, 8192
    else:
        m, d, f = 256, 256, 512
    ks = jax.random.split(jax.random.key(125), 5)
    x = jax.random.normal(ks[0], (m, d), jnp.float32).astype(dtype)
    w1 = (jax.random.normal(ks[1], (d, f), jnp.float32) * d**-0.5).astype(dtype)
    b1 = (0.5 * jax.random.normal(ks[2], (f,), jnp.float32)).astype(dtype)
    w2 = (jax.random.normal(ks[3], (f, d), jnp.float32) * f**-0.5).astype(dtype)
    b2 = (0.5 * jax.random.normal(ks[4], (d,), jnp.float32)).astype(dtype)
    return [x, w1, b1, w2, b2], []


def computation(x, w1, b1, w2, b2):
    f32 = jnp.float32
    h = jax.nn.relu(jnp.dot(x, w1, preferred_element_type=f32) + b1.astype(f32)).astype(x.dtype)
    y = jnp.dot(h, w2, preferred_element_type=f32) + b2.astype(f32)
    return (x.astype(f32) + y).astype(x.dtype)
