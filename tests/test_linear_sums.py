"""A cross-entropy written with `log_softmax` (`-sum(one_hot * log_softmax(x @ w))`) runs in one streamed
pass over the logits: `sum(w * (a - c)) = sum(w * a) - c * sum(w)` for shifts `c` constant along the sum
(linear_sums.py) leaves every reduction reading the logits alone, so the matmul kernel's epilogue keeps the
max and the log-sum-exp online and the [tokens, vocab] logits never reach HBM. Correct in TPU interpret mode
(f32 and bf16, one-hot and smoothed targets, a vocabulary spanning several blocks), compiled for v5e and v6e
at the task's shape."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from offline_helpers import check_interpreted, load_module

from maxkernel.authors.offline.trace import Config, trace_reference
from maxkernel.authors.offline.tuning import default_config


def linear_cross_entropy(hidden, weight, labels):
    log_probs = jax.nn.log_softmax(jnp.dot(hidden, weight), axis=-1)
    one_hot = jax.nn.one_hot(labels, weight.shape[-1])
    return jnp.mean(-jnp.sum(one_hot * log_probs, axis=-1))


def smoothed_cross_entropy(hidden, weight, targets):
    """Soft targets (a probability row per token): the weights are an input, not a mask."""
    log_probs = jax.nn.log_softmax(jnp.dot(hidden, weight), axis=-1)
    return -jnp.sum(targets * log_probs, axis=-1)


def _configs(fn, shapes, dtype):
    out = []
    for m, k, n in shapes:
        third = ((m,), "int32") if fn is linear_cross_entropy else ((m, n), dtype)
        out.append(Config(dynamic=[((m, k), dtype), ((k, n), dtype), third], static=[]))
    return out


TASK = (1024, 256, 32768)
SMALL = [(16, 32, 640), (8, 16, 256)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fn", [linear_cross_entropy, smoothed_cross_entropy])
def test_log_softmax_cross_entropy_is_one_pass_over_the_logits(fn, dtype) -> None:
    from maxkernel.authors.offline.lower import lower_program
    from maxkernel.authors.offline.partition import FUSION_LEVELS

    traced = trace_reference(fn, _configs(fn, [TASK, *SMALL], dtype), ["hidden", "weight", "labels"])
    program = lower_program(traced, "t", options=FUSION_LEVELS[0])
    first = program.kernels[0]
    assert first.family == "matmul_online_reduce"
    # the weights' own sum joins it too: after it only the (tokens,) losses are reduced
    assert len(program.kernels) <= 2
    # one shift of the logits is left, the one inside exp (online); the weighted sum reads the logits
    assert (
        sum(e.primitive.name == "sub" and e.outvars[0].aval.ndim == 2 for e in traced.primary.jaxpr.eqns) == 1
    )
    default = default_config(program, ["v5e", "v6e"])
    n_block = next(k for k, _ in default.params if k in ("block_n", "k0_block_n"))
    rng = np.random.default_rng(0)
    for config in [default, default.replace(**{n_block: 128})]:  # the vocabulary over several blocks
        _, kernel = load_module(program, config)
        for m, k, n in SMALL:
            hidden = jnp.asarray(rng.standard_normal((m, k)), dtype)
            weight = jnp.asarray(0.5 * rng.standard_normal((k, n)), dtype)
            if fn is linear_cross_entropy:
                third = jnp.asarray(rng.integers(0, n, (m,)), jnp.int32)
            else:
                third = jnp.asarray(jax.nn.softmax(jnp.asarray(rng.standard_normal((m, n)))), dtype)
            tol = 2e-2 if dtype == "bfloat16" else 1e-4
            check_interpreted(fn, kernel, [hidden, weight, third], atol=tol, rtol=tol)
    compiles_at_task(kernel, fn, dtype)


def compiles_at_task(kernel, fn, dtype) -> None:
    from offline_helpers import compiles

    m, k, n = TASK
    third = ((m,), jnp.int32) if fn is linear_cross_entropy else ((m, n), jnp.dtype(dtype))
    compiles(kernel, [((m, k), jnp.dtype(dtype)), ((k, n), jnp.dtype(dtype)), third])
