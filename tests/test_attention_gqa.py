"""Grouped-query attention in the offline author: the query heads that share one K/V head ride in one query
block ([group, bq, d] against one [bkv, d] key block), so each K/V block is fetched once per group.

Each kernel goes through the real harness (TPU interpret mode on CPU, three input sets, AOT Mosaic compile
for v5e and v6e) at aligned and odd shapes; the block model is asked whether it sees one K/V fetch per
group rather than one per query head.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from offline_helpers import acceptance_options
from test_offline_author import TPU, synthesize_once

from maxkernel.tools.estimate import estimate_pallas
from maxkernel.tools.harness import evaluate

GQA = """
def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    b, hq, hkv, s, d = (2, 16, 4, 2048, 128) if scale == "tpu" else SMALL
    ks = jax.random.split(jax.random.key(31), 3)
    q = jax.random.normal(ks[0], (b, hq, s, d), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (b, hkv, s, d), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (b, hkv, s, d), jnp.float32).astype(dtype)
    return [q, k, v], [float(d) ** -0.5]

def computation(q, k, v, sm_scale):
    b, hq, s, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, hkv, hq // hkv, s, d)
    s_ = jnp.einsum("bhgqd,bhkd->bhgqk", qg, k, preferred_element_type=jnp.float32) * sm_scale
    causal = jnp.arange(s)[:, None] >= jnp.arange(k.shape[2])[None, :]
    s_ = jnp.where(causal, s_, -jnp.inf)
    p = jax.nn.softmax(s_, axis=-1)
    o = jnp.einsum("bhgqk,bhkd->bhgqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(b, hq, s, d).astype(q.dtype)
"""

CASES = {
    # several q and key blocks; the odd case divides neither block nor the (8, 128) tile
    "gqa_aligned": GQA.replace("SMALL", "(1, 4, 2, 384, 64)"),
    "gqa_odd": GQA.replace("SMALL", "(1, 6, 2, 200, 64)"),
}

_SYNTHESIZED: dict[str, tuple[str, object]] = {}


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("attention-gqa")


def _synthesize(name: str, work: Path) -> tuple[str, object]:
    return synthesize_once(_SYNTHESIZED, name, CASES[name], work, family="attention")


# The default run judges gqa_odd (200 tokens, groups of 3 query heads: divides neither block nor the tile);
# gqa_aligned (the same kernel, nothing padded) runs with `-m slow`: each case is a whole harness evaluation.
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n == "gqa_aligned" else n for n in CASES]
)
def test_gqa_shares_kv_blocks_and_is_correct(name: str, work: Path) -> None:
    source, task = _synthesize(name, work)
    # the group rides in the query block and is merged into the MXU rows
    assert "n_g, bq, n_d)" in source and ".reshape(-1, " in source
    result = evaluate(task, source, acceptance_options(TPU), work_dir=work)  # type: ignore[arg-type]
    assert result.accepted, (result.error, source)
    assert result.correct and len(result.correctness.sets) == 3
    assert all(result.tpu_compile[g].ok for g in TPU)


def test_block_model_sees_one_kv_fetch_per_group(work: Path) -> None:
    """At the task's TPU shapes the grid has no query-head-in-group axis, and the K traffic the block model
    charges is that of one fetch per (batch, K/V head, live block pair), not one per query head."""
    source, _ = _synthesize("gqa_aligned", work)
    path = work / "gqa_kernel.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    b, hq, hkv, s, d = 2, 16, 4, 2048, 128
    q = jax.ShapeDtypeStruct((b, hq, s, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, hkv, s, d), jnp.bfloat16)
    closed = jax.make_jaxpr(lambda q, k, v: mod.computation(q, k, v, d**-0.5))(q, kv, kv)  # type: ignore[attr-defined]
    (call,) = estimate_pallas(closed, "v5e").pallas_calls
    assert tuple(call.grid[:2]) == (b, hkv) and len(call.grid) == 3  # batch, K/V head, live pairs
    n_pairs = call.grid[-1]
    bkv = mod.BLOCK_KV  # type: ignore[attr-defined]
    k_once_per_group = b * hkv * n_pairs * bkv * d * 2
    inputs = sorted(op.est_bytes for op in call.operands if op.role == "input")
    # K and V: at most one fetch per live pair and K/V head (x group before the query heads shared a block;
    # fewer where consecutive pairs keep the key block, which the replayed schedule sees)
    group = hq // hkv
    k_like = [x for x in inputs if k_once_per_group / group < x <= k_once_per_group * 1.001]
    assert len(k_like) >= 2, (inputs, k_once_per_group)  # (q may be the same size: group x bq rows)
