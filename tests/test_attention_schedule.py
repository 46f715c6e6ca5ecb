"""Attention transforms of the offline author: static masks become a schedule of live block pairs, and
HIGHEST-precision probs @ v with a widened-bf16 v runs as exact bf16 passes.

Each kernel goes through the real harness (TPU interpret mode on CPU, three input sets, AOT Mosaic compile
for v5e and v6e) at shapes with several query and key blocks, aligned and not; the block model is asked
whether it sees the skipped blocks (fewer grid steps and fetches than the dense grid).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from offline_helpers import acceptance_options
from test_offline_author import TPU, synthesize_once

from maxkernel.tools.estimate import estimate_pallas
from maxkernel.tools.harness import evaluate

SLIDING = """
def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    b, h, s, d, window = (2, 8, 4096, 128, 512) if scale == "tpu" else SMALL
    ks = jax.random.split(jax.random.key(21), 3)
    q, k, v = (jax.random.normal(kk, (b, h, s, d), jnp.float32).astype(dtype) for kk in ks)
    return [q, k, v], [window, float(d) ** -0.5]

def computation(q, k, v, window, sm_scale):
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32) * sm_scale
    qi = jnp.arange(q.shape[2])[:, None]
    kj = jnp.arange(k.shape[2])[None, :]
    s = jnp.where((kj <= qi) & (kj > qi - window), s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhqk,bhkd->bhqd", p, v.astype(jnp.float32),
                      precision=lax.Precision.HIGHEST).astype(q.dtype)
"""

CAUSAL_F32_OUT = """
def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    b, h, s, d = (2, 8, 2048, 128) if scale == "tpu" else (1, 2, 1024, 128)
    ks = jax.random.split(jax.random.key(22), 3)
    q, k, v = (jax.random.normal(kk, (b, h, s, d), jnp.float32).astype(dtype) for kk in ks)
    return [q, k, v], []

def computation(q, k, v):
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32) * 0.125
    causal = jnp.tril(jnp.ones((q.shape[2], k.shape[2]), bool))
    s = jnp.where(causal, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    # f32 output at HIGHEST: a lossy bf16 rounding of the probabilities would show at 1e-5
    return jnp.einsum("bhqk,bhkd->bhqd", p, v.astype(jnp.float32), precision=lax.Precision.HIGHEST)
"""

CASES = {
    # several q blocks (256) and key blocks (512), none of them dividing the sequence
    "sliding_window_odd": (SLIDING.replace("SMALL", "(1, 2, 1100, 64, 300)"), None),
    "sliding_window_aligned": (SLIDING.replace("SMALL", "(1, 2, 1024, 128, 256)"), None),
    "causal_tril_f32_out": (CAUSAL_F32_OUT, 2e-5),
}


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("attention-schedule")


_SYNTHESIZED: dict[str, tuple[str, object]] = {}


def _synthesize(name: str, work: Path) -> tuple[str, object]:
    """Plan and write the kernel for one case (once per test session: two tests share a case)."""
    body, atol = CASES[name]
    return synthesize_once(_SYNTHESIZED, name, body, work, atol=atol, family="attention")


# The default run keeps the odd sliding window and the aligned causal schedule; the aligned sliding window
# (the same transform at aligned shapes, ~40 s at load 4) runs with `-m slow`.
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n == "sliding_window_aligned" else n for n in CASES]
)
def test_scheduled_attention_is_correct_and_compiles(name: str, work: Path) -> None:
    source, task = _synthesize(name, work)
    assert "PrefetchScalarGridSpec" in source and "_schedule(" in source  # the static mask became a schedule
    assert "lax.cond(" in source and "def _unmasked" in source  # blocks wholly inside the mask skip it
    if name == "causal_tril_f32_out":
        assert "p2_hi" in source or "_hi = " in source  # the exact three-term split of the probabilities
        assert (
            "Precision.HIGHEST" not in source.split("def _attention_kernel", 1)[1].split("def _attention(")[0]
        )
    result = evaluate(task, source, acceptance_options(TPU), work_dir=work)  # type: ignore[arg-type]
    assert result.accepted, (result.error, source)
    assert result.correct and len(result.correctness.sets) == 3
    assert all(result.tpu_compile[g].ok for g in TPU)


def _load(source: str, path: Path) -> object:
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_block_model_sees_only_live_block_pairs(work: Path) -> None:
    """At the task's TPU shapes the grid has one step per live (q block, key block) pair, so the block
    model charges the band's fetches and steps, not the dense square's."""
    source, _ = _synthesize("sliding_window_aligned", work)
    mod = _load(source, work / "swa_kernel.py")
    # the band's share of the square depends on the tiles: pin 256 x 512 ones (the defaults are larger)
    mod.BLOCK_Q, mod.BLOCK_KV = 256, 512  # type: ignore[attr-defined]
    b, h, s, d, window = 2, 8, 4096, 128, 512
    spec = jax.ShapeDtypeStruct((b, h, s, d), jnp.bfloat16)
    closed = jax.make_jaxpr(lambda q, k, v: mod.computation(q, k, v, window, d**-0.5))(spec, spec, spec)  # type: ignore[attr-defined]
    est = estimate_pallas(closed, "v5e")
    (call,) = est.pallas_calls
    bq, bkv = mod.BLOCK_Q, mod.BLOCK_KV  # type: ignore[attr-defined]
    qi = np.arange(s)[:, None]
    kj = np.arange(s)[None, :]
    allowed = (kj <= qi) & (kj > qi - window)
    live = allowed.reshape(s // bq, bq, s // bkv, bkv).any(axis=(1, 3))
    n_live = int(live.sum())
    assert n_live < live.size // 2  # the band is a small part of the square
    assert math.prod(call.grid[:-1]) == b * h and call.grid[-1] == n_live  # batch/heads x live pairs
    assert call.est_grid_steps == b * h * n_live
    # one K block per live pair, except where consecutive pairs (q-major) keep the key block: the pipeline
    # issues no copy there, and the block model replays the schedule table to see it
    kv_seq = [j for i in range(live.shape[0]) for j in range(live.shape[1]) if live[i, j]]
    fetches = 1 + sum(a != c for a, c in zip(kv_seq, kv_seq[1:], strict=False))
    k_bytes = b * h * fetches * bkv * d * 2
    assert fetches < n_live
    dense_k_bytes = b * h * live.size * bkv * d * 2
    k_traffic = [op for op in call.operands if op.role == "input"]
    assert min(k_traffic, key=lambda op: abs(op.est_bytes - k_bytes)).est_bytes == pytest.approx(k_bytes)
    assert est.est_hbm_bytes < 0.5 * 2 * dense_k_bytes
    assert math.isfinite(est.estimated_seconds)
