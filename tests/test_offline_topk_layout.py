"""Top-k regions lay tokens on the lanes (`MapBuilder._lane_dense`): the k rounds of max / first
argmax / knock-out over a short expert axis fill whole vregs instead of half of each, and the per-token
winners are sublane rows instead of lane-sparse columns. Correct in TPU interpret mode on aligned and odd
shapes, compiles for v5e and v6e ahead of time, and the block model sees less VPU work than the layout it
replaces at the suite's router shape."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental.pallas import tpu as pltpu

import maxkernel.tools.tpu_specs  # noqa: F401 - lets compile-only libtpu load next to other processes
from maxkernel.authors.offline.author import checked_source
from maxkernel.authors.offline.lower import lower_program
from maxkernel.authors.offline.map_kernel import MapBuilder
from maxkernel.authors.offline.trace import Config, trace_reference
from maxkernel.authors.offline.tuning import default_config
from maxkernel.tools.estimate import estimate_pallas
from tests.offline_helpers import check_interpreted, compiles

TPU = ["v5e", "v6e"]


def gate(logits, top_k):
    """The dense gate matrix of top-k routing: softmax over each token's k best logits, zeros elsewhere."""
    top_v, top_i = lax.top_k(logits, top_k)
    weights = jax.nn.softmax(top_v, axis=-1)
    return jnp.sum(jax.nn.one_hot(top_i, logits.shape[1], dtype=jnp.float32) * weights[..., None], axis=1)


def _kernel(shapes: list[tuple[int, int]], k: int):
    configs = [Config(dynamic=[(s, "float32")], static=[k]) for s in shapes]
    program = lower_program(trace_reference(gate, configs, ["logits", "top_k"]), "t")
    ns: dict = {}
    exec(compile(checked_source(program, default_config(program, TPU), TPU), "generated", "exec"), ns)
    return ns["computation"]


@pytest.mark.parametrize(("shapes", "k"), [([(256, 64), (384, 64)], 6), ([(300, 40), (131, 40)], 3)])
def test_top_k_gating_is_lane_dense_and_correct(shapes: list[tuple[int, int]], k: int) -> None:
    kernel = _kernel(shapes, k)
    rng = np.random.default_rng(11)
    for s in shapes:
        logits = rng.standard_normal(s).astype(np.float32)
        logits[:, 1] = logits[:, 0]  # ties: the first index wins, as lax.top_k picks it
        check_interpreted(lambda x: gate(x, k), lambda x: kernel(x, k), [logits])
    compiles(lambda x: kernel(x, k), [((32768, shapes[0][1]), jnp.float32)], TPU)


def _rowwise_vpu_ops(monkeypatch: pytest.MonkeyPatch | None) -> float:
    if monkeypatch is not None:  # the layout before: experts on the lanes
        monkeypatch.setattr(MapBuilder, "_lane_dense", lambda self, tile, reduced: tile)
    kernel = _kernel([(32768, 64), (256, 64)], 6)
    jaxpr = jax.make_jaxpr(lambda x: kernel(x, 6))(jax.ShapeDtypeStruct((32768, 64), jnp.float32))
    (call,) = estimate_pallas(jaxpr, "v5e").pallas_calls
    return call.est_vpu_elementwise_ops


def test_the_block_model_sees_less_vpu_work(monkeypatch: pytest.MonkeyPatch) -> None:
    dense = _rowwise_vpu_ops(None)
    sparse = _rowwise_vpu_ops(monkeypatch)
    assert dense < 0.5 * sparse, (dense, sparse)


def router_gate(x, w_router, top_k):
    """The suite's top-k gating: a bf16 router matmul accumulated in f32, then the dense gate matrix."""
    return gate(jnp.dot(x, w_router, preferred_element_type=jnp.float32), top_k)


def test_a_kernel_output_transposed_for_the_next_kernel_runs_plainly_interpreted() -> None:
    """The lane-dense gate kernel reads the router kernel's logits transposed. Inlined by Pallas's plain
    interpreter (the harness's larger-shape check), XLA:CPU folded that transpose into the router dot's
    layout and had no bf16 x bf16 -> f32 dot for it; the barrier in the wrapper keeps them apart."""
    shapes = [((512, 512), (512, 32)), ((256, 256), (256, 16))]
    configs = [Config(dynamic=[(a, "bfloat16"), (b, "bfloat16")], static=[4]) for a, b in shapes]
    program = lower_program(trace_reference(router_gate, configs, ["x", "w_router", "top_k"]), "t")
    assert [k.family for k in program.kernels] == ["matmul", "rowwise"]
    ns: dict = {}
    exec(compile(checked_source(program, default_config(program, TPU), TPU), "generated", "exec"), ns)
    assert "lax.optimization_barrier(" in program.kernels[1].code
    rng = np.random.default_rng(12)
    x = jnp.asarray(rng.standard_normal(shapes[0][0]), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal(shapes[0][1]) * 0.05, jnp.bfloat16)
    with pltpu.force_tpu_interpret_mode(True):  # True: the plain interpreter
        got = jax.jit(lambda a, b: ns["computation"](a, b, 4))(x, w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(router_gate(x, w, 4)), atol=1e-5, rtol=1e-5)


def test_a_top_k_too_large_for_rounds_of_max_is_refused_by_name() -> None:
    """k rounds of max over the row is a selection for a router's few experts; the top 2048 of 8192
    scores (a sparse-attention indexer) is a sort: refused, naming k, instead of a program the TPU compiler
    crashes on."""
    from maxkernel.authors.offline.trace import Unsupported

    def best_scores(scores, top_k):
        return lax.top_k(scores, top_k)[0]

    configs = [Config(dynamic=[((64, 1024), "float32")], static=[256])]
    with pytest.raises(Unsupported, match="top_k of 256"):
        lower_program(trace_reference(best_scores, configs, ["scores", "top_k"]), "t")
