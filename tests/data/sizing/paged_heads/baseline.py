"""Paged grouped-query decode with the heads inside each page, in the JAXBench workload format (written for
maxkernel's tests): the pool is [pages, page tokens, K/V heads, head dim], so the page's token count is a
leading axis that a plain shrink would halve like any count.
"""

import jax
import jax.numpy as jnp

CONFIG = {
    "name": "paged_heads",
    "num_seqs": 8,
    "pages_per_seq": 64,
    "page_size": 16,
    "num_q_heads": 8,
    "num_kv_heads": 2,
    "head_dim": 128,
}


def create_inputs(dtype=jnp.bfloat16):
    c = CONFIG
    k1, k2, k3 = jax.random.split(jax.random.key(11), 3)
    total = c["num_seqs"] * c["pages_per_seq"]
    q = jax.random.normal(k1, (c["num_seqs"], c["num_q_heads"], c["head_dim"]), dtype)
    k_pages = jax.random.normal(k2, (total, c["page_size"], c["num_kv_heads"], c["head_dim"]), dtype)
    v_pages = jax.random.normal(k3, (total, c["page_size"], c["num_kv_heads"], c["head_dim"]), dtype)
    table = jnp.arange(total, dtype=jnp.int32).reshape(c["num_seqs"], c["pages_per_seq"])
    return q, k_pages, v_pages, table


def workload(q, k_pages, v_pages, table):
    s, hq, d = q.shape
    hkv = k_pages.shape[2]
    k = jnp.repeat(k_pages[table].reshape(s, -1, hkv, d), hq // hkv, axis=2)  # [s, t, hq, d]
    v = jnp.repeat(v_pages[table].reshape(s, -1, hkv, d), hq // hkv, axis=2)
    scores = jnp.einsum("shd,sthd->sht", q, k, preferred_element_type=jnp.float32) / d**0.5
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("sht,sthd->shd", probs.astype(q.dtype), v)
