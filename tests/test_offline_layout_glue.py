"""Layout the kernels read but do not compute runs as glue: a PyTorch-style NCHW convolution transposes its
input to NHWC and its weight to HWIO before `conv_general_dilated`. The direct conv kernel takes arrays, not
transposes of them, so before this the direct form was refused ("a value is needed outside kernels but never
written") and the convolution fell back to im2col patches built by XLA: nine shifted copies of the input
through HBM (estimated 0.12x of XLA on v5e for a 3x3 conv + ReLU + bias at batch 128). Now the transposes are
XLA's and the convolution is one direct kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from offline_helpers import check_on_normal_inputs, compiles_at, load_module

from maxkernel.authors.offline.lower import lower_program
from maxkernel.authors.offline.trace import Config, trace_reference


def nchw_conv_block(x, w, b, scale):
    y = jax.lax.conv_general_dilated(
        jnp.transpose(x, (0, 2, 3, 1)),
        jnp.transpose(w, (2, 3, 1, 0)),
        (1, 1),
        "SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )
    y = jnp.tanh(y + b) * scale.reshape(1, 1, 1, -1)
    return jnp.transpose(y, (0, 3, 1, 2))


def test_nchw_convolution_is_one_direct_kernel_with_xla_transposes() -> None:
    shapes = [
        [(2, 32, 24, 24), (64, 32, 3, 3), (64,), (64,)],
        [(1, 32, 16, 40), (64, 32, 3, 3), (64,), (64,)],
    ]
    configs = [Config(dynamic=[(s, "bfloat16") for s in case], static=[]) for case in shapes]
    program = lower_program(
        trace_reference(nchw_conv_block, configs, ["x", "w", "b", "scale"], direct_conv=True), "t"
    )
    names = [k.name for k in program.kernels]
    assert names and names[0].startswith("_conv"), names
    src, kernel = load_module(program)
    glue = src[src.index("def computation") :]
    assert "jnp.transpose(x, (0, 2, 3, 1))" in glue and "concatenate" not in glue, glue
    check_on_normal_inputs(
        nchw_conv_block, kernel, shapes, jnp.bfloat16, np.random.default_rng(2), atol=3e-2, rtol=3e-2
    )
    compiles_at(kernel, [[(64, 64, 112, 112), (128, 64, 3, 3), (128,), (128,)]], jnp.bfloat16)


def masked_pair_update(pair, mask, lw, rw, ow):
    act = pair * mask  # computed from inputs alone, read by two matmuls and nothing else
    left = jnp.dot(act, lw)
    right = jax.nn.sigmoid(jnp.dot(act, rw))
    res = jnp.einsum("ikc,jkc->ijc", left, right)
    res = res / jnp.sqrt(jnp.mean(res * res, axis=-1, keepdims=True) + 1e-6)
    return jnp.dot(res, ow) * jax.nn.sigmoid(jnp.dot(pair, ow))


def test_a_computed_value_kernels_read_but_do_not_compute_gets_a_kernel_of_its_own() -> None:
    """The masked activation is a float no matmul pulled in (a triangle update's contraction over the pair's
    second index cannot take it); before, the lowering refused the task ("a value is needed outside kernels
    but never written"); now a map kernel writes it once."""
    shapes = [[(48, 48, 128), (48, 48, 1), (128, 128), (128, 128), (128, 128)]]
    configs = [Config(dynamic=[(s, "bfloat16") for s in case], static=[]) for case in shapes]
    program = lower_program(
        trace_reference(masked_pair_update, configs, ["pair", "mask", "lw", "rw", "ow"]), "t"
    )
    names = [k.name for k in program.kernels]
    assert names[0].startswith("_elementwise"), names
    _, kernel = load_module(program)
    check_on_normal_inputs(
        masked_pair_update, kernel, shapes, jnp.bfloat16, np.random.default_rng(5), atol=5e-2, rtol=5e-2
    )
