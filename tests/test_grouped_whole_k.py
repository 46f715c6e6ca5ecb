"""A grouped matmul's default keeps the whole contraction in one block: a row block is visited once per
group it holds rows of, and with a K block narrower than K its lhs block changes every step, so every
visit read it again (skewed routing: a 2048-row block holding a dozen small experts read a dozen times;
the production MoE task ran at est. 0.56x of XLA). The block model, given the task's group sizes, prices
the whole-K default below the same kernel with half-K blocks. The reference is the test's own code."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from offline_helpers import load_module

import maxkernel.tools.tpu_specs  # noqa: F401 - lets compile-only libtpu load next to other processes
from maxkernel.authors.base import TileConfig
from maxkernel.authors.offline.lower import lower_program
from maxkernel.authors.offline.trace import Config, trace_reference
from maxkernel.authors.offline.tuning import default_config
from maxkernel.tools.estimate import estimate_pallas

ROWS, HIDDEN, FFN, EXPERTS = 16384, 2048, 1024, 64


def expert_up(x, w, group_sizes):
    return lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32).astype(x.dtype)


def _skewed_sizes() -> np.ndarray:
    share = 1.0 / np.arange(1, EXPERTS + 1) ** 1.1
    sizes = np.floor(share / share.sum() * ROWS).astype(np.int32)
    sizes[0] += ROWS - sizes.sum()
    return np.random.default_rng(0).permutation(sizes)


def test_the_whole_contraction_is_the_default_and_reads_less() -> None:
    configs = [
        Config(dynamic=[((ROWS, HIDDEN), "bfloat16"), ((EXPERTS, HIDDEN, FFN), "bfloat16"), ((EXPERTS,), "int32")],
               static=[]),
        Config(dynamic=[((512, 256), "bfloat16"), ((8, 256, 128), "bfloat16"), ((8,), "int32")], static=[]),
    ]  # fmt: skip
    program = lower_program(trace_reference(expert_up, configs, ["x", "w", "group_sizes"]), "t")
    (kernel,) = program.kernels
    assert kernel.family == "grouped_matmul"
    default = default_config(program, ["v5e", "v6e"])
    k_key = next(k for k in default.as_dict() if k.endswith("block_k"))
    assert default.as_dict()[k_key] >= HIDDEN
    half = TileConfig.of({**default.as_dict(), k_key: HIDDEN // 2})
    args = [jax.ShapeDtypeStruct(s, d) for s, d in [((ROWS, HIDDEN), jnp.bfloat16),
                                                     ((EXPERTS, HIDDEN, FFN), jnp.bfloat16), ((EXPERTS,), jnp.int32)]]  # fmt: skip
    sizes = {2: _skewed_sizes()}
    seconds = {}
    for name, config in (("whole", default), ("half", half)):
        _src, fn = load_module(program, config)
        seconds[name] = estimate_pallas(jax.make_jaxpr(fn)(*args), "v6e", sizes).estimated_seconds
    assert seconds["whole"] < 0.9 * seconds["half"], seconds
