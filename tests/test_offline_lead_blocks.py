"""Row-wise kernels over short trailing axes walk a leading axis in blocks (`BLOCK_LEAD`); the tuner sizes
that block for ~1 MiB of input per step, as it does for element-wise maps, instead of keeping the 8-row
start. On the suite's MoE routing (rank kernels over 8192 x 8 routed pairs) and ragged attention's
row-wise kernels that is up to 8x fewer grid steps, each ~0.35 us of overhead, and a smaller time in the
tuner's model; the block never shrinks below the start."""

from __future__ import annotations

import importlib.util
import pathlib

import jax
import pytest

import maxkernel.tools.tpu_specs  # noqa: F401 - lets compile-only libtpu load next to other processes
from maxkernel.authors.offline import tuning
from maxkernel.authors.offline.analysis_job import arg_names
from maxkernel.authors.offline.lower import lower_program
from maxkernel.authors.offline.trace import Config, trace_reference

SUITE = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "suite"
TPU = ["v5e", "v6e"]


def _program(task_id: str):
    """The task's program at its TPU and CPU shapes (abstract inputs: nothing allocated)."""
    spec = importlib.util.spec_from_file_location(f"lead_{task_id}", SUITE / task_id / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    configs = []
    for scale in ("tpu", "cpu"):
        statics: list = []

        def dynamic(scale: str = scale, statics: list = statics):
            out = module.get_inputs(scale=scale)
            arrays, static = out[0] if isinstance(out, list) else out
            statics.append(static)
            return arrays

        shapes = jax.eval_shape(dynamic)
        configs.append(
            Config(dynamic=[(tuple(a.shape), str(a.dtype)) for a in shapes], static=list(statics[0]))
        )
    names = arg_names(module.computation, len(configs[0].dynamic) + len(configs[0].static))
    return lower_program(trace_reference(module.computation, configs, names, direct_conv=True), task_id)


def _leading_rowwise(program) -> list:
    return [
        k
        for k in program.kernels
        if k.family == "rowwise" and any(p.name.endswith("BLOCK_LEAD") for p in k.params)
    ]


@pytest.mark.parametrize("task_id", ["op_moe_topk_experts", "op_ragged_attention_varlen"])
def test_rowwise_leading_blocks_are_sized_for_the_pipeline(
    task_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    program = _program(task_id)
    kernels = _leading_rowwise(program)
    assert kernels, "the task no longer has a row-wise kernel with a leading block"
    now = tuning.default_config(program, TPU)
    before_sizing = tuning._size_rows

    def without_lead(kernel, vals, suffix="BLOCK_ROWS", hbm=False, grow_only=False):
        if kernel.family == "rowwise" and suffix == "BLOCK_LEAD":
            return None
        return before_sizing(kernel, vals, suffix, hbm, grow_only)

    monkeypatch.setattr(tuning, "_size_rows", without_lead)
    old = tuning.default_config(program, TPU)
    grew = 0
    for k in kernels:
        lead = next(p.name for p in k.params if p.name.endswith("BLOCK_LEAD"))
        key = tuning.key_of(lead)
        # Never smaller; a block that already spans its axis has nothing to grow into (under xdist, after
        # other files in the same worker, MoE once lowered with a 4-long leading axis: 4 -> 4).
        assert dict(now.params)[key] >= dict(old.params)[key]
        steps_now = tuning.grid_steps(k, tuning.kernel_values(k, now))
        assert steps_now <= tuning.grid_steps(k, tuning.kernel_values(k, old))
        grew += dict(now.params)[key] > dict(old.params)[key]
    assert grew, "no row-wise kernel's leading block grew"
    assert tuning.predicted_seconds(program, now, TPU) < tuning.predicted_seconds(program, old, TPU)
