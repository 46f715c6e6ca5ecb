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
