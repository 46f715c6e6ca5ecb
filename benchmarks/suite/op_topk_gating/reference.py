"""Top-k MoE gating: router logits x @ W_r, keep each token's top-k experts, softmax over the kept
logits, and return the dense [tokens, experts] gate matrix (zeros for unselected experts)."""

import jax
import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        t, d, e, top_k = 32768, 2048, 64, 6
    else:
        t, d, e, top_k = 256, 256, 16, 4
    k_x, k_w = jax.random.split(jax.random.key(22))
    x = jax.random.normal(k_x, (t, d), jnp.float32).astype(dtype)
    w_router = (jax.random.normal(k_w, (d, e), jnp.float32) * d**-0.5).astype(dtype)
    return [x, w_router], [top_k]


def computation(x, w_router, top_k):
    e = w_router.shape[1]
    logits = jnp.dot(x, w_router, preferred_element_type=jnp.float32)
    top_v, top_i = lax.top_k(logits, top_k)
    weights = jax.nn.softmax(top_v, axis=-1)
    return jnp.sum(jax.nn.one_hot(top_i, e, dtype=jnp.float32) * weights[..., None], axis=1)
