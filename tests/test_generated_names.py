"""Every generated kernel module defines or imports every name it uses.

A module that uses a name it never imported (`np` in the paged and block-sparse attention kernels, once)
passes analysis and rendering and fails only when the line runs, on a TPU. Here a handful of suite tasks
from every kernel family are analysed at their CPU-scale shapes (abstract inputs, nothing allocated beyond
the small inputs), rendered at their default tile config, and read with `render.undefined_names`.
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib

import jax
import pytest

from maxkernel.authors.offline.analysis_job import arg_names
from maxkernel.authors.offline.lower import lower_program
from maxkernel.authors.offline.render import render, undefined_names
from maxkernel.authors.offline.trace import Config, trace_reference
from maxkernel.authors.offline.tuning import default_config

SUITE = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "suite"
TPU = ["v5e", "v6e"]
TASKS = [
    "op_paged_attention_decode",  # used `np` without importing it
    "op_block_sparse_attention",  # used `np` without importing it
    "op_flash_attention_causal",
    "fused_matmul_bias_softmax",
    "op_gated_mlp_swiglu",
    "op_layernorm_unaligned",
    "op_cross_entropy_large_vocab",
    "op_grouped_matmul",
    "fused_conv2d_batchnorm_relu",
]


@functools.cache
def _reference(task_id: str):
    path = SUITE / task_id / "reference.py"
    spec = importlib.util.spec_from_file_location(f"names_reference_{task_id}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _small_config(module) -> Config:
    produced = module.get_inputs(scale="cpu")
    dynamic, static = produced[0] if isinstance(produced, list) else produced
    return Config(
        dynamic=[(tuple(a.shape), str(jax.numpy.dtype(a.dtype))) for a in dynamic], static=list(static)
    )


def test_the_name_check_finds_a_missing_import() -> None:
    src = "import jax\n\n\ndef f(x):\n    return np.zeros(3) + x\n"
    assert undefined_names(src) == ["np"]
    assert undefined_names("import numpy as np\n" + src) == []


@pytest.mark.parametrize("task_id", TASKS)
def test_generated_module_imports_what_it_uses(task_id: str) -> None:
    module = _reference(task_id)
    config = _small_config(module)
    names = arg_names(module.computation, len(config.dynamic) + len(config.static))
    program = lower_program(trace_reference(module.computation, [config], names), task_id)
    src = render(program, default_config(program, TPU), TPU)
    compile(src, task_id, "exec")
    assert undefined_names(src) == [], program.family
