"""Row softmax over a vocabulary-sized last axis that is not a multiple of 128
(GPT-2's 50257 on TPU, 1000 on CPU)."""

import jax.numpy as jnp


def get_inputs(dtype=jnp.float32, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        t, v = 4096, 50257
    else:
        t, v = 64, 1000
    x = (jax.random.normal(jax.random.key(16), (t, v), jnp.float32) * 3.0).astype(dtype)
    return [x], []


def computation(x):
    xf = x.astype(jnp.float32)
    e = jnp.exp(xf - jnp.max(xf, axis=-1, keepdims=True))
    return (e / jnp.sum(e, axis=-1, keepdims=True)).astype(x.dtype)
