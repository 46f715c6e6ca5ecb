"""Attention over an unaligned sequence (577 ViT tokens): the default blocks take the whole sequence rather
than 256/512 blocks that pad it to 768/1024 (2.4x the score work, plus pad copies in HBM); Mosaic pads the
tile inside VMEM only. Checked through the real harness: interpret-mode correctness at an odd CPU shape and
the AOT Mosaic compile for v5e and v6e at the task's own (577) shape."""

from __future__ import annotations

import re
from pathlib import Path

from offline_helpers import acceptance_options
from test_offline_author import TPU, make_task

from maxkernel.authors.base import AuthorContext
from maxkernel.authors.offline import OfflineAuthor
from maxkernel.tools.harness import evaluate
from maxkernel.tools.tasks import load_task

VIT = """
def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    b, h, s, d = (2, 4, 577, 64) if scale == "tpu" else (1, 2, 300, 64)
    ks = jax.random.split(jax.random.key(51), 3)
    q, k, v = (jax.random.normal(kk, (b, h, s, d), jnp.float32).astype(dtype) for kk in ks)
    return [q, k, v], [float(d) ** -0.5]

def computation(q, k, v, sm_scale):
    s_ = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32) * sm_scale
    p = jax.nn.softmax(s_, axis=-1)
    return jnp.einsum("bhqk,bhkd->bhqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32).astype(q.dtype)
"""


def test_unaligned_sequence_is_one_unpadded_block(tmp_path: Path) -> None:
    task = load_task(make_task(tmp_path / "tasks", "vit_unaligned", VIT), work_dir=tmp_path)
    author = OfflineAuthor()
    ctx = AuthorContext(task=task, tpu=TPU, work_dir=tmp_path)
    plan = author.plan(ctx)
    assert plan.supported and plan.family == "attention"
    source = author.implement(ctx, plan).source
    blocks = {m[0]: int(m[1]) for m in re.findall(r"^(BLOCK_Q|BLOCK_KV) = (\d+)", source, re.M)}
    assert blocks["BLOCK_Q"] >= 577 and blocks["BLOCK_KV"] >= 577, blocks  # whole sequence, nothing padded
    result = evaluate(task, source, acceptance_options(TPU), work_dir=tmp_path)
    assert result.accepted, (result.error, source)
    assert result.correct and len(result.correctness.sets) == 3
    assert all(result.tpu_compile[g].ok for g in TPU)
