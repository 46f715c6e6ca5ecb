"""Ragged (variable-length, packed) attention: segment ids from `jnp.repeat(arange(n_seq), seq_lens)`, a
same-segment-and-causal mask `seg[:, None] == seg[None, :]`, one head at a time.

Two rewrites make it a kernel at all (it was unsupported): a cumulative op over a long 1-D axis runs in two
levels (chunks of CUMULATIVE_CHUNK, then the chunk totals), and an integer vector broadcast along two axes
reads a copy for the second one, so the query and key axes stay apart. The long scan is checked against
`jnp.cumsum` / `lax.cummax` / `lax.cummin` at odd lengths; the whole kernel goes through the real harness
(TPU interpret mode on CPU, three input sets, AOT Mosaic compile for v5e and v6e) at an aligned and an
odd token count.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from offline_helpers import acceptance_options
from test_offline_author import TPU, synthesize_once

from maxkernel.authors.offline import trace
from maxkernel.tools.estimate import estimate_pallas
from maxkernel.tools.harness import evaluate

RAGGED = """
def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    tokens, h, d, n_seq = (1024, 2, 128, 5) if scale == "tpu" else SMALL
    kq, kk, kv, kl = jax.random.split(jax.random.key(61), 4)
    q = jax.random.normal(kq, (tokens, h, d), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (tokens, h, d), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (tokens, h, d), jnp.float32).astype(dtype)
    cuts = jnp.sort(jax.random.choice(kl, jnp.arange(1, tokens), (n_seq - 1,), replace=False))
    bounds = jnp.concatenate([jnp.zeros((1,), cuts.dtype), cuts, jnp.full((1,), tokens, cuts.dtype)])
    return [q, k, v, jnp.diff(bounds).astype(jnp.int32)], [float(d) ** -0.5]

def computation(q, k, v, seq_lens, sm_scale):
    tokens = q.shape[0]
    seg = jnp.repeat(jnp.arange(seq_lens.shape[0]), seq_lens, total_repeat_length=tokens)
    pos = jnp.arange(tokens)
    allowed = (seg[:, None] == seg[None, :]) & (pos[:, None] >= pos[None, :])

    def one_head(args):
        qh, kh, vh = args
        s = jnp.dot(qh, kh.T, preferred_element_type=jnp.float32) * sm_scale
        s = jnp.where(allowed, s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        return jnp.dot(p, vh.astype(jnp.float32)).astype(q.dtype)

    out = lax.map(one_head, (q.transpose(1, 0, 2), k.transpose(1, 0, 2), v.transpose(1, 0, 2)))
    return out.transpose(1, 0, 2)
"""

CASES = {
    # both sizes above CUMULATIVE_CHUNK, so the segment-id scan has the same two-level form in each
    "ragged_aligned": RAGGED.replace("SMALL", "(256, 2, 64, 4)"),
    "ragged_odd": RAGGED.replace("SMALL", "(200, 3, 64, 3)"),  # pads the scan; a padded key block
}

_SYNTHESIZED: dict[str, tuple[str, object]] = {}


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("attention-ragged")


# The default run judges the odd case (the scan padded, a padded key block); ragged_aligned (the same kernel,
# nothing padded) runs with `-m slow`: each case is a whole harness evaluation.
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n == "ragged_aligned" else n for n in CASES]
)
def test_ragged_attention_is_correct_and_compiles(name: str, work: Path) -> None:
    source, task = synthesize_once(_SYNTHESIZED, name, CASES[name], work, family="attention")
    result = evaluate(task, source, acceptance_options(TPU), work_dir=work)  # type: ignore[arg-type]
    assert result.accepted, (result.error, source)
    assert result.correct and len(result.correctness.sets) == 3
    assert all(result.tpu_compile[g].ok for g in TPU)


def _reference(name: str, x: jax.Array, axis: int, reverse: bool) -> jax.Array:
    if name == "cumsum":
        return jax.lax.cumsum(x, axis=axis, reverse=reverse)
    return (jax.lax.cummax if name == "cummax" else jax.lax.cummin)(x, axis=axis, reverse=reverse)


@pytest.mark.parametrize("name", ["cumsum", "cummax", "cummin"])
@pytest.mark.parametrize("reverse", [False, True])
def test_long_cumulative_ops_in_two_levels_match_jax(name: str, reverse: bool) -> None:
    """Odd lengths (padded to whole chunks) and a length that divides them; 1-D (two levels above 128)
    and 2-D along axis 0 (two levels above CUMULATIVE_MAX_LEN)."""
    for n in (129, 300, 1024):
        x = jax.random.randint(jax.random.key(n), (n,), -50, 50).astype(jnp.int32)
        got = trace._cumulative_as_masked_reduce(x, name, 0, reverse)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(_reference(name, x, 0, reverse)))
    n = trace.CUMULATIVE_MAX_LEN + 5
    xf = jax.random.normal(jax.random.key(3), (n, 2))
    got = trace._cumulative_as_masked_reduce(xf, name, 0, reverse)
    np.testing.assert_allclose(
        np.asarray(got), np.asarray(_reference(name, xf, 0, reverse)), rtol=1e-4, atol=1e-3
    )


def test_long_scan_has_the_same_operations_at_every_length() -> None:
    """The author requires one jaxpr structure across a task's shapes: the two-level form must not change
    with n (no pad or slice appearing only when the chunk does not divide n)."""

    def prims(n: int) -> list[str]:
        jaxpr = jax.make_jaxpr(lambda x: trace._cumulative_as_masked_reduce(x, "cumsum", 0, False))(
            jax.ShapeDtypeStruct((n,), jnp.int32)
        )
        return [e.primitive.name for e in jaxpr.jaxpr.eqns]

    assert prims(256) == prims(8192) == prims(300)


def test_block_model_sees_only_causal_live_pairs(work: Path) -> None:
    """At 4096 tokens the grid walks only the (q block, key block) pairs the causal half of the mask leaves
    alive (about half), though the same-segment half is read from an operand."""
    source, _ = synthesize_once(
        _SYNTHESIZED, "ragged_aligned", CASES["ragged_aligned"], work, family="attention"
    )
    path = work / "ragged_kernel.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    bq = next(getattr(mod, n) for n in dir(mod) if n.endswith("BLOCK_Q"))
    bkv = next(getattr(mod, n) for n in dir(mod) if n.endswith("BLOCK_KV"))
    tokens, h, d = 4096, 2, 128
    live = sum(1 for i in range(tokens // bq) for j in range(tokens // bkv) if j * bkv <= i * bq + bq - 1)
    assert live < (tokens // bq) * (tokens // bkv)
    x = jax.ShapeDtypeStruct((tokens, h, d), jnp.bfloat16)
    lens = jax.ShapeDtypeStruct((5,), jnp.int32)
    closed = jax.make_jaxpr(lambda q, k, v, n: mod.computation(q, k, v, n, d**-0.5))(x, x, x, lens)  # type: ignore[attr-defined]
    (call,) = [c for c in estimate_pallas(closed, "v5e").pallas_calls if "attention" in c.name]
    assert call.est_grid_steps == h * live, (call.grid, live)


def test_a_scan_on_both_sides_of_the_chunk_length_is_one_program() -> None:
    """The task's own length (2048) picks the two-level form and the validation length (64) replays it:
    one structure, so the author does not refuse a task whose CPU-scale scan is short (each trace deciding
    for itself gave two programs); both traces still compute the prefix sum."""

    def computation(x: jax.Array) -> jax.Array:
        return jnp.cumsum(x) * 2

    configs = [trace.Config(dynamic=[((n,), "int32")], static=[]) for n in (2048, 64)]
    traces = trace.trace_reference(computation, configs, ["x"])
    assert trace.structure(traces.primary) == trace.structure(traces.others[0])
    for closed, n in ((traces.primary, 2048), (traces.others[0], 64)):
        x = jax.random.randint(jax.random.key(n), (n,), -50, 50).astype(jnp.int32)
        (got,) = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, x)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.cumsum(x) * 2))
