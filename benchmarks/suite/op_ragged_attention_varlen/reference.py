"""Ragged (variable-length) causal attention over packed sequences: q/k/v are [tokens, heads, d]
holding several sequences back to back, with per-sequence lengths that sum to the token count."""

import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        tokens, h, d, n_seq = 8192, 32, 128, 8
    else:
        tokens, h, d, n_seq = 256, 4, 64, 4
    kq, kk, kv, kl = jax.random.split(jax.random.key(8), 4)
    q = jax.random.normal(kq, (tokens, h, d), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (tokens, h, d), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (tokens, h, d), jnp.float32).astype(dtype)
    cuts = jnp.sort(jax.random.choice(kl, jnp.arange(1, tokens), (n_seq - 1,), replace=False))
    bounds = jnp.concatenate([jnp.zeros((1,), cuts.dtype), cuts, jnp.full((1,), tokens, cuts.dtype)])
    seq_lens = jnp.diff(bounds).astype(jnp.int32)
    return [q, k, v, seq_lens], [float(d) ** -0.5]


def computation(q, k, v, seq_lens, sm_scale):
    tokens, h, d = q.shape
    seg = jnp.repeat(jnp.arange(seq_lens.shape[0]), seq_lens, total_repeat_length=tokens)
    pos = jnp.arange(tokens)
    allowed = (seg[:, None] == seg[None, :]) & (pos[:, None] >= pos[None, :])

    def one_head(args):
        qh, kh, vh = args  # [tokens, d]
        s = jnp.dot(qh, kh.T, preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST) * sm_scale
        s = jnp.where(allowed, s, -jnp.inf)
        p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
        p = p / jnp.sum(p, axis=-1, keepdims=True)
        return jnp.dot(p, vh.astype(jnp.float32), precision=lax.Precision.HIGHEST).astype(q.dtype)

    out = lax.map(one_head, (q.transpose(1, 0, 2), k.transpose(1, 0, 2), v.transpose(1, 0, 2)))
    return out.transpose(1, 0, 2)
