"""Grouped-query attention written with the K/V head repeat (`jnp.repeat(k, G, axis=heads)`), as production
references write it: the offline author's trace carries the head axis split into (K/V head, group)
(`authors.offline.head_groups`), so no repeated K/V exists in the program it writes, and the attention kernel
folds each group of query heads into one block. Checked at the trace (same values, no K/V-sized repeat, other
programs untouched) and through the real harness (three input sets, AOT Mosaic for v5e and v6e)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from offline_helpers import acceptance_options
from test_offline_author import TPU, synthesize_once

from maxkernel.authors.offline.head_groups import HeadGroups
from maxkernel.authors.offline.trace import flatten
from maxkernel.tools.harness import evaluate


def _seq_major(q, k, v):
    """[B, S, H, D] layout, repeat on axis 2, causal mask from `tril`, bf16-free f32 math."""
    b, s, hq, d = q.shape
    g = hq // k.shape[2]
    k = jnp.repeat(k[:, :, :, None, :], g, axis=3).reshape(b, k.shape[1], hq, d)
    v = jnp.repeat(v[:, :, :, None, :], g, axis=3).reshape(b, v.shape[1], hq, d)
    att = jnp.einsum("bqhd,bkhd->bhqk", q, k) * d**-0.5
    mask = jnp.tril(jnp.ones((s, k.shape[1])), k=k.shape[1] - s)
    att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", att, v)


def _head_major(q, k, v):
    """[B, H, S, D] layout, `jnp.repeat(k, G, axis=1)` directly, no mask, a bias added to the scores."""
    g = q.shape[1] // k.shape[1]
    k = jnp.repeat(k, g, axis=1)
    v = jnp.repeat(v, g, axis=1)
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k)
    bias = jnp.arange(k.shape[2], dtype=q.dtype) * 0.01
    p = jax.nn.softmax(s + bias, axis=-1)
    return jnp.einsum("bhqk,bhkd->bhqd", p, v)


CASES = {
    # (function, q shape, kv shape): the K/V length differs from the query length, so a repeated K/V has
    # a shape no other value of the program has
    "seq_major": (_seq_major, (2, 8, 8, 16), (2, 24, 2, 16)),
    "head_major": (_head_major, (1, 12, 8, 16), (1, 3, 40, 16)),
    "decode": (_seq_major, (3, 1, 16, 32), (3, 40, 4, 32)),  # one query token per sequence
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_trace_has_no_repeated_kv_and_same_values(name: str) -> None:
    fn, qs, ks = CASES[name]
    specs = [jax.ShapeDtypeStruct(s, jnp.float32) for s in (qs, ks, ks)]
    flat = flatten(fn, specs)
    hq = qs[2] if name != "head_major" else qs[1]
    seq_kv = ks[1] if name != "head_major" else ks[2]
    for eqn in flat.jaxpr.eqns:
        for v in eqn.outvars:
            shape = tuple(v.aval.shape)
            # a K/V with every query head: [.., Skv, .., Hq, ..] (any order) must not exist
            assert not (hq in shape and seq_kv in shape and ks[-1] in shape and len(shape) == 4), (
                eqn.primitive.name,
                shape,
            )
    rng = np.random.default_rng(3)
    args = [rng.standard_normal(s).astype(np.float32) for s in (qs, ks, ks)]
    want = np.asarray(fn(*args))
    got = np.asarray(jax.core.eval_jaxpr(flat.jaxpr, flat.consts, *args)[0])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_repeat_that_reaches_no_dot_is_left_alone() -> None:
    """A repeat that only feeds elementwise work (an upsampling) is not grouped heads: untouched."""

    def upsample(x, y):
        return jnp.repeat(x, 4, axis=1) * y

    specs = [jax.ShapeDtypeStruct((8, 16), jnp.float32), jax.ShapeDtypeStruct((8, 64), jnp.float32)]
    closed = jax.make_jaxpr(upsample)(*specs)
    assert not HeadGroups(closed.jaxpr, lambda v: None).active
    flat = flatten(upsample, specs)
    assert [e.primitive.name for e in flat.jaxpr.eqns] == [e.primitive.name for e in closed.jaxpr.eqns]


GQA_REPEAT = """
def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    b, s, hq, hkv, d = (2, 2048, 32, 4, 128) if scale == "tpu" else (1, 200, 6, 2, 64)
    ks = jax.random.split(jax.random.key(7), 3)
    q = jax.random.normal(ks[0], (b, s, hq, d), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (b, s, hkv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (b, s, hkv, d), jnp.float32).astype(dtype)
    return [q, k, v], []

def computation(q, k, v):
    b, s, hq, d = q.shape
    g = hq // k.shape[2]
    k = jnp.repeat(k, g, axis=2)
    v = jnp.repeat(v, g, axis=2)
    att = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * d ** -0.5
    causal = jnp.arange(s)[:, None] >= jnp.arange(s)[None, :]
    att = jax.nn.softmax(jnp.where(causal, att, -jnp.inf), axis=-1)
    o = jnp.einsum("bhqk,bkhd->bqhd", att.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.astype(q.dtype)
"""

_SYNTHESIZED: dict[str, tuple[str, object]] = {}


def test_repeated_kv_attention_folds_the_group_and_is_accepted(tmp_path: Path) -> None:
    source, task = synthesize_once(_SYNTHESIZED, "gqa_repeat", GQA_REPEAT, tmp_path, family="attention")
    assert "n_g, bq, n_d)" in source  # the group rides in the query block
    assert "broadcast" not in source.split("def computation", 1)[1]  # no repeat in the wrapper
    result = evaluate(task, source, acceptance_options(TPU), work_dir=tmp_path)  # type: ignore[arg-type]
    assert result.accepted, (result.error, source)
    assert result.correct and len(result.correctness.sets) == 3
    assert all(result.tpu_compile[g].ok for g in TPU)


@pytest.mark.parametrize("name", ["seq_major", "head_major"])
def test_a_group_of_one_at_the_validation_shapes_traces_the_same_program(name: str) -> None:
    """Validation may shrink the query heads to the K/V heads (a repeat of 1, which hides the repeat in the
    sizes): the rewrite is decided at the task's shapes and replayed, so both traces have one structure."""
    from maxkernel.authors.offline.trace import Config, trace_reference

    fn, qs, ks = CASES[name]
    heads = 2 if name == "seq_major" else 1
    small_q = list(qs)
    small_q[heads] = ks[heads]  # as many query heads as K/V heads: a group of one
    configs = [
        Config(dynamic=[(s, "float32") for s in (qs, ks, ks)], static=[]),
        Config(dynamic=[(tuple(s), "float32") for s in (small_q, ks, ks)], static=[]),
    ]
    traces = trace_reference(fn, configs, ["q", "k", "v"])
    assert len(traces.others) == 1
    small = traces.others[0]
    rng = np.random.default_rng(5)
    args = [rng.standard_normal(s).astype(np.float32) for s in (small_q, ks, ks)]
    got = np.asarray(jax.core.eval_jaxpr(small.jaxpr, small.consts, *args)[0])
    np.testing.assert_allclose(got, np.asarray(fn(*args)), rtol=1e-5, atol=1e-5)
