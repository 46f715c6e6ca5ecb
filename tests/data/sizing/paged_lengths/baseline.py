"""Paged decode attention in the JAXBench workload format (written for maxkernel's tests) whose lengths come
from a literal of their own, `max_len`, not from the page arithmetic: no input's shape has it, so only
halving it together with `pages_per_seq` keeps the lengths within the smaller pages.
"""

import jax
import jax.numpy as jnp

CONFIG = {
    "name": "paged_lengths",
    "num_seqs": 8,
    "max_len": 512,
    "pages_per_seq": 32,
    "page_size": 16,
    "num_heads": 8,
    "head_dim": 128,
}


def create_inputs(dtype=jnp.bfloat16):
    c = CONFIG
    k1, k2 = jax.random.split(jax.random.key(3), 2)
    total_pages = c["num_seqs"] * c["pages_per_seq"]
    q = jax.random.normal(k1, (c["num_seqs"], c["num_heads"], c["head_dim"]), dtype)
    pages = jax.random.normal(k2, (total_pages, c["page_size"], c["head_dim"]), dtype)
    table = jnp.arange(total_pages, dtype=jnp.int32).reshape(c["num_seqs"], -1)
    lengths = jnp.full((c["num_seqs"],), c["max_len"], jnp.int32)
    return q, pages, table, lengths


def workload(q, pages, table, lengths):
    s, _, d = q.shape
    keys = pages[table].reshape(s, -1, d)
    scores = jnp.einsum("shd,std->sht", q, keys, preferred_element_type=jnp.float32) / d**0.5
    live = jnp.arange(keys.shape[1])[None, None, :] < lengths[:, None, None]
    probs = jax.nn.softmax(jnp.where(live, scores, -1e30), axis=-1)
    return jnp.einsum("sht,std->shd", probs.astype(q.dtype), keys)
