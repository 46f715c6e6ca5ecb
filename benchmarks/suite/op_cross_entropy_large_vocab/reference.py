"""Per-token softmax cross-entropy of logits over a large vocabulary against integer labels:
loss[t] = logsumexp(logits[t]) - logits[t, labels[t]] (float32)."""

import jax.numpy as jnp


def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        t, v = 4096, 128256
    else:
        t, v = 64, 1000
    k_x, k_l = jax.random.split(jax.random.key(17))
    logits = (jax.random.normal(k_x, (t, v), jnp.float32) * 2.0).astype(dtype)
    labels = jax.random.randint(k_l, (t,), 0, v, jnp.int32)
    return [logits, labels], []


def computation(logits, labels):
    lf = logits.astype(jnp.float32)
    m = jnp.max(lf, axis=-1, keepdims=True)
    lse = jnp.log(jnp.sum(jnp.exp(lf - m), axis=-1)) + m[:, 0]
    picked = jnp.take_along_axis(lf, labels[:, None], axis=-1)[:, 0]
    return lse - picked
