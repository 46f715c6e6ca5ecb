"""A weighted sum over a short axis written as an einsum (a mixture of experts' combine,
`einsum('bsne,bsn->bse', expert_outputs, weights)` over 8 experts) is a multiply and a sum in the data's own
layout, not a batched matmul: the matmul layout put the 8-long contracted axis on the lanes, a transpose of
the [B, S, E, 8] data padded to 128 lanes in HBM (JAXBench's dense MoE: 26.8 GB of the compiled program's
temporaries, over a v5e's 16 GB). Correct in TPU interpret mode, and compiled ahead of time for v5e with
temporaries the size of the data, not sixteen times it. A contraction along the data's last dim (a decode
step's q . k) stays a matmul."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

import maxkernel.tools.tpu_specs  # noqa: F401 - lets compile-only libtpu load next to other processes
from maxkernel.authors.offline import trace
from maxkernel.authors.offline.lower import lower_program
from maxkernel.authors.offline.partition import FUSION_LEVELS
from maxkernel.authors.offline.render import render
from maxkernel.authors.offline.trace import Config, trace_reference
from maxkernel.authors.offline.tuning import default_config
from maxkernel.tools.estimate import topology_device

TPU = ["v5e"]


def moe_combine(h, wd, logits):
    """Per-expert down projection of every token, then the router's softmax weights combine the experts."""
    y = jnp.einsum("bsnm,nme->bsne", h, wd)
    return jnp.einsum("bsne,bsn->bse", y, jax.nn.softmax(logits, axis=-1))


def decode_scores(q, k):
    return jnp.einsum("bhd,bhkd->bhk", q, k)


def _shapes(b: int, s: int, n: int, m: int, e: int) -> list[tuple[int, ...]]:
    return [(b, s, n, m), (n, m, e), (b, s, n)]


def test_a_mixture_combine_is_a_sum_in_the_datas_layout() -> None:
    def cfg(*dims: int) -> Config:
        return Config(dynamic=[(s, "float32") for s in _shapes(*dims)], static=[])

    big = (2, 256, 8, 256, 512)
    configs = [cfg(*big), cfg(1, 16, 8, 128, 128), cfg(2, 12, 8, 40, 136)]
    program = lower_program(
        trace_reference(moe_combine, configs, ["h", "wd", "logits"]), "t", FUSION_LEVELS[0]
    )
    assert "weighted_sum" in trace.REWRITTEN
    src = render(program, default_config(program, TPU), TPU)
    ns: dict = {}
    exec(compile(src, "generated", "exec"), ns)
    rng = np.random.default_rng(0)
    for dims in [(1, 16, 8, 128, 128), (2, 12, 8, 40, 136)]:
        args = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in _shapes(*dims)]
        with pltpu.force_tpu_interpret_mode():
            got = np.asarray(ns["computation"](*args))
        want = np.asarray(moe_combine(*args))
        np.testing.assert_allclose(got, want, atol=1e-4 * np.sqrt(dims[3]), rtol=1e-4)
    sharding = jax.sharding.SingleDeviceSharding(topology_device("v5e"))
    avals = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=sharding) for s in _shapes(*big)]
    compiled = jax.jit(ns["computation"]).trace(*avals).lower().compile()
    y_bytes = 4 * 2 * 256 * 8 * 512
    assert compiled.memory_analysis().temp_size_in_bytes <= 4 * y_bytes


def test_a_contraction_along_the_lanes_stays_a_matmul() -> None:
    configs = [Config(dynamic=[((2, 4, 128), "float32"), ((2, 4, 256, 128), "float32")], static=[])]
    traced = trace_reference(decode_scores, configs, ["q", "k"])
    assert "weighted_sum" not in trace.REWRITTEN
    assert any(e.primitive.name == "dot_general" for e in traced.primary.jaxpr.eqns)
