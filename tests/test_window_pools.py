"""`lax.reduce_window` pools whose windows tile the input (window == stride, no padding or dilation) are the
split-and-reduce a pool written by hand is: the trace rewrites them so (a 1-D average pool over a matmul's
features, a 2-D max pool after a conv, which the conv kernel then pools in VMEM). Each case: correct in TPU
interpret mode at the task's shape and a smaller one, and compiled
for v5e and v6e ahead of time. Overlapping windows are refused with the construct named."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from offline_helpers import check_on_normal_inputs, compiles_at, conv_program, load_module

from maxkernel.authors.offline.trace import Unsupported


def matmul_avgpool_gelu_max(x, w, b):
    """A 1-D average pool of 8 over the features (lax.reduce_window, as AvgPool1d is written), then a max."""
    y = jnp.expand_dims(x @ w + b, 1)
    y = lax.reduce_window(y, 0.0, lax.add, (1, 1, 8), (1, 1, 8), "VALID") / 8
    return jnp.max(jax.nn.gelu(jnp.squeeze(y, 1)) * 2.0, axis=1)


def conv_relu_maxpool(x, w, b):
    """NHWC conv, ReLU, a 2x2 max pool by reduce_window."""
    y = lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    y = jax.nn.relu(y + b)
    return lax.reduce_window(y, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


def overlapping_pool(x, w, b):
    y = x @ w + b
    return lax.reduce_window(y, 0.0, lax.add, (1, 4), (1, 2), "VALID")


CASES = [
    (matmul_avgpool_gelu_max, [((64, 256), (256, 512), (512,)), ((16, 256), (256, 72), (72,))]),
    (conv_relu_maxpool, [((2, 16, 16, 8), (3, 3, 8, 128), (128,)), ((1, 6, 10, 8), (3, 3, 8, 128), (128,))]),
]


@pytest.mark.parametrize(("fn", "shapes"), CASES, ids=[c[0].__name__ for c in CASES])
def test_tiling_window_pools_lower_and_match(fn, shapes) -> None:
    program = conv_program(fn, shapes, "float32")
    if fn is conv_relu_maxpool:  # the pool joins the conv kernel: only the pooled block leaves it
        assert [k.family for k in program.kernels] == ["conv"]
    _, kernel = load_module(program)
    check_on_normal_inputs(fn, kernel, shapes, jnp.float32, np.random.default_rng(0), atol=2e-5, rtol=2e-5)
    compiles_at(kernel, shapes[:1], jnp.float32)


def test_overlapping_windows_are_refused_by_name() -> None:
    with pytest.raises(Unsupported, match="windowed reduction"):
        conv_program(overlapping_pool, [((16, 64), (64, 128), (128,))], "float32")
