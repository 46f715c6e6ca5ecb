"""`x @ w.T` with a PyTorch-style weight ([out_features, in_features]) reads the weight as it is in HBM: the
kernel takes [bn, bk] blocks of it and contracts their last dims (an NT matmul). The wrapper used to transpose
the whole weight in HBM before the kernel (a 8192 x 8192 f32 weight: 537 MB of glue). Correct in TPU
interpret mode with a K that is a lane multiple and one that is not (the in-kernel tail mask then runs along
the weight's lanes), and compiled for v5e and v6e ahead of time."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import maxkernel.tools.tpu_specs  # noqa: F401 - lets compile-only libtpu load next to other processes
from maxkernel.authors.offline.lower import lower_program
from maxkernel.authors.offline.partition import FUSION_LEVELS
from maxkernel.authors.offline.render import render
from maxkernel.authors.offline.trace import Config, trace_reference
from maxkernel.authors.offline.tuning import default_config
from maxkernel.tools.estimate import estimate_pallas, topology_device

TPU = ["v5e", "v6e"]


def linear_relu(x, w, b):
    return jax.nn.relu(x @ w.T + b)


@pytest.mark.parametrize(("dtype", "k"), [("float32", 1024), ("bfloat16", 1000)])
def test_a_transposed_weight_is_read_in_place(dtype: str, k: int) -> None:
    def cfg(m: int, n: int, kk: int) -> Config:
        return Config(dynamic=[((m, kk), dtype), ((n, kk), dtype), ((n,), dtype)], static=[])

    configs = [cfg(1024, 2048, k), cfg(64, 256, k // 4), cfg(48, 136, 200)]
    program = lower_program(trace_reference(linear_relu, configs, ["x", "w", "b"]), "t", FUSION_LEVELS[0])
    (kernel,) = program.kernels
    src = render(program, default_config(program, TPU), TPU)
    assert "(((1,), (1,)), ((), ()))" in src.split(f"def {kernel.name}_kernel", 1)[1].split("\ndef ", 1)[0]
    assert "jnp.transpose(w" not in src
    ns: dict = {}
    exec(compile(src, "generated", "exec"), ns)
    rng = np.random.default_rng(0)
    for m, n, kk in [(64, 256, k // 4), (48, 136, 200)]:
        args = [jnp.asarray(rng.standard_normal(s), dtype) for s in [(m, kk), (n, kk), (n,)]]
        with pltpu.force_tpu_interpret_mode():
            got = np.asarray(ns["computation"](*args), np.float32)
        want = np.asarray(linear_relu(*args), np.float32)
        tol = 1e-4 if dtype == "float32" else 3e-2
        np.testing.assert_allclose(got, want, atol=tol * np.sqrt(kk), rtol=tol)
    for gen in TPU:
        sharding = jax.sharding.SingleDeviceSharding(topology_device(gen))
        avals = [jax.ShapeDtypeStruct(s, dtype, sharding=sharding) for s in [(1024, k), (2048, k), (2048,)]]
        est = estimate_pallas(jax.make_jaxpr(ns["computation"])(*avals), gen)
        assert est.est_xla_bytes == 0  # nothing moves outside the kernel
        jax.jit(ns["computation"]).trace(*avals).lower().compile()
