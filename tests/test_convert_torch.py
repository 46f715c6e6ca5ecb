"""PyTorch files converted to JAX tasks in the sandbox (needs the `convert` extra: torch + torchax).

Each conversion is a sandboxed child that imports PyTorch and JAX (~15-30 s here), so the files are
converted once per module (fixtures) and the tests read what was written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from maxkernel.convert import convert_torch_file, torch_available
from maxkernel.tools.tasks import load_task

pytestmark = pytest.mark.skipif(not torch_available(), reason="needs the convert extra (torch, torchax)")

DATA = Path(__file__).parent / "data" / "pytorch"


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("convert")


@pytest.fixture(scope="module")
def mlp(work: Path):
    return convert_torch_file(DATA / "mlp_block.py", work / "mlp", work_dir=work / "w", draws=2)


def test_mlp_block_becomes_a_verified_standalone_jax_task(mlp, work):
    assert mlp.ok, mlp.message()
    task_dir = Path(mlp.task_dir)
    source = (task_dir / "reference.py").read_text()
    assert "import torch" not in source  # the task no longer depends on PyTorch
    assert "def get_inputs(scale=" in source and "def computation(x, " in source
    assert "mlp_block.py:17" in source  # lines of the user's file annotate the ops they became
    checks = json.loads((task_dir / "conversion.json").read_text())["result"]["checks"]
    assert {c["draw"].split()[0] for c in checks} == {"pytorch", "reference"} and all(c["ok"] for c in checks)
    meta = yaml.safe_load((task_dir / "kernel_task.yaml").read_text())
    assert meta["atol"] == meta["rtol"] == 1e-2  # KernelBench's own tolerance for its format
    task = load_task(task_dir, work_dir=work / "w")  # the problem dir loads in the harness's sandbox
    own, small = task.configs[0].dynamic, task.validation_configs[0].dynamic
    assert own[0].shape == (512, 1024) and small[0].shape[1] < 1024  # CPU scale: a smaller copy


def test_a_second_conversion_of_the_same_file_is_reused(mlp, work):
    again = convert_torch_file(DATA / "mlp_block.py", work / "mlp", work_dir=work / "w", draws=2)
    assert again.ok and again.cached and again.task_dir == mlp.task_dir


@pytest.mark.slow  # a second full conversion; test_mlp_block_becomes_a_verified_standalone_jax_task holds it
def test_named_attention_module_converts(work):
    r = convert_torch_file(DATA / "attention.py", work / "attn", class_name="SelfAttention", work_dir=work / "w",
                           draws=1)  # fmt: skip
    assert r.ok, r.message()
    source = (Path(r.task_dir) / "reference.py").read_text()
    assert "def computation(x, " in source and "qkv_weight" in source
    assert "jnp.where(" in source or "lax.select_n(" in source  # the causal mask


@pytest.mark.parametrize(
    ("name", "kind", "names"),
    [
        ("unsupported_op.py", "torch_op", ("aten::special_airy_ai", "unsupported_op.py:10")),
        # more refusal kinds, each a sandboxed child of its own; the one above holds the feature
        pytest.param(
            "data_dependent.py",
            "data_dependent",
            ("data_dependent.py:9", "if x.sum() > 0"),
            marks=pytest.mark.slow,
        ),
        pytest.param("random_forward.py", "randomness", ("random",), marks=pytest.mark.slow),
    ],
)
def test_refusals_name_the_construct_and_what_to_do(work, name, kind, names):
    r = convert_torch_file(DATA / name, work / name, work_dir=work / "w", draws=1)
    assert not r.ok and r.refusal is not None and r.refusal.kind == kind
    message = r.message()
    for needle in names:
        assert needle in message
    assert r.refusal.advice and r.refusal.advice in message


def test_a_conversion_stopped_by_the_machines_limits_is_not_the_files_fault(work):
    """A timeout (or a memory kill) says nothing about the file: refused as the machine's, with what to do,
    and not cached, so the next conversion tries again."""
    r = convert_torch_file(DATA / "slow_inputs.py", work / "slow", work_dir=work / "w", draws=1, timeout_s=8)
    assert not r.ok and r.refusal is not None and r.refusal.kind == "machine", r.message()
    assert r.infrastructure and "--timeout" in r.message()
    assert not (work / "slow" / "conversion.json").exists()


def test_a_shrink_that_makes_the_model_invalid_is_skipped_not_blamed_on_the_file(work):
    """A grouped convolution of 64 channels in 16 groups is valid; shrunk x1/8 (8 channels) it cannot be built. That copy is
    skipped, as one whose program differs would be: the file converts."""
    r = convert_torch_file(DATA / "grouped_conv_shrink.py", work / "gn", work_dir=work / "w", draws=1)
    assert r.ok, r.message()
