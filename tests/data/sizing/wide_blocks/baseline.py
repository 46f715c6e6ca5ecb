"""Causal attention in the JAXBench workload format (maxkernel test), for kernels tuned with 2048-wide
blocks: a batch of 4 (a small count), a sequence of 4096, 8 heads of 128. The default search halves the
sequence past 2048 before it touches the batch; `--scale tiles` halves the batch first."""

import jax
import jax.numpy as jnp

CONFIG = {"name": "wide_blocks", "batch": 4, "seq_len": 4096, "num_heads": 8, "head_dim": 128}


def create_inputs(dtype=jnp.bfloat16):
    b, s, h, d = CONFIG["batch"], CONFIG["seq_len"], CONFIG["num_heads"], CONFIG["head_dim"]
    keys = jax.random.split(jax.random.key(7), 3)
    return tuple(jax.random.normal(k, (b, h, s, d), dtype) for k in keys)


def workload(q, k, v):
    s = q.shape[2]
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    causal = jnp.tril(jnp.ones((s, s), bool))
    scores = jnp.where(causal, scores, -1e9)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, axis=-1), v)
