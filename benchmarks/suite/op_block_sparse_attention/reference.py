"""Block-sparse (non-causal) attention: an int {0,1} mask over [q_block, k_block] tiles per head
selects which key blocks each query block sees; diagonal blocks are always kept."""

import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        b, h, s, d, block = 4, 16, 4096, 128, 128
    else:
        b, h, s, d, block = 1, 2, 256, 64, 32
    kq, kk, kv, km = jax.random.split(jax.random.key(6), 4)
    q = jax.random.normal(kq, (b, h, s, d), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (b, h, s, d), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (b, h, s, d), jnp.float32).astype(dtype)
    nb = s // block
    block_mask = jax.random.bernoulli(km, 0.3, (h, nb, nb)).astype(jnp.int32)
    return [q, k, v, block_mask], [float(d) ** -0.5]


def computation(q, k, v, block_mask, sm_scale):
    s_q, s_k = q.shape[2], k.shape[2]
    nbq, nbk = block_mask.shape[1], block_mask.shape[2]
    keep = (block_mask != 0) | jnp.eye(nbq, nbk, dtype=bool)[None]
    dense = jnp.repeat(jnp.repeat(keep, s_q // nbq, axis=1), s_k // nbk, axis=2)  # [h, s_q, s_k]

    def one_batch(args):
        qb, kb, vb = args
        s = (
            jnp.einsum(
                "hqd,hkd->hqk", qb, kb, preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST
            )
            * sm_scale
        )
        s = jnp.where(dense, s, -jnp.inf)
        p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
        p = p / jnp.sum(p, axis=-1, keepdims=True)
        o = jnp.einsum("hqk,hkd->hqd", p, vb.astype(jnp.float32), precision=lax.Precision.HIGHEST)
        return o.astype(q.dtype)

    return lax.map(one_batch, (q, k, v))
