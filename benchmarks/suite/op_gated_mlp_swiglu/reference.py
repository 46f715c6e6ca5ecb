"""SwiGLU gated MLP (Llama feed-forward): down(silu(x @ W_gate) * (x @ W_up))."""

import jax
import jax.numpy as jnp


def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        t, d, f = 4096, 4096, 14336
    else:
        t, d, f = 128, 256, 512
    ks = jax.random.split(jax.random.key(10), 4)
    x = jax.random.normal(ks[0], (t, d), jnp.float32).astype(dtype)
    w_gate = (jax.random.normal(ks[1], (d, f), jnp.float32) * d**-0.5).astype(dtype)
    w_up = (jax.random.normal(ks[2], (d, f), jnp.float32) * d**-0.5).astype(dtype)
    w_down = (jax.random.normal(ks[3], (f, d), jnp.float32) * f**-0.5).astype(dtype)
    return [x, w_gate, w_up, w_down], []


def computation(x, w_gate, w_up, w_down):
    g = jnp.dot(x, w_gate, preferred_element_type=jnp.float32)
    u = jnp.dot(x, w_up, preferred_element_type=jnp.float32)
    h = (jax.nn.silu(g) * u).astype(x.dtype)
    return jnp.dot(h, w_down, preferred_element_type=jnp.float32).astype(x.dtype)
