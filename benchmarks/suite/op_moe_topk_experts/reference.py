"""Top-k mixture-of-experts layer: softmax router, top-k experts per token (weights renormalised),
SwiGLU expert MLPs applied to the tokens routed to each expert, weighted combine."""

import jax
import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        t, d, f, e, top_k = 8192, 2048, 1024, 64, 8
    else:
        t, d, f, e, top_k = 128, 256, 128, 8, 2
    ks = jax.random.split(jax.random.key(11), 5)
    x = jax.random.normal(ks[0], (t, d), jnp.float32).astype(dtype)
    w_router = (jax.random.normal(ks[1], (d, e), jnp.float32) * d**-0.5).astype(dtype)
    w_gate = (jax.random.normal(ks[2], (e, d, f), jnp.float32) * d**-0.5).astype(dtype)
    w_up = (jax.random.normal(ks[3], (e, d, f), jnp.float32) * d**-0.5).astype(dtype)
    w_down = (jax.random.normal(ks[4], (e, f, d), jnp.float32) * f**-0.5).astype(dtype)
    return [x, w_router, w_gate, w_up, w_down], [top_k]


def computation(x, w_router, w_gate, w_up, w_down, top_k):
    t, d = x.shape
    e = w_router.shape[1]
    probs = jax.nn.softmax(jnp.dot(x, w_router, preferred_element_type=jnp.float32), axis=-1)
    top_w, top_i = lax.top_k(probs, top_k)  # [t, k]
    top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    flat_e = top_i.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)  # (token, slot) pairs grouped by expert
    tok = order // top_k
    group_sizes = jnp.bincount(flat_e, length=e).astype(jnp.int32)
    xs = x[tok]
    g = lax.ragged_dot(xs, w_gate, group_sizes, preferred_element_type=jnp.float32)
    u = lax.ragged_dot(xs, w_up, group_sizes, preferred_element_type=jnp.float32)
    h = (jax.nn.silu(g) * u).astype(x.dtype)
    y = lax.ragged_dot(h, w_down, group_sizes, preferred_element_type=jnp.float32)
    y = jnp.zeros_like(y).at[order].set(y).reshape(t, top_k, d)  # back to (token, slot) order
    out = jnp.sum(y * top_w[..., None], axis=1)
    return out.astype(x.dtype)
