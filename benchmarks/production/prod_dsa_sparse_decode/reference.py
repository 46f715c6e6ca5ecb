"""DeepSeek-V3.2/V4-style sparse attention, decode: each query attends to the K cache positions its
indexer selected (top-k indices, -1 = padding) of one shared latent KV (MQA: keys and values are the same
512-dim latent vectors for all heads), with a per-head attention sink (an extra logit in the softmax
denominator that has no value). Shapes after DeepSeek's published configuration: 64 heads of the latent
dim 512, top-k 512; decode: one query per sequence."""

import jax
import jax.numpy as jnp


def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        b, s, h, d, skv, k = 32, 1, 64, 512, 16384, 512
    else:
        b, s, h, d, skv, k = 4, 1, 8, 128, 512, 64
    kq, kkv, ks, ki, kn = jax.random.split(jax.random.key(301), 5)
    q = jax.random.normal(kq, (b, s, h, d), jnp.float32).astype(dtype)
    kv = jax.random.normal(kkv, (b, skv, d), jnp.float32).astype(dtype)
    sink = 3.0 + jax.random.normal(ks, (h,), jnp.float32)  # learned sinks take a real share of the mass
    # each query's selection: K distinct positions of its context, the last few slots padding (-1) for
    # sequences whose context is shorter than K
    context = jax.random.randint(kn, (b, s), k // 2, skv + 1)
    score = jax.random.uniform(ki, (b, s, skv))
    pos = jnp.arange(skv)
    score = jnp.where(pos[None, None, :] < context[..., None], score, -1.0)
    top, idx = jax.lax.top_k(score, k)
    topk = jnp.where(top >= 0, idx, -1).astype(jnp.int32)
    return [q, kv, sink, topk], [float(d) ** -0.5]


def computation(q, kv, sink, topk, sm_scale):
    valid = topk >= 0
    picked = jax.vmap(lambda cache, rows: cache[rows])(kv, jnp.where(valid, topk, 0))  # [b, s, k, d]
    logits = jnp.einsum("bshd,bskd->bshk", q, picked, preferred_element_type=jnp.float32) * sm_scale
    logits = jnp.where(valid[:, :, None, :], logits, -jnp.inf)
    sink_b = jnp.broadcast_to(sink[None, None, :, None], logits.shape[:-1] + (1,))
    top = jnp.maximum(jnp.max(logits, axis=-1, keepdims=True), sink_b)
    e = jnp.exp(logits - top)
    denom = jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink_b - top)
    probs = (e / denom).astype(kv.dtype)
    out = jnp.einsum("bshk,bskd->bshd", probs, picked, preferred_element_type=jnp.float32)
    return out.astype(q.dtype)
