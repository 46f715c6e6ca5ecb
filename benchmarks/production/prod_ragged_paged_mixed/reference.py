"""Ragged paged attention for a continuous-batching step of Llama-3.1-8B (32 query heads, 8 KV heads,
head dim 128, pages of 16 tokens): the step's token buffer holds decode requests (one token each) and
chunked prefills (a few hundred tokens each), every sequence reading its own K/V pages through a page
table, causal within its context, and the outputs are added back into the buffer at the sequence's rows.
The per-slot query capacities are fixed (the scheduler's plan); the starts, context lengths and page
table are data."""

import math

import jax
import jax.numpy as jnp
from jax import lax

CAPACITIES = (1,) * 24 + (256,) * 3 + (232,)
"""Query rows per sequence slot: 24 decodes, then prefill chunks (sum: 1024 tokens, the step's budget)."""


def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    import jax
    import jax.numpy as jnp
    import numpy as np

    caps = (1,) * 24 + (256,) * 3 + (232,)
    if scale == "tpu":
        hq, hkv, d, page, per_seq, pool = 32, 8, 128, 16, 256, 8192
    else:
        hq, hkv, d, page, per_seq, pool = 4, 2, 128, 16, 16, 512
    n_seq = len(caps)
    max_ctx = page * per_seq
    kq, kkv, kp, kl = jax.random.split(jax.random.key(304), 4)
    tokens = jax.random.normal(kq, (sum(caps), hq, d), jnp.float32).astype(dtype)
    pages = jax.random.normal(kkv, (pool, page, 2 * hkv, d), jnp.float32).astype(dtype)
    # contexts: decodes anywhere in the cache, ending mid-page; prefill chunks end at their context
    decode_ctx = jax.random.randint(kl, (24,), 1, max_ctx + 1)
    prefill_ctx = jnp.array([c + (max_ctx - c) // (i + 2) for i, c in enumerate(caps[24:])], jnp.int32)
    lengths = jnp.concatenate([decode_ctx, jnp.minimum(prefill_ctx, max_ctx)]).astype(jnp.int32)
    table = jax.random.permutation(kp, pool)[: n_seq * per_seq].reshape(n_seq, per_seq).astype(jnp.int32)
    starts = jnp.asarray(np.concatenate([[0], np.cumsum(caps)]), jnp.int32)
    return [tokens, pages, lengths, table, starts], [float(d) ** -0.5]


def computation(tokens, pages, lengths, table, starts, sm_scale):
    n_tok, hq, d = tokens.shape
    hkv = pages.shape[2] // 2
    out = jnp.zeros_like(tokens)
    for slot, cap in enumerate(CAPACITIES):
        count = starts[slot + 1] - starts[slot]
        rows = jnp.minimum(starts[slot] + jnp.arange(cap, dtype=jnp.int32), n_tok - 1)
        kv = pages[table[slot]]  # [pages, page, 2 * hkv, d]
        k = kv[:, :, :hkv].reshape(-1, hkv, d)
        v = kv[:, :, hkv:].reshape(-1, hkv, d)
        q = tokens[rows].reshape(cap, hkv, hq // hkv, d)
        logits = jnp.einsum("qhgd,khd->hgqk", q, k, preferred_element_type=jnp.float32) * sm_scale
        qpos = (lengths[slot] - count) + lax.broadcasted_iota(jnp.int32, logits.shape, 2)
        kpos = lax.broadcasted_iota(jnp.int32, logits.shape, 3)
        logits = jnp.where((kpos <= qpos) & (kpos < lengths[slot]), logits, -math.inf)
        probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        o = jnp.einsum("hgqk,khd->qhgd", probs, v, preferred_element_type=jnp.float32).reshape(cap, hq, d)
        o = jnp.where((jnp.arange(cap) < count)[:, None, None], o, 0.0).astype(tokens.dtype)
        out = out.at[rows].add(o)
    return out
