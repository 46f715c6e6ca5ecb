"""The offline author's default blocks are chosen for the run's own TPU targets: `--tpu v4,v5p` reaches the
block model's cost terms (no second list of generations inside the tuner); the default pair is used only
where a caller gives none."""

from __future__ import annotations

import jax
import pytest

from maxkernel.authors.offline import tuning
from maxkernel.authors.offline.lower import lower_program
from maxkernel.authors.offline.spec import ProgramSpec
from maxkernel.authors.offline.trace import Config, trace_reference
from maxkernel.cli.root import parse_tpus
from maxkernel.context import OFFLINE_MODEL, Context
from maxkernel.tools.tpu_specs import DEFAULT_GENERATIONS, TpuSpec


@pytest.fixture(scope="module")
def matmul_program() -> ProgramSpec:
    def f(x, w, b):  # noqa: ANN001, ANN202 - a reference as a task writes it
        return jax.nn.relu(x @ w + b)

    shapes = [((4096, 8192), "bfloat16"), ((8192, 4096), "bfloat16"), ((4096,), "bfloat16")]
    return lower_program(trace_reference(f, [Config(dynamic=shapes, static=[])], ["x", "w", "b"]), "t")


def _generations_read(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """Records every generation whose figures (VMEM, MXU, HBM bandwidth, peak flops) the tuner reads."""
    seen: set[str] = set()
    real = tuning.get_spec

    def spy(name: str) -> TpuSpec:
        seen.add(name)
        return real(name)

    monkeypatch.setattr(tuning, "get_spec", spy)
    return seen


def test_tpu_v4_v5p_tunes_the_default_blocks_for_v4_and_v5p(
    matmul_program: ProgramSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctx = Context(model=OFFLINE_MODEL, tpu=parse_tpus("v4,v5p"))  # what `--tpu v4,v5p` builds
    seen = _generations_read(monkeypatch)
    config = tuning.default_config(matmul_program, ctx.tpu)
    assert seen == {"v4", "v5p"}
    assert tuning.validate(matmul_program, config, ctx.tpu) == []


def test_the_default_pair_only_when_no_targets_are_given(
    matmul_program: ProgramSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    (kernel,) = [k for k in matmul_program.kernels if "matmul" in k.family]
    budget = tuning.vmem_budget(list(DEFAULT_GENERATIONS))
    seen = _generations_read(monkeypatch)
    tuning.default_values(kernel, budget)
    assert seen == set(DEFAULT_GENERATIONS)
