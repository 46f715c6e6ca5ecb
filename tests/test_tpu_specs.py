"""The TPU table is the one place hardware numbers come from; these tests pin it to what JAX reports."""

from __future__ import annotations

import pytest
from jax.experimental import topologies
from jax.experimental.pallas import tpu as pltpu
from pydantic import ValidationError

from maxkernel.tools.tpu_specs import TPU_SPECS, get_spec, spec_for_device_kind

_CHIPS = {
    "v4": pltpu.ChipVersion.TPU_V4,
    "v5e": pltpu.ChipVersion.TPU_V5E,
    "v5p": pltpu.ChipVersion.TPU_V5P,
    "v6e": pltpu.ChipVersion.TPU_V6E,
    "7x": pltpu.ChipVersion.TPU_7X,
}


def test_table_has_exactly_the_five_generations() -> None:
    assert list(TPU_SPECS) == ["v4", "v5e", "v5p", "v6e", "7x"]
    for key, row in TPU_SPECS.items():
        assert row.name == key
        assert row.source and "docs" in row.source
        assert row.peak_bf16_tflops > 0 and row.hbm_gbps > 0 and row.hbm_gib > 0


@pytest.mark.parametrize(
    ("alias", "expected"),
    [
        ("v6", "v6e"),
        ("Trillium", "v6e"),
        ("tpu7x", "7x"),
        ("ironwood", "7x"),
        ("v7x", "7x"),
        ("V5E", "v5e"),
        ("v5e:2x2", "v5e"),
        ("v5litepod-8", "v5e"),
        ("TPU v5 lite", "v5e"),
        ("TPU v5", "v5p"),
        ("tpu7x:2x2x1", "7x"),
        ("v4", "v4"),
    ],
)
def test_get_spec_accepts_aliases(alias: str, expected: str) -> None:
    assert get_spec(alias).name == expected


def test_unknown_generation_lists_valid_names() -> None:
    with pytest.raises(ValueError, match=r"v5e.*v6e|7x"):
        get_spec("v9000")
    with pytest.raises(ValueError):
        get_spec("")


def test_rows_are_frozen() -> None:
    with pytest.raises(ValidationError):
        TPU_SPECS["v5e"].vmem_mib = 1  # type: ignore[misc]


def test_spec_for_device_kind_is_none_for_cpu() -> None:
    assert spec_for_device_kind("cpu") is None
    assert spec_for_device_kind("TPU v6 lite") is TPU_SPECS["v6e"]


@pytest.mark.parametrize("gen", list(TPU_SPECS))
def test_vmem_and_mxu_agree_with_jax_tpu_info(gen: str) -> None:
    row = TPU_SPECS[gen]
    info = pltpu.get_tpu_info_for_chip(_CHIPS[gen], 1)
    assert row.vmem_bytes == info.vmem_capacity_bytes
    assert row.mxu_shape == (info.mxu_column_size, info.mxu_column_size)
    assert row.mxus_per_core == info.num_mxus
    assert row.default_scoped_vmem_mib <= row.vmem_mib


@pytest.mark.parametrize("gen", list(TPU_SPECS))
def test_topology_names_give_the_expected_device(gen: str) -> None:
    row = TPU_SPECS[gen]
    device = topologies.get_topology_desc(row.topology, "tpu").devices[0]
    assert device.device_kind == row.device_kind
    assert getattr(device, "num_cores", 1) == row.tensorcores_per_device


def test_generation_names_have_one_source() -> None:
    """The literal, the harness's list, the defaults and the fallback all come from the spec table."""
    from typing import get_args

    from maxkernel.tools import results, tpu_specs

    assert tpu_specs.GENERATIONS == tuple(TPU_SPECS)
    assert set(get_args(tpu_specs.TpuGeneration)) == set(tpu_specs.GENERATIONS)
    assert results.TPU_GENERATIONS == tpu_specs.GENERATIONS
    assert set(tpu_specs.DEFAULT_GENERATIONS) <= set(tpu_specs.GENERATIONS)
    assert tpu_specs.first_generation([]) == tpu_specs.FALLBACK_GENERATION
    assert tpu_specs.first_generation(["7x", "v4"]) == "7x"


def test_context_normalises_and_checks_generations() -> None:
    """Studio and Python callers build `Context` directly: they get the CLI's checks."""
    from maxkernel.context import Context
    from maxkernel.tools.tpu_specs import DEFAULT_GENERATIONS, normalise_generations

    assert Context(model="offline").tpu == list(DEFAULT_GENERATIONS)
    assert Context(model="offline", tpu=["trillium", "v5e", "V6E"]).tpu == ["v6e", "v5e"]
    with pytest.raises(ValueError, match="v9x.*choose from v4, v5e, v5p, v6e, 7x"):
        Context(model="offline", tpu=["v9x"])
    assert normalise_generations("ironwood, v5litepod-8") == ["7x", "v5e"]


def test_importing_the_spec_table_leaves_the_environment_alone() -> None:
    import subprocess
    import sys

    code = "import os, maxkernel.tools.tpu_specs; print(os.environ.get('ALLOW_MULTIPLE_LIBTPU_LOAD'))"
    env = {k: v for k, v in __import__("os").environ.items() if k != "ALLOW_MULTIPLE_LIBTPU_LOAD"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None"
