"""DeepSeek-V3.2/V4-style sparse attention, prefill: each query attends to the K cache positions its
indexer selected (top-k indices, -1 = padding) of one shared latent KV (MQA: keys and values are the same
512-dim latent vectors for all heads), with a per-head attention sink (an extra logit in the softmax
denominator that has no value). Shapes after DeepSeek's published configuration: 64 heads of the latent
dim 512, top-k 512; prefill: chunks of
queries, each selecting among the positions up to its own (causal)."""

import jax
import jax.numpy as jnp


def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        b, s, h, d, skv, k = 2, 1024, 64, 512, 8192, 512
    else:
        b, s, h, d, skv, k = 2, 64, 8, 128, 256, 32
    kq, kkv, ks, ki, kn = jax.random.split(jax.random.key(301), 5)
    q = jax.random.normal(kq, (b, s, h, d), jnp.float32).astype(dtype)
    kv = jax.random.normal(kkv, (b, skv, d), jnp.float32).astype(dtype)
    sink = 3.0 + jax.random.normal(ks, (h,), jnp.float32)  # learned sinks take a real share of the mass
    # two chunks: a prompt's first (positions 0..s-1: fewer than K positions exist for its early queries,
    # whose last slots are padding, -1) and the last chunk of a long context; each query selects K
    # distinct positions up to its own (causal)
    del kn
    context = jnp.stack([1 + jnp.arange(s), skv - s + 1 + jnp.arange(s)])
    score = jax.random.uniform(ki, (b, s, skv))
    pos = jnp.arange(skv)
    score = jnp.where(pos[None, None, :] < context[..., None], score, -1.0)
    top, idx = jax.lax.top_k(score, k)
    topk = jnp.where(top >= 0, idx, -1).astype(jnp.int32)
    return [q, kv, sink, topk], [float(d) ** -0.5]


def computation(q, kv, sink, topk, sm_scale):
    """Written as another model family writes it: the selection gathered with take_along_axis, the sink
    appended to the logits as one more column of the softmax and dropped after it."""
    b, s, h, d = q.shape
    valid = topk >= 0
    rows = jnp.where(valid, topk, 0).reshape(b, -1, 1)
    picked = jnp.take_along_axis(kv, rows, axis=1).reshape(b, s, -1, d)  # [b, s, k, d]
    logits = jnp.einsum("bshd,bskd->bhsk", q, picked, preferred_element_type=jnp.float32) * sm_scale
    logits = jnp.where(valid[:, None], logits, -1e30)
    column = jnp.broadcast_to(sink[None, :, None, None], (b, h, s, 1))
    probs = jax.nn.softmax(jnp.concatenate([logits, column], axis=-1), axis=-1)[..., :-1]
    out = jnp.einsum("bhsk,bskd->bshd", probs.astype(kv.dtype), picked, preferred_element_type=jnp.float32)
    return out.astype(q.dtype)
