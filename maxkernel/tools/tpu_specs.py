"""Per-generation TPU facts that the estimators, prompts and reports share.

Two kinds of figure live side by side here and must not be confused:

* **Public figures** (``peak_bf16_tflops``, ``hbm_gbps``, ...) are what Google's Cloud TPU documentation
  states *per chip*. They are what a human compares against and what prompts quote.
* **Compiler-model figures** (``compiler_*``) are what the TPU compiler in libtpu 0.0.42.1 itself assumes
  *per JAX device* when it fills ``compiled.cost_analysis()["optimal_seconds"]``. They were measured on a
  CPU machine by AOT-compiling a trivial Pallas kernel with a ``pl.CostEstimate`` holding only flops (or only
  bytes, or only transcendentals) and dividing by ``optimal_seconds``. The block model in
  :mod:`maxkernel.tools.estimate` uses these so that its numbers and the compiler's reference estimate are
  on the same scale, which is what a speedup ratio needs.

A "JAX device" is not always a chip: the AOT topology ``v4:2x2x1`` exposes one device per TensorCore,
``v5p:2x2x1`` one per chip (megacore, two TensorCores), ``tpu7x:2x2x1`` one per TensorCore (Ironwood's two
chiplets are separate devices). ``tensorcores_per_device`` records what the topology gives.

VMEM capacities (per TensorCore) were measured the same way: a Pallas kernel whose double-buffered blocks
exceed VMEM fails to compile with ``RESOURCE_EXHAUSTED ... would exceed memory (size=N)`` / ``Used X of Y
vmem``, and one that exceeds only the default scoped limit fails with ``Scoped allocation with size X and
limit Y``. The capacities agree with ``jax.experimental.pallas.tpu.get_tpu_info_for_chip`` in JAX 0.10.2
(v4 16 MiB, v5e 128 MiB, v5p 64 MiB, v6e 128 MiB, 7x 64 MiB); the Cloud TPU pages do not list VMEM.
"""

from __future__ import annotations

import glob
import os
from types import MappingProxyType
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

TpuGeneration = Literal["v4", "v5e", "v5p", "v6e", "7x"]
"""Canonical generation names, for type checkers; checked against the rows of `TPU_SPECS` below, the one
place a generation is added (a row, plus its spellings in `_ALIASES`)."""


def allow_concurrent_compile_only_libtpu() -> bool:
    """On a machine with no TPU attached, let several processes load libtpu at once.

    libtpu takes /tmp/libtpu_lockfile when its PJRT plugin initialises - which any JAX backend
    initialisation does, and which `get_topology_desc` needs. On a CPU-only machine that lock only
    serialises compile-only work: a second process (a parallel test run, a sandboxed AOT compile) fails
    with "Internal error when accessing libtpu multi-process lockfile" (observed here). libtpu honours
    ALLOW_MULTIPLE_LIBTPU_LOAD=1 to skip the lock. On a TPU host (/dev/accel* or /dev/vfio groups
    present) the lock protects the device and is left alone. Must run before JAX initialises backends;
    `setdefault` so an explicit setting wins. Returns whether the variable is now "1".

    Called where a compile-only topology is created (`estimate.topology_device`, the harness's AOT
    compile) and by the test suite's conftest, never on import: importing the spec table must not change
    the environment of whoever imports it.
    """
    if not (glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")):
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    return os.environ.get("ALLOW_MULTIPLE_LIBTPU_LOAD") == "1"


PER_STEP_OVERHEAD_S: float = 0.27e-6
"""Fixed cost of one grid step of a pipelined pallas_call. Fitted to the measured v5e times the JAX Pallas
TPU matmul guide publishes for 128x128x128 tiles (4096^3: 11.77 ms over 32768 steps; 8192^3: 91.8 ms over
262144 steps): after the block model's memory/compute terms, 0.26-0.27 us per step remain (the guides quote
~0.35 us including the step's own work). benchmarks/calibrate_published.py prints the agreement. Lives here
(not in the estimator) because the offline author's config ranking uses it too and must not import JAX."""

_CLOUD_DOCS = "Google Cloud TPU docs"
_VMEM_SOURCE = (
    "VMEM: measured from libtpu 0.0.42.1 AOT compile errors; agrees with jax.experimental.pallas.tpu "
    "get_tpu_info_for_chip (JAX 0.10.2, 'TPU Hardware Reference' page of the Pallas docs)"
)
_COMPILER_SOURCE = "compiler_*: measured via pl.CostEstimate probes against libtpu 0.0.42.1 optimal_seconds"


class TpuSpec(BaseModel):
    """One TPU generation. Immutable so a shared table cannot be edited by accident at run time."""

    model_config = ConfigDict(frozen=True)

    name: TpuGeneration = Field(description="Canonical key used everywhere in maxkernel.")
    display_name: str = Field(description="Marketing name, for reports.")
    device_kind: str = Field(description="`jax.Device.device_kind` of the AOT topology device.")
    peak_bf16_tflops: float = Field(description="Public peak bf16 TFLOP/s per chip.")
    peak_int8_tops: float | None = Field(
        description="Public peak int8 TOP/s per chip; None if not published."
    )
    hbm_gib: float = Field(description="HBM capacity per chip as published (GB or GiB, see source).")
    hbm_gbps: float = Field(description="Public HBM bandwidth per chip, GB/s.")
    vmem_mib: int = Field(description="VMEM capacity per TensorCore, MiB (measured, see module docstring).")
    default_scoped_vmem_mib: int = Field(
        description="Scoped-VMEM limit a pallas_call gets without `vmem_limit_bytes` (measured)."
    )
    mxu_shape: tuple[int, int] = Field(description="Systolic array shape of one MXU.")
    mxus_per_core: int = Field(description="MXUs per TensorCore.")
    tensorcores_per_chip: int
    tensorcores_per_device: int = Field(description="TensorCores behind one device of the AOT topology.")
    topology: str = Field(description="Name for jax.experimental.topologies.get_topology_desc(name, 'tpu').")
    compiler_peak_tflops: float = Field(description="Per-device peak the TPU compiler's cost model assumes.")
    compiler_hbm_gbps: float = Field(description="Per-device HBM bandwidth the cost model assumes.")
    compiler_transcendentals_per_s: float = Field(
        description="Per-device transcendental rate the cost model assumes."
    )
    bf16_valu_cost: float = Field(
        description="Vector-ALU time of an elementwise op on bf16 values, per element, against f32 (the "
        "compiler's bundle schedule: benchmarks/calibrate_vpu_slots.py). Above 1 where the VPU has no bf16 "
        "arithmetic and unpacks, computes in f32 and repacks; below 1 where it works on packed bf16 vregs."
    )
    bf16_eup_cost: float = Field(
        description="Time of a transcendental of a bf16 value against an f32 one (same schedule reading): "
        "the EUP computes in f32, so where bf16 is unpacked and repacked around it the op takes longer."
    )
    source: str = Field(description="Where each figure comes from.")

    @property
    def vmem_bytes(self) -> int:
        return self.vmem_mib * 2**20

    @property
    def default_scoped_vmem_bytes(self) -> int:
        return self.default_scoped_vmem_mib * 2**20

    @property
    def device_peak_flops(self) -> float:
        """bf16 FLOP/s of one JAX device, on the compiler's scale (what estimates divide by)."""
        return self.compiler_peak_tflops * 1e12

    @property
    def device_hbm_bytes_per_s(self) -> float:
        return self.compiler_hbm_gbps * 1e9

    @property
    def device_peak_int8_ops(self) -> float | None:
        """Public int8 peak scaled to one device; None where no int8 figure is published."""
        if self.peak_int8_tops is None:
            return None
        return self.peak_int8_tops * 1e12 * self.tensorcores_per_device / self.tensorcores_per_chip


_ROWS: tuple[TpuSpec, ...] = (
    TpuSpec(
        name="v4",
        display_name="TPU v4",
        device_kind="TPU v4",
        peak_bf16_tflops=275.0,
        peak_int8_tops=275.0,
        hbm_gib=32.0,
        hbm_gbps=1200.0,
        vmem_mib=16,
        default_scoped_vmem_mib=16,
        mxu_shape=(128, 128),
        mxus_per_core=4,
        tensorcores_per_chip=2,
        tensorcores_per_device=1,
        topology="v4:2x2x1",
        compiler_peak_tflops=137.0,
        compiler_hbm_gbps=491.2,
        compiler_transcendentals_per_s=0.538e12,
        bf16_valu_cost=2.57,
        bf16_eup_cost=1.67,
        source=(
            f"{_CLOUD_DOCS} 'TPU v4' page (275 TFLOP/s bf16 or int8 per chip; HBM2 32 GiB, 1200 GBps; "
            f"2 TensorCores x 4 MXUs). {_VMEM_SOURCE}. {_COMPILER_SOURCE}."
        ),
    ),
    TpuSpec(
        name="v5e",
        display_name="TPU v5e",
        device_kind="TPU v5 lite",
        peak_bf16_tflops=197.0,
        peak_int8_tops=393.0,
        hbm_gib=16.0,
        hbm_gbps=819.0,
        vmem_mib=128,
        default_scoped_vmem_mib=16,
        mxu_shape=(128, 128),
        mxus_per_core=4,
        tensorcores_per_chip=1,
        tensorcores_per_device=1,
        topology="v5e:2x2",
        compiler_peak_tflops=197.0,
        compiler_hbm_gbps=737.7,
        compiler_transcendentals_per_s=1.536e12,
        bf16_valu_cost=2.50,
        bf16_eup_cost=1.58,
        source=(
            f"{_CLOUD_DOCS} 'TPU v5e' page (197 TFLOP/s bf16, 393 TOP/s int8; 16 GB HBM2, 819 GBps; "
            f"1 TensorCore x 4 MXUs). {_VMEM_SOURCE}. {_COMPILER_SOURCE}."
        ),
    ),
    TpuSpec(
        name="v5p",
        display_name="TPU v5p",
        device_kind="TPU v5",
        peak_bf16_tflops=459.0,
        peak_int8_tops=None,
        hbm_gib=95.0,
        hbm_gbps=2765.0,
        vmem_mib=64,
        default_scoped_vmem_mib=16,
        mxu_shape=(128, 128),
        mxus_per_core=4,
        tensorcores_per_chip=2,
        tensorcores_per_device=2,
        topology="v5p:2x2x1",
        compiler_peak_tflops=394.0,
        compiler_hbm_gbps=2350.4,
        compiler_transcendentals_per_s=3.072e12,
        bf16_valu_cost=2.49,
        bf16_eup_cost=1.56,
        source=(
            f"{_CLOUD_DOCS} 'TPU v5p' page (459 TFLOP/s bf16; HBM2e 95 GB, 2765 GBps; 4 MXUs per "
            f"TensorCore; no int8 figure published there) and 'TPU7x (Ironwood)' comparison table "
            f"(2 TensorCores per chip). {_VMEM_SOURCE}. {_COMPILER_SOURCE}."
        ),
    ),
    TpuSpec(
        name="v6e",
        display_name="TPU v6e (Trillium)",
        device_kind="TPU v6 lite",
        peak_bf16_tflops=918.0,
        peak_int8_tops=1836.0,
        hbm_gib=32.0,
        hbm_gbps=1638.0,
        vmem_mib=128,
        default_scoped_vmem_mib=32,
        mxu_shape=(256, 256),
        mxus_per_core=2,
        tensorcores_per_chip=1,
        tensorcores_per_device=1,
        topology="v6e:2x2",
        compiler_peak_tflops=918.0,
        compiler_hbm_gbps=1638.0,
        compiler_transcendentals_per_s=1.792e12,
        bf16_valu_cost=0.70,
        bf16_eup_cost=0.99,
        source=(
            f"{_CLOUD_DOCS} 'TPU v6e' page (918 TFLOP/s bf16, 1836 TOP/s int8; 32 GB HBM, 1638 GBps; "
            f"1 TensorCore with two 256x256 MXUs). {_VMEM_SOURCE}. {_COMPILER_SOURCE}."
        ),
    ),
    TpuSpec(
        name="7x",
        display_name="TPU7x (Ironwood)",
        device_kind="TPU7x",
        peak_bf16_tflops=2307.0,
        peak_int8_tops=None,
        hbm_gib=192.0,
        hbm_gbps=7380.0,
        vmem_mib=64,
        default_scoped_vmem_mib=32,
        mxu_shape=(256, 256),
        mxus_per_core=2,
        tensorcores_per_chip=2,
        tensorcores_per_device=1,
        topology="tpu7x:2x2x1",
        compiler_peak_tflops=996.0,
        compiler_hbm_gbps=3686.0,
        compiler_transcendentals_per_s=1.946e12,
        bf16_valu_cost=0.70,
        bf16_eup_cost=0.99,
        source=(
            f"{_CLOUD_DOCS} 'TPU7x (Ironwood)' page (2307 TFLOP/s bf16, 4614 TFLOP/s fp8, no int8 figure; "
            f"192 GiB HBM, 7380 GB/s; 2 TensorCores per chip, each a separate device). MXU shape and count "
            f"from jax.experimental.pallas.tpu get_tpu_info_for_chip (JAX 0.10.2). {_VMEM_SOURCE}. "
            f"{_COMPILER_SOURCE}."
        ),
    ),
)

TPU_SPECS: MappingProxyType[str, TpuSpec] = MappingProxyType({row.name: row for row in _ROWS})
"""Read-only table keyed by canonical generation name."""

GENERATIONS: tuple[str, ...] = tuple(TPU_SPECS)
"""Canonical generation names in table order: what the harness, CLI help and `Context` accept."""

DEFAULT_GENERATIONS: tuple[str, ...] = ("v5e", "v6e")
"""Generations every kernel must compile for when the caller names none (CLI, `Context`, harness)."""

FALLBACK_GENERATION: str = DEFAULT_GENERATIONS[0]
"""The generation a one-generation step (estimate, profile) uses when given an empty list."""

if set(get_args(TpuGeneration)) != set(GENERATIONS):  # pragma: no cover - a table edit without the literal
    raise RuntimeError(
        f"TpuGeneration {get_args(TpuGeneration)} does not match the TPU_SPECS rows {GENERATIONS}"
    )

_ALIASES: dict[str, str] = {
    "v4": "v4",
    "tpuv4": "v4",
    "v5e": "v5e",
    "v5lite": "v5e",
    "v5litepod": "v5e",
    "tpuv5e": "v5e",
    "tpuv5lite": "v5e",
    "v5p": "v5p",
    "v5": "v5p",
    "tpuv5": "v5p",
    "tpuv5p": "v5p",
    "v6e": "v6e",
    "v6": "v6e",
    "v6lite": "v6e",
    "trillium": "v6e",
    "tpuv6e": "v6e",
    "tpuv6lite": "v6e",
    "7x": "7x",
    "v7x": "7x",
    "v7": "7x",
    "tpu7x": "7x",
    "tpuv7x": "7x",
    "ironwood": "7x",
}


def _normalise(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def get_spec(gen: str) -> TpuSpec:
    """Look a generation up by canonical name, alias, AOT topology name or device kind.

    Accepting every spelling people and JAX use ("trillium", "TPU v6 lite", "v6e:2x2") keeps callers from
    growing their own ad-hoc mappings; an unknown name fails loudly with the valid choices, because
    silently falling back to some default generation would make every estimate quietly wrong.
    """
    if not isinstance(gen, str) or not gen.strip():
        raise ValueError(f"TPU generation must be a non-empty string, got {gen!r}; valid: {list(TPU_SPECS)}")
    key = gen.strip()
    if key in TPU_SPECS:
        return TPU_SPECS[key]
    for row in _ROWS:
        if key == row.topology or key == row.device_kind:
            return row
    # "v6e:2x2" or "v5litepod-8" style names: strip the topology / slice suffix.
    base = key.split(":")[0].split("-")[0]
    canonical = _ALIASES.get(_normalise(base))
    if canonical is None:
        raise ValueError(
            f"Unknown TPU generation {gen!r}. Valid names: {sorted(TPU_SPECS)}; aliases: "
            f"{sorted(a for a in _ALIASES if a not in TPU_SPECS)}; device kinds: "
            f"{[r.device_kind for r in _ROWS]}."
        )
    return TPU_SPECS[canonical]


def spec_for_device_kind(device_kind: str) -> TpuSpec | None:
    """Map a real device's `device_kind` to its row, or None for non-TPU devices (CPU/GPU traces)."""
    for row in _ROWS:
        if device_kind == row.device_kind:
            return row
    try:
        return get_spec(device_kind)
    except ValueError:
        return None


def normalise_generations(names: list[str] | tuple[str, ...] | str) -> list[str]:
    """Canonical generation names, deduplicated in order, from any spelling `get_spec` accepts.

    The one check every entry point shares (CLI `--tpu`, `Context`, the harness's `EvalOptions`): an
    unknown name raises ValueError naming the valid ones. A comma-separated string is split.
    """
    if isinstance(names, str):
        names = [t for t in names.split(",") if t.strip()]
    out: list[str] = []
    for raw in names:
        try:
            name = get_spec(raw).name
        except ValueError as exc:
            raise ValueError(f"unknown TPU generation {raw!r}; choose from {', '.join(GENERATIONS)}") from exc
        if name not in out:
            out.append(name)
    return out


def first_generation(names: list[str] | tuple[str, ...]) -> str:
    """The generation a one-generation step uses: the first named, else `FALLBACK_GENERATION`."""
    return names[0] if names else FALLBACK_GENERATION
