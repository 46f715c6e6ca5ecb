"""LM head + cross-entropy: logits = h @ W_vocab, per-token loss logsumexp(logits) - logits[label]
(float32). The CPU-scale vocabulary (1003) is deliberately not a multiple of 128."""

import jax.numpy as jnp


def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        t, d, v = 8192, 4096, 32000
    else:
        t, d, v = 64, 256, 1003
    k_h, k_w, k_l = jax.random.split(jax.random.key(120), 3)
    h = jax.random.normal(k_h, (t, d), jnp.float32).astype(dtype)
    w_vocab = (jax.random.normal(k_w, (d, v), jnp.float32) * 2.0 * d**-0.5).astype(dtype)
    labels = jax.random.randint(k_l, (t,), 0, v, jnp.int32)
    return [h, w_vocab, labels], []


def computation(h, w_vocab, labels):
    logits = jnp.dot(h, w_vocab, preferred_element_type=jnp.float32)
    m = jnp.max(logits, axis=-1, keepdims=True)
    lse = jnp.log(jnp.sum(jnp.exp(logits - m), axis=-1)) + m[:, 0]
    picked = jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
    return lse - picked
