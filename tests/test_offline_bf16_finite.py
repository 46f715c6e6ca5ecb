"""A bfloat16 value tested for finiteness inside a kernel (`jax.nn.logsumexp` shifts by
`where(isfinite(max), max, 0)`, a clamp chain ends in `isfinite`): Mosaic checks finiteness on float32 vectors
only (`'tpu.weird' op Input type must be F32`), so the offline author widens the operand first. Before, four
JAXBench fusion chains in bfloat16 (matmul + logsumexp + mish and the like) failed their TPU compile on every
repair and were never judged."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from offline_helpers import check_on_normal_inputs, compiles_at, load_module

from maxkernel.authors.offline.lower import lower_program
from maxkernel.authors.offline.trace import Config, trace_reference


def _bf16_chain(x, w):
    y = jnp.dot(x, w) * 2.0
    y = jnp.clip(y, -10.0, 10.0)
    lse = jax.nn.logsumexp(y, axis=-1, keepdims=True)
    return lse * jnp.tanh(jax.nn.softplus(lse))


def _finite_mask(x):
    return jnp.where(jnp.isfinite(x), x * 3.0, 0.0)


def _program(fn, shapes, names):
    configs = [Config(dynamic=[(s, "bfloat16") for s in case], static=[]) for case in shapes]
    return lower_program(trace_reference(fn, configs, list(names)), "t")


def test_isfinite_on_bf16_compiles_for_the_tpu_and_is_right() -> None:
    rng = np.random.default_rng(3)
    for fn, shapes, names in (
        (_bf16_chain, [((64, 256), (256, 512))], ("x", "w")),
        (_finite_mask, [((32, 512),)], ("x",)),
    ):
        src, kernel = load_module(_program(fn, shapes, names))
        assert "isfinite" in src, src
        compiles_at(kernel, shapes, jnp.bfloat16)
        check_on_normal_inputs(fn, kernel, shapes, jnp.bfloat16, rng, atol=3e-2, rtol=3e-2)
