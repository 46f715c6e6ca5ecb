"""Multi-head latent attention written as DeepSeek's code writes it: each query and key head is the
concatenation of a content part and a rotary part, and the rotary key is one vector broadcast over the
heads. The score dot over the concatenations is split into one dot per piece (`split_contractions.py`), so
the attention kernel reads the parts where they are (no [B, S, H, 192] copies of q and k in HBM) and sums
their scores; the result equals the reference's, and the real harness accepts the kernel."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu
from offline_helpers import acceptance_options
from test_offline_author import TPU, synthesize_once

import maxkernel.tools.tpu_specs  # noqa: F401 - lets compile-only libtpu load next to other processes
from maxkernel.authors.offline.lower import lower_program
from maxkernel.authors.offline.partition import FUSION_LEVELS
from maxkernel.authors.offline.render import render
from maxkernel.authors.offline.trace import Config, trace_reference
from maxkernel.authors.offline.tuning import default_config
from maxkernel.tools.harness import evaluate

MLA = """
def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    b, s, h = (2, 512, 8) if scale == "tpu" else (1, 64, 4)
    ks = jax.random.split(jax.random.key(0), 5)
    shapes = [(b, s, h, 128), (b, s, h, 64), (b, s, h, 128), (b, s, 64), (b, s, h, 128)]
    return [jax.random.normal(k, sh, dtype) for k, sh in zip(ks, shapes)], []


def _rope(x):
    d, s = x.shape[-1], x.shape[1]
    freqs = 1.0 / (10000.0 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    angles = jnp.outer(jnp.arange(s, dtype=jnp.float32), freqs)
    cos = jnp.cos(angles).astype(x.dtype)[None, :, None, :]
    sin = jnp.sin(angles).astype(x.dtype)[None, :, None, :]
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def computation(q_nope, q_pe, k_nope, k_pe, v):
    h = q_nope.shape[2]
    k_pe = jnp.broadcast_to(k_pe[:, :, None, :], (*k_pe.shape[:2], h, k_pe.shape[-1]))
    q = jnp.concatenate([q_nope, _rope(q_pe)], axis=-1).transpose(0, 2, 1, 3)
    k = jnp.concatenate([k_nope, _rope(k_pe)], axis=-1).transpose(0, 2, 1, 3)
    att = jnp.einsum("bhqd,bhkd->bhqk", q, k) * q.shape[-1] ** -0.5
    s = q.shape[2]
    att = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((s, s))), att, -1e9), axis=-1)
    return jnp.einsum("bhqk,bhkd->bhqd", att, v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
"""


def _namespace() -> dict:
    ns: dict = {"jax": jax, "jnp": jnp}
    exec(compile(MLA, "mla", "exec"), ns)
    return ns


def _shapes(b: int, s: int, h: int) -> list[tuple[int, ...]]:
    return [(b, s, h, 128), (b, s, h, 64), (b, s, h, 128), (b, s, 64), (b, s, h, 128)]


def test_the_score_dot_over_concatenations_is_split_and_reads_the_parts() -> None:
    fn = _namespace()["computation"]
    configs = [
        Config(dynamic=[(x, "bfloat16") for x in _shapes(*t)], static=[])
        for t in [(2, 256, 8), (1, 64, 4), (1, 48, 2)]
    ]
    traced = trace_reference(fn, configs, ["q_nope", "q_pe", "k_nope", "k_pe", "v"])
    program = lower_program(traced, "mla", options=FUSION_LEVELS[0])
    assert [k.family for k in program.kernels] == ["elementwise", "attention"]
    src = render(program, default_config(program, TPU), TPU)
    wrapper = src.split("def computation", 1)[1]
    assert "_attention_1(q_nope, k_nope" in wrapper  # the content parts straight from the inputs
    ns: dict = {}
    exec(compile(src, "generated", "exec"), ns)
    rng = np.random.default_rng(0)
    for t in [(1, 64, 4), (1, 48, 2)]:
        args = [jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in _shapes(*t)]
        with pltpu.force_tpu_interpret_mode():
            got = np.asarray(ns["computation"](*args), np.float32)
        want = np.asarray(fn(*args), np.float32)
        exact = np.asarray(fn(*[a.astype(jnp.float32) for a in args]), np.float32)
        # as close to the reference as the reference's own bf16 rounding is to exact arithmetic
        assert np.max(np.abs(got - want)) <= np.max(np.abs(exact - want)) + 1e-2


_SYNTHESIZED: dict[str, tuple[str, object]] = {}


def test_mla_with_concatenated_heads_is_accepted(tmp_path: Path) -> None:
    source, task = synthesize_once(_SYNTHESIZED, "mla_concat", MLA, tmp_path, family="attention")
    assert "lax.concatenate([q_nope" not in source and "lax.concatenate([k_nope" not in source
    result = evaluate(task, source, acceptance_options(TPU), work_dir=tmp_path)  # type: ignore[arg-type]
    assert result.accepted, (result.error, source)
    assert result.correct and len(result.correctness.sets) == 3
    assert all(result.tpu_compile[g].ok for g in TPU)
