"""Paged decode attention in the JAXBench workload format (written for maxkernel's tests).

The page table and the lengths come from CONFIG: validated at smaller sizes, the task's own generator must
make a page table that indexes the smaller pool (random draws could not).
"""

import jax
import jax.numpy as jnp

CONFIG = {
    "name": "paged_decode",
    "num_seqs": 16,
    "pages_per_seq": 32,
    "page_size": 16,
    "num_heads": 8,
    "head_dim": 128,
}


def create_inputs(dtype=jnp.bfloat16):
    c = CONFIG
    k1, k2, k3 = jax.random.split(jax.random.key(7), 3)
    total_pages = c["num_seqs"] * c["pages_per_seq"]
    q = jax.random.normal(k1, (c["num_seqs"], c["num_heads"], c["head_dim"]), dtype)  # [s, h, d]
    pages = jax.random.normal(k2, (total_pages, c["page_size"], c["head_dim"]), dtype)  # [p, t, d]
    table = jax.random.permutation(k3, total_pages).astype(jnp.int32).reshape(c["num_seqs"], -1)
    lengths = jnp.full((c["num_seqs"],), c["pages_per_seq"] * c["page_size"] - 3, jnp.int32)
    return q, pages, table, lengths


def workload(q, pages, table, lengths):
    s, _, d = q.shape
    keys = pages[table].reshape(s, -1, d)  # [s, t, d]
    scores = jnp.einsum("shd,std->sht", q, keys, preferred_element_type=jnp.float32) / d**0.5
    live = jnp.arange(keys.shape[1])[None, None, :] < lengths[:, None, None]
    probs = jax.nn.softmax(jnp.where(live, scores, -1e30), axis=-1)
    return jnp.einsum("sht,std->shd", probs.astype(q.dtype), keys)
