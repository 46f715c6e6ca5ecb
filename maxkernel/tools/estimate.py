"""TPU time *estimates* made on a CPU machine: the TPU compiler's cost model and a Pallas block model.

Nothing here is measured. Every result carries ``kind="estimate"`` and a ``method`` string, and every number
field is named ``est_*`` / ``estimated_*`` so it cannot be mistaken for a timing from a device.

Two estimators, for two different programs:

* :func:`estimate_xla` asks the real TPU compiler (libtpu, through an ahead-of-time compile for a topology
  device) what it thinks a plain XLA program costs: ``cost_analysis()`` flops / bytes / ``optimal_seconds``
  and the ``estimated_cycles`` it writes per fusion into the compiled HLO. It is blind inside a Pallas
  ``tpu_custom_call`` unless the kernel passes ``pl.CostEstimate`` — and then it simply echoes that estimate.
* :func:`estimate_pallas` is a block-level model of each ``pallas_call`` in a jaxpr: it replays the grid
  (last axis fastest), evaluates every BlockSpec index map per step, counts the HBM<->VMEM bytes the Pallas
  TPU pipeline moves (a block is DMA'd again only when its block index changes between consecutive steps),
  counts MXU / VPU / EUP work in the kernel body, and turns that into seconds with the per-device figures
  from :mod:`maxkernel.tools.tpu_specs`. It exists because the compiler cannot see into a kernel, and the
  agents need to know *why* a kernel is slow (re-fetching, too many tiny steps, VMEM blow-up) before any TPU
  is available.

The model's constants are documented assumptions (see ``ASSUMPTIONS``); ``benchmarks/calibrate_block_model.py``
compares it with the compiler's estimate for the equivalent XLA programs.
"""

from __future__ import annotations

import functools
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import jax
import jax.extend.core as jex_core
import numpy as np
from pydantic import BaseModel, Field

from maxkernel.tools import loop_pricing
from maxkernel.tools.jaxpr import (
    FREE_IN_KERNEL,
    FREE_IN_XLA,
    KERNEL_CALL_PRIMITIVES,
    REDUCTIONS,
    TRANSCENDENTAL,
    XLA_LOOP_FUSIBLE,
    as_jaxpr,
    sub_jaxprs,
)
from maxkernel.tools.tpu_specs import (
    PER_STEP_OVERHEAD_S,
    TpuSpec,
    allow_concurrent_compile_only_libtpu,
    get_spec,
)

# --------------------------------------------------------------------------------------------------------
# Documented model constants. Change them only together with benchmarks/calibrate_block_model.py.
# --------------------------------------------------------------------------------------------------------

VALU_VREG_OPS_PER_CYCLE: int = 4
"""Vector-ALU (8 sublanes x 128 lanes) vreg operations per EUP vreg operation - per cycle where the EUP
takes one vreg a cycle. Read off the TPU compiler's own instruction schedule, not its cost model
(benchmarks/calibrate_vpu_slots.py; libtpu 0.0.42.1): a Pallas kernel whose body is 16 f32 multiply-adds per
element over 512 vregs is scheduled into ~4,170 bundles on v5e, v5p, v6e and 7x (~3.9 VALU vreg ops per
bundle: four vector-ALU slots), and 16 exps into ~8,350 (one EUP op per bundle); on v4 into ~8,260 and
~17,800 (two slots, one EUP op every other bundle - its compiler transcendental rate is that half rate).
Figures: benchmarks/calibration_vpu_slots.md.
So four per EUP vreg on every generation. It was 2 (an unmeasured assumption), which priced every softmax,
norm and exp-heavy kernel body at twice the VPU time: held against published v4 flash-attention forward
times, that term alone came to ~2.5x the measured time of the whole kernel."""

VREG_ELEMENTS: int = 8 * 128
"""Elements in one 32-bit vreg (8 sublanes x 128 lanes, the TPU VPU shape in the Cloud TPU v6e docs)."""

F32_MXU_PASSES: dict[str, int] = {"default": 1, "highest": 6}
"""bf16 MXU passes of an f32 x f32 matmul *inside a Mosaic kernel*, read from Mosaic's own output: with
LIBTPU_INIT_ARGS=--xla_mosaic_dump_to=DIR (libtpu 0.0.42.1), a 128x128x128 f32 dot lowers on v5e and v6e to
16 `llo.vmatmul` in `matmul_mode<round>` at DEFAULT precision (operands rounded to bf16 on the way into
the MXU: one pass) and to 96 at HIGHEST (`contract_precision<fp32>`: modes high / low / soft_low_eight /
soft_middle_eight, the six-pass bf16_6x scheme). Mosaic accepts no other precision (JAX's Pallas lowering
raises for HIGH). So a DEFAULT f32 kernel costs what XLA's DEFAULT f32 dot costs, and a HIGHEST kernel 6x."""

XLA_F32_PASSES: dict[str, int] = {"DEFAULT": 1, "HIGH": 3, "HIGHEST": 6}
"""bf16 MXU passes XLA runs for an f32 dot per `lax.Precision` on TPU. JAX's 'Matmul precision' page
(https://docs.jax.dev/en/latest/201/precision.html): by default float32 dots are computed with bfloat16
arithmetic on TPU; HIGH is bf16_3x and HIGHEST is bf16_6x (the `BF16_BF16_F32_X3` / `_X6` algorithm presets
name the same schemes; Cloud TPU's bfloat16 page: "By default, TPUs perform matrix multiplication operations
with bfloat16 values and accumulations with IEEE float32"). `jax_default_matmul_precision` is written into
each dot's `precision` when the jaxpr is traced, so it is seen here too. The TPU compiler's cost model
ignores precision (4096^3 f32 on v5e: 1061.6 us at DEFAULT, HIGH and HIGHEST alike, measured here), so
`estimate_xla` adds the extra passes of HIGH/HIGHEST dots itself: both sides of a speedup then pay for the
same precision, at the same rate per pass."""

TRANSCENDENTAL_VPU_OPS: dict[str, int] = {"erfc": 60, "erf_inv": 37, "logistic": 3}
"""VPU ops per element that the TPU compiler spends on a transcendental besides its EUP op, read from
`cost_analysis()` of a one-op f32 program (libtpu 0.0.42.1, the same on v5e and v6e): erfc is a 60-flop
polynomial around one exp, erf_inv 37 flops and two transcendentals, logistic three flops around one
exp; exp, log, tanh, erf, log1p, expm1, sqrt, rsqrt, pow, sin, cos, atan2 and cbrt count one transcendental
and no flops. A kernel's equation is charged the same (`_body_work`), and the reference's too
(`_reference_work`), so both pay for the same work. What Mosaic does (its LLO dump, v5e): erf is one
`llo.verf`, as the compiler counts it; logistic is vneg / vmul / vadd around vexp and vrecip; erf_inv is
37 vector ALU ops (vselect, vmul, vadd, vsub, vcmp, vabs) around vsqrt and vln1p - the compiler's count
exactly; erfc has no Pallas TPU lowering, so a kernel meets it only if it was never compiled."""

RANDOM_BITS_VPU_OPS: int = 115
"""VPU ops per 32-bit word of `random_bits` on a threefry key (partitionable counters, JAX 0.10's default):
`jax.random.bits(key, (1024, 1024)) ^ x` costs 116 flops per element in `cost_analysis()` on v5e and v6e
(libtpu 0.0.42.1), the xor one of them. A reference's `random_bits` is one equation; a kernel computes the
same bits as the ~115 uint32 maps of threefry2x32's 20 rounds, each charged by the block model, so this is
what the reference's side is charged for them (`_reference_work`)."""

MAX_KNOWN_ELEMENTS: int = 1 << 16
"""Integer arrays up to this size are tracked by value through the XLA ops between kernels (so a kernel's
scalar prefetch, e.g. group sizes or their cumulative offsets, is known when the inputs are)."""

MAX_EXACT_STEPS: int = 1 << 22
"""Grids up to this many steps are replayed exactly; larger grids replay this many steps and extrapolate
the re-fetch count linearly (flagged in the result's notes)."""

ASSUMPTIONS: dict[str, str] = {
    "per_step_overhead_s": f"{PER_STEP_OVERHEAD_S:g} s per grid step (fitted to the measured v5e matmul times of the JAX Pallas TPU guide)",
    "hbm_bandwidth": "per-device bandwidth the TPU compiler's cost model uses (tpu_specs.compiler_hbm_gbps)",
    "mxu_peak": "per-device bf16 peak the TPU compiler's cost model uses (tpu_specs.compiler_peak_tflops); "
    "int8 at the published int8 peak; dot dims padded up to the MXU shape",
    "f32_matmul": f"f32 operands in a kernel cost {F32_MXU_PASSES['default']} bf16 pass at DEFAULT and "
    f"{F32_MXU_PASSES['highest']} at HIGHEST (read from Mosaic's LLO); the XLA reference's f32 dots are charged "
    f"{XLA_F32_PASSES['DEFAULT']}/{XLA_F32_PASSES['HIGH']}/{XLA_F32_PASSES['HIGHEST']} passes at DEFAULT/HIGH/"
    "HIGHEST (JAX docs), the extra ones on top of the compiler's precision-blind estimate",
    "vpu_rate": f"{VALU_VREG_OPS_PER_CYCLE} vreg ops per EUP vreg x {VREG_ELEMENTS} elements at the compiler's "
    "transcendental rate (four vector-ALU slots per bundle on v5e/v5p/v6e/7x, two on v4 at its half-rate EUP: "
    "read from the compiler's bundle schedule, benchmarks/calibrate_vpu_slots.py); each value counted in whole (8, 128) "
    "vreg tiles (its last two dims padded), so lane-sparse columns cost what the VPU spends on them; ops on "
    "bf16/f16 values at TpuSpec.bf16_valu_cost times the f32 time (~2.5 on v4/v5e/v5p, which unpack to f32; "
    "0.70 on v6e/7x, packed; same schedule reading), and their transcendentals at TpuSpec.bf16_eup_cost "
    "times the f32 EUP time (~1.6 on v4/v5e/v5p, 0.99 on v6e/7x)",
    "eup_rate": "transcendentals at the compiler cost model's rate (tpu_specs.compiler_transcendentals_per_s); "
    "erfc, erf_inv and logistic also pay the VPU ops the compiler spends around their EUP op "
    "(TRANSCENDENTAL_VPU_OPS)",
    "overlap": "DMA, MXU, VPU and EUP overlap perfectly except the pipeline prologue/epilogue (first "
    "step's input blocks, last output write-back): time = max(memory, compute + exposed DMA) + steps x "
    "overhead",
    "pipeline": "block re-fetched only when its block index changes between consecutive grid steps; "
    "outputs written back when their index changes and after the last step; 2 buffers per block",
    "megacore": "on devices with several TensorCores (v5p) only 'parallel' grid dimensions are split across "
    "them (busiest core's share); no parallel dimension = one core at its share of the device peak",
    "masked_compute": "a kernel-body cond (pl.when) whose predicate depends only on the grid position (and "
    "on scalar prefetch whose contents the task's own inputs give) is charged per branch for the fraction of "
    "steps taking it; other conds: the dearest branch every step",
    "scalar_prefetch": "index maps reading scalar prefetch are replayed with the task's own values when its "
    "small integer inputs determine them (no copy where the block index repeats); else every step is "
    "counted as a re-fetch (upper bound, flagged)",
    "scalar_work": "scalar-unit work (index maps, SMEM reads, scalar loops such as a walk over group sizes) "
    "is not charged beyond the per-step overhead - an underestimate for kernels that loop over many groups "
    "per step",
    "reference": "XLA reference = the compiler's optimal_seconds; when that is bytes alone, re-priced with each "
    "top-level op's operands and result once (as kernels are); plus extra passes of HIGH/HIGHEST f32 dots "
    "and convs; never below its own compute at the kernel's rates (MXU at its dots' passes, elementwise ops "
    "at the VPU rate, transcendentals at the EUP rate), since the compiler prices elementwise work at the "
    "MXU peak",
    "xla_ops": "ops outside pallas_call cost (input + output bytes) / HBM bandwidth, no fusion modelled; a "
    "gather or dynamic_slice reads only what it picks (at most its output's bytes of its operand)",
    "control_flow": "cond = most expensive branch; scan = body x length; while = body x trip count when it "
    "has counter form (fori_loop; in kernels the mean over grid steps of a grid-dependent bound), else once "
    "(flagged)",
    "reference_loops": "the compiler's model prices a while body once; the reference's loops are charged per "
    "iteration by weighting the compiler's per-instruction estimated_cycles with the trip counts around them",
}

BoundClass = Literal["memory", "compute", "overhead"]

# --------------------------------------------------------------------------------------------------------
# Result models
# --------------------------------------------------------------------------------------------------------


class XlaEstimate(BaseModel):
    """What the TPU compiler's cost model says about one program, compiled ahead of time on CPU."""

    kind: Literal["estimate"] = "estimate"
    method: str
    gen: str
    topology: str
    device_kind: str
    est_flops: float | None = Field(description="cost_analysis()['flops']; None when the compiler omits it.")
    est_bytes_accessed: float | None
    est_transcendentals: float | None
    estimated_seconds: float | None = Field(
        description="optimal_seconds plus est_precision_surcharge_seconds plus est_loop_extra_seconds, raised "
        "to est_compute_floor_seconds where that is higher: the reference's estimated time."
    )
    est_compiler_seconds: float | None = Field(
        default=None, description="cost_analysis()['optimal_seconds'] as the compiler reports it."
    )
    est_once_bytes: float | None = Field(
        default=None,
        description="HBM bytes of the compiled program with every top-level op's operands and result counted "
        "once (VMEM-resident buffers excluded); used instead of the compiler's byte count when that alone "
        "set optimal_seconds.",
    )
    est_precision_surcharge_seconds: float = Field(
        default=0.0,
        description="Extra bf16 MXU passes of HIGH/HIGHEST f32 dots and convolutions, which the compiler's model does not "
        "charge (lower bound: only time beyond the dot's own minimum HBM traffic is added).",
    )
    est_loop_extra_seconds: float = Field(
        default=0.0,
        description="Iterations of loops (lax.map / scan / fori_loop / while) beyond those the compiler's "
        "model priced: it prices a while body once per program, so (trips - priced) x the body's own "
        "estimate (the body compiled as a program of its own, nested loops included) is added.",
    )
    est_compute_floor_seconds: float | None = Field(
        default=None,
        description="The reference's own compute priced the way the block model prices a kernel's: max of its "
        "dots' MXU time (each at the passes its precision asks for, dims padded to the MXU), its elementwise "
        "ops (counted from its jaxpr, unpadded) at the block model's VPU rate and its transcendentals at the "
        "EUP rate. The compiler's model prices elementwise work at the MXU peak; this floor keeps a kernel "
        "and its reference on one VPU rate. None: not computed.",
    )
    est_compute_floor_extra_seconds: float = Field(
        default=0.0,
        description="How far est_compute_floor_seconds lies above the compiler-based figure (optimal_seconds "
        "+ surcharge + loop iterations): what was added to estimated_seconds.",
    )
    est_cycles_total: int | None = Field(description="Sum of `estimated_cycles` over fusions in the HLO.")
    est_cycles_by_fusion: dict[str, int]
    est_cycles_clock_hz: float | None = Field(
        default=None,
        description="Clock to turn cycles into seconds. None: libtpu publishes none, and cycles/optimal_"
        "seconds varied 1.0-8.8 GHz across programs here, so no single clock converts them.",
    )
    opaque_custom_calls: list[str] = Field(
        description="Custom-call targets (e.g. tpu_custom_call = a Pallas kernel) whose cost the compiler "
        "cannot see; their cost is missing from the estimate unless the kernel passed pl.CostEstimate."
    )
    est_compile_seconds: float = Field(
        description="Wall time of the AOT compile on this machine (host cost)."
    )
    raw_cost_analysis: dict[str, float]
    notes: list[str] = Field(default_factory=list)


class OperandTraffic(BaseModel):
    """HBM<->VMEM traffic of one pallas_call operand, as the block model replays it."""

    role: Literal["input", "output"]
    origin: str = Field(description="Which argument / output this is (BlockMapping.origin).")
    memory_space: str
    block_shape: tuple[int, ...]
    array_shape: tuple[int, ...]
    dtype: str
    block_bytes: int
    est_transfers: float = Field(description="Number of block DMAs (fetches or write-backs).")
    est_bytes: float
    index_map_exact: bool = Field(
        description="False when the index map could not be evaluated (upper bound)."
    )


class PallasCallEstimate(BaseModel):
    """Block-model estimate of one pallas_call (per invocation; `multiplicity` says how often it runs)."""

    name: str
    grid: tuple[int, ...]
    multiplicity: float = Field(description="How many times the call runs (scan lengths around it).")
    est_grid_steps: int
    operands: list[OperandTraffic]
    est_hbm_bytes: float = Field(description="Auto-pipelined block traffic plus manual DMA bytes.")
    est_manual_dma_bytes: float
    est_mxu_flops: float = Field(description="Useful matmul flops (2*M*N*K) over all steps.")
    est_mxu_padded_flops: float = Field(description="Flops after padding dot dims to the MXU shape.")
    est_vpu_elementwise_ops: float
    est_transcendentals: float
    est_vmem_bytes: int = Field(description="Sum of blocks x buffer count + scratch.")
    vmem_limit_bytes: int = Field(description="Scoped VMEM limit in force (vmem_limit_bytes or the default).")
    vmem_capacity_bytes: int
    vmem_exceeds_limit: bool
    vmem_exceeds_capacity: bool
    est_memory_seconds: float
    est_mxu_seconds: float
    est_vpu_seconds: float
    est_eup_seconds: float
    est_overhead_seconds: float
    est_exposed_dma_seconds: float = Field(
        description="Prologue/epilogue DMA that cannot overlap compute: first inputs, last write-back."
    )
    estimated_seconds: float
    bound: BoundClass
    notes: list[str] = Field(default_factory=list)


class PallasEstimate(BaseModel):
    """Block-model estimate of a whole program: its pallas_calls plus the XLA ops around them."""

    kind: Literal["estimate"] = "estimate"
    method: str
    gen: str
    estimated_seconds: float
    est_pallas_seconds: float
    est_xla_seconds: float = Field(description="Ops outside pallas_call, bytes / bandwidth.")
    bound: BoundClass
    est_hbm_bytes: float
    est_xla_bytes: float
    est_mxu_flops: float
    est_vpu_elementwise_ops: float
    est_transcendentals: float
    est_grid_steps: int
    est_vmem_bytes: int = Field(description="Largest VMEM footprint of any pallas_call.")
    vmem_exceeds_limit: bool
    vmem_exceeds_capacity: bool
    pallas_calls: list[PallasCallEstimate]
    xla_op_count: int
    assumptions: dict[str, str]
    notes: list[str] = Field(default_factory=list)
    unpriced: str | None = Field(
        None,
        description="why no figure above can be trusted (a kernel loop of data-dependent length doing work); "
        "harnesses withhold the estimate then",
    )

    def to_markdown(self) -> str:
        """Compact table for prompts and reports; says 'estimate' in the heading on purpose."""
        lines = [
            f"**Block-model estimate ({self.gen}, not measured):** {self.estimated_seconds * 1e6:.2f} us, "
            f"{self.bound}-bound; HBM {self.est_hbm_bytes / 1e6:.2f} MB, MXU {self.est_mxu_flops / 1e9:.3f} "
            f"GFLOP, {self.est_grid_steps} grid steps, VMEM {self.est_vmem_bytes / 2**20:.2f} MiB",
            "",
            "| pallas_call | grid | steps | HBM MB | mem us | mxu us | vpu us | eup us | ovh us | est us | "
            "bound | VMEM MiB |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for c in self.pallas_calls:
            lines.append(
                f"| {c.name} | {c.grid} | {c.est_grid_steps} | {c.est_hbm_bytes / 1e6:.2f} | "
                f"{c.est_memory_seconds * 1e6:.2f} | {c.est_mxu_seconds * 1e6:.2f} | "
                f"{c.est_vpu_seconds * 1e6:.2f} | {c.est_eup_seconds * 1e6:.2f} | "
                f"{c.est_overhead_seconds * 1e6:.2f} | {c.estimated_seconds * 1e6:.2f} | {c.bound} | "
                f"{c.est_vmem_bytes / 2**20:.2f}{' (!)' if c.vmem_exceeds_limit else ''} |"
            )
        if self.xla_op_count:
            lines.append(
                f"\nOps outside Pallas: {self.xla_op_count}, {self.est_xla_bytes / 1e6:.2f} MB, "
                f"{self.est_xla_seconds * 1e6:.2f} us (estimate)."
            )
        lines.extend(f"- {n}" for n in self.notes)
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------
# estimate_xla
# --------------------------------------------------------------------------------------------------------

ArgSpec = jax.ShapeDtypeStruct | tuple[Sequence[int], Any] | Any

_CYCLES_RE = re.compile(r'"estimated_cycles":"(\d+)"')
_INSTR_NAME_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
_CUSTOM_TARGET_RE = re.compile(r'custom_call_target="([^"]+)"')


def _to_sds(spec: ArgSpec, sharding: jax.sharding.Sharding) -> jax.ShapeDtypeStruct:
    """Accept ShapeDtypeStructs, arrays or (shape, dtype) pairs: callers hold whichever is handy."""
    if isinstance(spec, tuple) and len(spec) == 2 and not hasattr(spec, "shape"):
        shape, dtype = spec
        return jax.ShapeDtypeStruct(tuple(int(d) for d in shape), dtype, sharding=sharding)
    if hasattr(spec, "shape") and hasattr(spec, "dtype"):
        return jax.ShapeDtypeStruct(tuple(spec.shape), spec.dtype, sharding=sharding)
    raise TypeError(f"arg spec must be a ShapeDtypeStruct, an array or (shape, dtype); got {spec!r}")


def topology_device(gen: str | TpuSpec) -> jax.Device:
    """The compile-only device for a generation (needs libtpu; no TPU attached)."""
    spec = gen if isinstance(gen, TpuSpec) else get_spec(gen)
    return _topology_device(spec.topology)


@functools.cache
def _topology_device(topology: str) -> jax.Device:
    from jax.experimental import topologies

    allow_concurrent_compile_only_libtpu()
    return topologies.get_topology_desc(topology, "tpu").devices[0]


def estimate_xla(fn: Callable[..., Any], arg_specs: Sequence[ArgSpec], gen: str) -> XlaEstimate:
    """Ask the TPU compiler what `fn` costs on `gen`, by compiling it ahead of time on this CPU machine.

    This is the reference side of every speedup estimate: the compiler's own model of the plain XLA program
    is the best TPU timing available without a TPU. Two things it gets wrong are corrected, each said in
    the notes: it prices every f32 dot as one MXU pass whatever its precision (see `XLA_F32_PASSES`), and
    it prices a loop body once whatever the trip count (see :mod:`maxkernel.tools.loop_pricing`). Compile
    errors propagate (a program that does not compile for the TPU has no estimate, and callers must see
    why).
    """
    spec = get_spec(gen)
    device = topology_device(spec)
    sharding = jax.sharding.SingleDeviceSharding(device)
    return _estimate_xla(fn, [_to_sds(s, sharding) for s in arg_specs], spec, device, depth=0)


MAX_LOOP_DEPTH: int = 4
"""Loop nests deeper than this are priced with their innermost bodies once (flagged in the notes)."""

XLA_INTERNAL_CUSTOM_CALLS: frozenset[str] = frozenset({"AllocateBuffer", "ConcatBitcast"})
"""Custom calls the TPU compiler inserts itself (buffer allocation, concatenation as a bitcast): not a
user's opaque kernel, so they are not reported as such."""


def _estimate_xla(
    fn: Callable[..., Any], sds: list[jax.ShapeDtypeStruct], spec: TpuSpec, device: jax.Device, depth: int
) -> XlaEstimate:
    sharding = jax.sharding.SingleDeviceSharding(device)
    sds = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding) for s in sds]
    t0 = time.perf_counter()
    compiled = jax.jit(fn).trace(*sds).lower().compile()
    compile_s = time.perf_counter() - t0
    raw = compiled.cost_analysis()
    if isinstance(raw, list | tuple):  # older JAX returned one dict per computation
        raw = raw[0] if raw else {}
    raw = {str(k): float(v) for k, v in (raw or {}).items()}
    hlo = compiled.as_text()

    cycles: dict[str, int] = {}
    custom_targets: list[str] = []
    internal_targets: list[str] = []
    for line in hlo.splitlines():
        m = _CYCLES_RE.search(line)
        if m:
            name_m = _INSTR_NAME_RE.match(line)
            name = name_m.group(1) if name_m else f"fusion#{len(cycles)}"
            cycles[name] = cycles.get(name, 0) + int(m.group(1))
        if "custom-call(" in line:
            t = _CUSTOM_TARGET_RE.search(line)
            target = t.group(1) if t else "unknown"
            (internal_targets if target in XLA_INTERNAL_CUSTOM_CALLS else custom_targets).append(target)

    notes: list[str] = []
    surcharge = 0.0
    traced: jex_core.ClosedJaxpr | None = None
    try:
        traced = jax.make_jaxpr(fn)(*sds)
        surcharge = _precision_surcharge(traced.jaxpr, spec, 1.0)
    except Exception as exc:  # noqa: BLE001 - the surcharge is a refinement; say so and keep the raw figure
        notes.append(f"precision surcharge not computed: {type(exc).__name__}: {exc}")
    if surcharge:
        notes.append(
            f"{surcharge * 1e6:.2f} us added for the extra MXU passes of HIGH/HIGHEST f32 dots/convs (the compiler's "
            "model prices every f32 dot as one pass)"
        )
    optimal = raw.get("optimal_seconds")
    if optimal is not None and optimal < 0:
        # Seen with the compiler's own ConcatBitcast custom call in the program: optimal_seconds comes back
        # as (roofline - 1). Its own totals at its own rates give the roofline back (agrees to 0.01 % on
        # the sliding-window attention body, where both are available).
        roofline = max(
            (raw.get("flops") or 0.0) / spec.device_peak_flops,
            (raw.get("bytes accessed") or 0.0) / spec.device_hbm_bytes_per_s,
            (raw.get("transcendentals") or 0.0) / spec.compiler_transcendentals_per_s,
        )
        notes.append(
            f"the compiler reported optimal_seconds={optimal:.6g} (negative; internal custom calls: "
            f"{', '.join(sorted(set(internal_targets))) or 'none'}); priced by its own flops/bytes/"
            f"transcendentals at its own rates instead: {roofline * 1e6:.2f} us"
        )
        optimal = roofline
    compiler_optimal = raw.get("optimal_seconds")
    once_bytes = _hlo_once_bytes(hlo)
    bytes_acc = raw.get("bytes accessed")
    if optimal and bytes_acc and once_bytes and not custom_targets:
        bytes_time = bytes_acc / spec.device_hbm_bytes_per_s
        if abs(optimal - bytes_time) <= 0.02 * optimal and once_bytes < bytes_acc:
            # The compiler priced the program by bytes alone, and those bytes count operands and outputs
            # of its fusions several times over (its `utilization` factors: a 512x1024x1024 f32 matmul is
            # charged 3x its lhs and 7x its output). The block model charges a kernel each block it
            # really moves; the reference gets the same rule: every fusion's operands and result once.
            flops_time = (raw.get("flops") or 0.0) / spec.device_peak_flops
            before = optimal
            optimal = max(once_bytes / spec.device_hbm_bytes_per_s, flops_time)
            notes.append(
                f"memory-bound in the compiler's model with {bytes_acc / 1e6:.2f} MB accessed; re-priced at "
                f"{once_bytes / 1e6:.2f} MB (each top-level op's operands and result once), as the block model "
                f"prices kernels: {before * 1e6:.2f} -> {optimal * 1e6:.2f} us"
            )
    loop_extra = 0.0
    cyc = loop_pricing.hlo_loop_cycles(hlo)
    if optimal is not None and cyc.trips:
        if cyc.loop_cycles_once and cyc.cycles_once:
            # The compiler's figure holds every loop body once. Its per-instruction cycle counts, weighted by
            # the trip counts around each instruction, say how much the loops repeat in its own terms: the
            # body as compiled in the program (constants sunk, conversions hoisted, partial unrolling).
            loop_extra = optimal * (cyc.cycles_per_trip / cyc.cycles_once - 1.0)
            notes.append(
                f"loops with trip counts {', '.join(str(t) if t else '?' for t in cyc.trips)}: the compiler's model "
                f"prices a loop body once; its estimated_cycles weighted by trip counts are "
                f"{cyc.cycles_per_trip / cyc.cycles_once:.2f}x those summed once, so {loop_extra * 1e6:.2f} us "
                "added for the other iterations"
            )
            if None in cyc.trips:
                notes.append("a loop's trip count could not be read from the compiled program: priced once")
        elif traced is not None:  # no cycle figures inside the loops: price each body as its own program
            loop_extra = _loop_extra_seconds(traced, hlo, spec, device, depth, notes)
    if custom_targets and "optimal_seconds" not in raw:
        notes.append(
            f"{len(custom_targets)} custom call(s) ({', '.join(sorted(set(custom_targets)))}) are opaque to "
            "the compiler and no pl.CostEstimate was given: flops and optimal_seconds are missing."
        )
    elif custom_targets:
        notes.append(
            "The program contains custom calls; for a Pallas kernel with pl.CostEstimate the compiler's "
            "figures are that CostEstimate echoed back, not an independent estimate."
        )
    floor: float | None = None
    floor_extra = 0.0
    floor_note = ""
    if traced is not None and optimal is not None and not custom_targets:
        try:
            floor, floor_note = _reference_compute_floor(traced.jaxpr, spec)
        except Exception as exc:  # noqa: BLE001 - the floor is a refinement; say so and keep the figure
            notes.append(f"compute floor not computed: {type(exc).__name__}: {exc}")
        base = optimal + surcharge + loop_extra
        if floor is not None and floor > base:
            floor_extra = floor - base
            notes.append(
                f"{floor_extra * 1e6:.2f} us added: the reference's own compute ({floor_note}) needs "
                f"{floor * 1e6:.2f} us at the rates the block model charges kernels, above the compiler-based "
                f"{base * 1e6:.2f} us (its model prices elementwise work at the MXU peak)"
            )
    method = f"TPU compiler cost model (libtpu AOT compile for {spec.topology}, device {device.device_kind})"
    method += " + precision surcharge" if surcharge else ""
    method += " + loop iterations" if loop_extra else ""
    method += " + compute floor" if floor_extra else ""
    return XlaEstimate(
        method=method,
        gen=spec.name,
        topology=spec.topology,
        device_kind=device.device_kind,
        est_flops=raw.get("flops"),
        est_bytes_accessed=raw.get("bytes accessed"),
        est_transcendentals=raw.get("transcendentals"),
        estimated_seconds=optimal + surcharge + loop_extra + floor_extra if optimal is not None else None,
        est_compiler_seconds=compiler_optimal,
        est_once_bytes=once_bytes,
        est_precision_surcharge_seconds=surcharge,
        est_loop_extra_seconds=loop_extra,
        est_compute_floor_seconds=floor,
        est_compute_floor_extra_seconds=floor_extra,
        est_cycles_total=sum(cycles.values()) if cycles else None,
        est_cycles_by_fusion=cycles,
        opaque_custom_calls=custom_targets,
        est_compile_seconds=compile_s,
        raw_cost_analysis=raw,
        notes=notes,
    )


def _loop_extra_seconds(
    traced: jex_core.ClosedJaxpr, hlo: str, spec: TpuSpec, device: jax.Device, depth: int, notes: list[str]
) -> float:
    """Seconds of loop iterations the compiler's figure for `hlo` leaves out (see `loop_pricing`).

    Each top-level loop of the jaxpr is matched to a `while` the compiler kept; the iterations it did not
    price are charged at the body's own estimate (the body compiled alone, its inner loops priced the same
    way, its precision surcharge left out: `_precision_surcharge` already counts every iteration)."""
    pool = loop_pricing.hlo_while_trips(hlo)
    extra = 0.0
    for enclosing, consts, eqn in loop_pricing.loop_eqns(traced.jaxpr, traced.consts):
        trips = loop_pricing.jaxpr_loop_trips(eqn)
        if trips is None:
            notes.append(
                f"{eqn.primitive.name} loop with a trip count unknown before run time: body priced once"
            )
            continue
        priced = loop_pricing.match_compiled_loop(trips, pool)
        if priced >= trips or trips <= 1:
            continue  # unrolled by the compiler: every iteration is already in its figure
        if depth >= MAX_LOOP_DEPTH:
            notes.append(f"loop nest deeper than {MAX_LOOP_DEPTH}: inner {trips}-trip loop priced once")
            continue
        try:
            body_fn, body_specs = loop_pricing.loop_body_program(enclosing, consts, eqn)
            body = _estimate_xla(body_fn, body_specs, spec, device, depth + 1)
        except Exception as exc:  # noqa: BLE001 - an unpriceable body leaves the compiler's figure, flagged
            notes.append(
                f"{trips}-trip {eqn.primitive.name} loop: body not priced alone ({type(exc).__name__}: {exc}); "
                "the compiler's single-iteration price stands (underestimate)"
            )
            continue
        if body.estimated_seconds is None:
            continue
        per_iter = body.estimated_seconds - body.est_precision_surcharge_seconds
        add = (trips - priced) * per_iter
        extra += add
        notes.append(
            f"{trips}-trip {eqn.primitive.name} loop: the compiler's model priced {priced} iteration(s); "
            f"{trips - priced} more at {per_iter * 1e6:.2f} us each (the body compiled alone) = "
            f"{add * 1e6:.2f} us added"
        )
        notes.extend(f"{trips}-trip loop body: {n}" for n in body.notes if "precision surcharge" not in n)
    return extra


_HLO_ITEMSIZE = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
_HLO_ARRAY = re.compile(r"(\w+)\[([\d,]*)\](\{[^}]*\})?")
_HLO_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*")
_HLO_NO_TRAFFIC = frozenset(
    {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "copy-done", "after-all", "partition-id",
     "replica-id", "iota"}
)  # fmt: skip


def _hlo_array_bytes(type_text: str) -> int:
    """HBM bytes of an HLO type (arrays in tuples summed); buffers in VMEM (layout `S(1)`) count 0."""
    total = 0
    for dtype, dims, layout in _HLO_ARRAY.findall(type_text):
        if dtype not in _HLO_ITEMSIZE or (layout and "S(1)" in layout):
            continue
        total += math.prod(int(d) for d in dims.split(",") if d) * _HLO_ITEMSIZE[dtype]
    return total


def _hlo_once_bytes(hlo: str) -> float | None:
    """Bytes the ENTRY computation moves if each top-level op reads its operands and writes its result
    once. None when the text cannot be parsed (the caller keeps the compiler's figure)."""
    lines = hlo.splitlines()
    try:
        start = next(i for i, ln in enumerate(lines) if ln.startswith("ENTRY"))
    except StopIteration:
        return None
    sizes: dict[str, int] = {}
    total = 0
    for ln in lines[start + 1 :]:
        if ln.startswith("}"):
            break
        m = _HLO_INSTR.match(ln)
        if not m:
            continue
        rest = ln[m.end() :]
        if rest.startswith("("):  # tuple type: up to the matching parenthesis
            depth, end = 0, 0
            for j, ch in enumerate(rest):
                depth += ch == "("
                depth -= ch == ")"
                if depth == 0:
                    end = j + 1
                    break
            type_text, rest = rest[:end], rest[end:].lstrip()
        else:
            type_text, _, rest = rest.partition(" ")
        op = re.match(r"([\w\-]+)\((.*?)\)", rest)
        if not op:
            return None
        out_bytes = _hlo_array_bytes(type_text)
        sizes[m.group(1)] = out_bytes
        opcode = op.group(1)
        if opcode in ("while", "conditional", "call", "custom-call"):
            return (
                None  # a loop body's traffic repeats per trip: counting its operands once would under-price
            )
        if opcode in _HLO_NO_TRAFFIC:
            continue
        operands = re.findall(r"%([\w.\-]+)", op.group(2))
        total += out_bytes if not opcode.endswith("-start") else 0
        total += sum(sizes.get(o, 0) for o in operands)
    return float(total) if total else None


def _xla_passes(eqn: jex_core.JaxprEqn) -> int:
    """bf16 passes XLA runs for one dot: 1 unless both operands are f32 and the precision asks for more."""
    lhs, rhs = (v.aval for v in eqn.invars[:2])
    if {np.dtype(lhs.dtype).name, np.dtype(rhs.dtype).name} != {"float32"}:
        return 1
    prec = eqn.params.get("precision")
    text = str(prec).upper() if prec is not None else ""
    if "X9" in text:
        return 9  # BF16_BF16_F32_X9: nine bf16 passes by its name
    if "HIGHEST" in text or "F32_F32_F32" in text or "X6" in text:
        return XLA_F32_PASSES["HIGHEST"]
    if "HIGH" in text or "X3" in text:
        return XLA_F32_PASSES["HIGH"]
    return XLA_F32_PASSES["DEFAULT"]


def _conv_flops(eqn: jex_core.JaxprEqn) -> float:
    """Multiply-add flops of one convolution: each output element contracts the kernel's window over its
    group's input channels (the rhs's size divided by its output-feature dim), unpadded (a lower bound)."""
    rhs = eqn.invars[1].aval
    out_feature_dim = int(eqn.params["dimension_numbers"].rhs_spec[0])
    per_output = math.prod(int(s) for s in rhs.shape) // max(1, int(rhs.shape[out_feature_dim]))
    return 2.0 * _size(eqn.outvars[0].aval) * per_output


def _precision_surcharge(jaxpr: jex_core.Jaxpr, spec: TpuSpec, mult: float) -> float:
    """Seconds the extra passes of HIGH/HIGHEST f32 dots and convolutions add beyond the compiler's one-pass
    price.

    Per dot: max(0, passes x t_mxu - max(t_mxu, t_min_bytes)), i.e. only MXU time beyond what the dot's
    own minimum HBM traffic already costs - a lower bound, so the reference is never over-charged.
    """
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            passes = _xla_passes(eqn)
            if passes > 1:
                one_pass = _dot_work(eqn, spec, passes=1).mxu_seconds
                nbytes = sum(_nbytes(v.aval) for v in [*eqn.invars[:2], *eqn.outvars])
                floor = max(one_pass, nbytes / spec.device_hbm_bytes_per_s)
                total += max(0.0, passes * one_pass - floor) * mult
        elif name == "conv_general_dilated":
            # the compiler's optimal_seconds is precision-blind for convolutions too (a 3x3 f32 conv on v5e:
            # the same seconds at DEFAULT/HIGH/HIGHEST), while its per-fusion estimated_cycles grow ~2.7x/~5.4x
            passes = _xla_passes(eqn)
            if passes > 1:
                one_pass = _conv_flops(eqn) / spec.device_peak_flops
                nbytes = sum(_nbytes(v.aval) for v in [*eqn.invars[:2], *eqn.outvars])
                floor = max(one_pass, nbytes / spec.device_hbm_bytes_per_s)
                total += max(0.0, passes * one_pass - floor) * mult
        elif name == "pallas_call":
            continue
        elif name == "scan":
            total += _precision_surcharge(as_jaxpr(eqn.params["jaxpr"])[0], spec, mult * eqn.params["length"])
        elif name == "while":
            trips = loop_pricing.jaxpr_loop_trips(eqn) or 1  # unknown trip count: once (as the compiler)
            total += _precision_surcharge(as_jaxpr(eqn.params["body_jaxpr"])[0], spec, mult * trips)
        else:
            for sub in sub_jaxprs(eqn):
                total += _precision_surcharge(sub, spec, mult)
    return total


_XLA_NO_VPU_WORK = FREE_IN_XLA | frozenset(
    "broadcast_in_dim transpose convert_element_type iota copy copy_p slice dynamic_slice dynamic_update_slice "
    "concatenate pad gather rev squeeze expand_dims random_seed random_wrap random_unwrap random_fold_in "
    "random_split".split()
)
"""Reference equations `_reference_work` charges no VPU ops: layout and data movement that XLA folds into
its fusions' indexing or prices as bytes, and scalar key handling. Leaving them out keeps the reference's
compute floor a floor (a kernel's broadcasts and casts are charged, as the values sit in its vregs)."""


def _reference_work(jaxpr: jex_core.Jaxpr, spec: TpuSpec, mult: float = 1.0) -> _Work:
    """The reference's compute counted with the block model's rules, for `_reference_compute_floor`.

    Dots pay the MXU passes XLA runs for their precision (`_xla_passes`; dims padded as a kernel's are),
    convolutions their flops at the same peak; maps their output elements, reductions their input
    elements, transcendentals one EUP op plus `TRANSCENDENTAL_VPU_OPS`, `random_bits` `RANDOM_BITS_VPU_OPS`
    per word - all unpadded (a kernel's values are counted in whole vregs), so the reference is never
    over-charged. Loops count every iteration (a while with no counter form once); where an equation holds
    several jaxprs (cond branches, custom-derivative rules) only the cheapest is counted."""
    w = _Work()
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            w.add(_dot_work(eqn, spec, passes=_xla_passes(eqn)), mult)
        elif name == "conv_general_dilated":
            w.mxu_seconds += _xla_passes(eqn) * _conv_flops(eqn) / spec.device_peak_flops * mult
        elif name in ("scan", "while"):
            if name == "scan":
                body, trips = as_jaxpr(eqn.params["jaxpr"])[0], float(eqn.params["length"])
            else:
                body = as_jaxpr(eqn.params["body_jaxpr"])[0]
                trips = float(loop_pricing.jaxpr_loop_trips(eqn) or 1)
            w.add(_reference_work(body, spec, mult * trips))
        elif name == "pallas_call" or name in _XLA_NO_VPU_WORK:
            continue
        elif name.startswith("scatter") and len(eqn.invars) >= 3:
            # in place: the work is the updates (operand, indices, updates), not the whole operand it returns;
            # before the nested-jaxpr case, which would price its scalar combiner only
            w.vpu_ops += _size(eqn.invars[2].aval) * mult
        elif subs := sub_jaxprs(eqn):
            w.add(min((_reference_work(sub, spec, mult) for sub in subs), key=lambda x: x.cost_key(spec)))
        elif name == "random_bits":
            w.vpu_ops += RANDOM_BITS_VPU_OPS * sum(_size(v.aval) for v in eqn.outvars) * mult
        elif name in TRANSCENDENTAL:
            elements = sum(_size(v.aval) for v in eqn.outvars if getattr(v.aval, "shape", ()))
            w.transcendentals += elements * mult
            w.vpu_ops += TRANSCENDENTAL_VPU_OPS.get(name, 0) * elements * mult
        elif name in REDUCTIONS:
            ops = sum(_size(v.aval) for v in eqn.invars if getattr(v.aval, "shape", ())) * mult
            w.vpu_ops += ops * min(1.0, _valu_dtype_cost(eqn, spec))
        else:
            ops = sum(_size(v.aval) for v in eqn.outvars if getattr(v.aval, "shape", ())) * mult
            # packed bf16 is cheaper where the VPU has it; never dearer (this is a floor under XLA's time)
            w.vpu_ops += ops * min(1.0, _valu_dtype_cost(eqn, spec))
    return w


def _reference_compute_floor(jaxpr: jex_core.Jaxpr, spec: TpuSpec) -> tuple[float, str]:
    """Seconds the reference's own compute takes at the block model's rates, and what bounds it.

    The compiler's `optimal_seconds` is a roofline of its flops at the MXU peak, its bytes and its
    transcendentals: elementwise work is priced as if the MXU did it (a loop-free chain of 3 x 1024 uint32
    maps over 1024 x 1024 elements came out at exactly flops / 197 TFLOP/s on v5e and at its byte time on
    v6e). The block model charges the same work in a kernel at its VPU rate, 32x (v5e) to 128x (v6e) slower,
    so a kernel doing the reference's own elementwise work (threefry dropout bits, an erfc polynomial)
    looked slower than the reference by up to that factor. Here the reference pays what a kernel would
    (`_reference_work`), its units overlapped perfectly (max, as a kernel's are). The count comes from the
    jaxpr, not from the compiler's flops: those include dots counted by rules of their own (a batched bf16
    matmul + softmax on v6e reported 2.8e11 flops more than its dots' 2*M*N*K), which at the VPU rate
    would have charged the reference 30x its time."""
    w = _reference_work(jaxpr, spec)
    terms = {
        "MXU": w.mxu_seconds,
        "VPU": w.vpu_ops / _vpu_rate(spec),
        "EUP": w.transcendentals / spec.compiler_transcendentals_per_s,
    }
    unit = max(terms, key=lambda k: terms[k])
    what = (
        f"{unit}-bound: MXU {terms['MXU'] * 1e6:.2f} us, {w.vpu_ops:.3g} elementwise ops {terms['VPU'] * 1e6:.2f} "
        f"us, {w.transcendentals:.3g} transcendentals {terms['EUP'] * 1e6:.2f} us"
    )
    return terms[unit], what


def pallas_call_name(eqn: jex_core.JaxprEqn) -> str:
    """A readable kernel name: the `name=` given to pallas_call, else the kernel function's name."""
    params = eqn.params
    if params.get("name"):
        return str(params["name"])
    nsi = params.get("name_and_src_info")
    if nsi is not None and getattr(nsi, "name", None):
        return str(nsi.name)
    dbg = getattr(params.get("jaxpr"), "debug_info", None)
    src = getattr(dbg, "func_src_info", None) or getattr(dbg, "func_name", None)
    if src:
        return str(src).split(" ")[0]
    return "pallas_call"


# --------------------------------------------------------------------------------------------------------
# Block model internals
# --------------------------------------------------------------------------------------------------------


UNPRICED_KERNEL_LOOP = (
    "while loop in kernel whose trip count depends on data, with vector or MXU work in its body: the block "
    "model cannot count its iterations, so the kernel's time has no price"
)
"""A kernel-call note that withholds the whole estimate (`PallasEstimate.unpriced`): charging such a body
once priced a K reduction run as a data-bounded loop at one slice of it."""


@dataclass
class _Work:
    """Work counted in a kernel body for one grid step (before multiplying by steps)."""

    mxu_flops: float = 0.0
    mxu_padded_flops: float = 0.0
    mxu_seconds: float = 0.0
    vpu_ops: float = 0.0
    transcendentals: float = 0.0
    dma_bytes: float = 0.0
    notes: set[str] = field(default_factory=set)

    def add(self, other: _Work, times: float = 1.0) -> None:
        self.mxu_flops += other.mxu_flops * times
        self.mxu_padded_flops += other.mxu_padded_flops * times
        self.mxu_seconds += other.mxu_seconds * times
        self.vpu_ops += other.vpu_ops * times
        self.transcendentals += other.transcendentals * times
        self.dma_bytes += other.dma_bytes * times
        self.notes |= other.notes

    def cost_key(self, spec: TpuSpec) -> float:
        """Rough seconds, used only to pick the most expensive cond branch."""
        return (
            self.mxu_seconds
            + self.vpu_ops / _vpu_rate(spec)
            + self.transcendentals / spec.compiler_transcendentals_per_s
            + self.dma_bytes / spec.device_hbm_bytes_per_s
        )


def _vpu_rate(spec: TpuSpec) -> float:
    eup_vregs_per_s = spec.compiler_transcendentals_per_s / VREG_ELEMENTS
    return VALU_VREG_OPS_PER_CYCLE * VREG_ELEMENTS * eup_vregs_per_s


def _size(aval: Any) -> int:
    shape = getattr(aval, "shape", ())
    return int(math.prod(shape)) if shape else 1


def _vreg_size(aval: Any) -> int:
    """Elements a vector op on this in-kernel value really processes: its last two dims padded to whole
    (8, 128) vreg tiles, the way Mosaic lays values out (rank 1: one sublane of lanes per vreg).

    Counting logical elements priced a (rows, 1) column of row statistics, or the (k, rows, 1) winners of
    a top-k, at 1/128 of the vreg work the VPU does on them, so a layout that strands values in lane-sparse
    columns looked as cheap as a dense one."""
    shape = tuple(int(d) for d in getattr(aval, "shape", ()))
    if not shape:
        return 1
    if len(shape) == 1:
        return _pad(shape[0], VREG_ELEMENTS // 8) * 8
    return int(math.prod(shape[:-2])) * _pad(shape[-2], 8) * _pad(shape[-1], VREG_ELEMENTS // 8)


def _sublane_relayout(eqn: jex_core.JaxprEqn) -> bool:
    """A reshape that keeps the lane dim but changes the second-minor dim to or from a size that is not a
    whole number of sublane tiles (8 rows of 32-bit values, 16 of 16-bit): not the free relabelling of tiles
    that merging or splitting leading dims (or whole tiles of rows) is."""
    src = tuple(int(d) for d in eqn.invars[0].aval.shape)
    dst = tuple(int(d) for d in eqn.outvars[0].aval.shape)
    if len(src) < 2 or len(dst) < 2 or src[-1] != dst[-1] or src[-2] == dst[-2]:
        return False
    tile = 8 * max(1, 4 // _itemsize(eqn.invars[0].aval))
    return src[-2] % tile != 0 or dst[-2] % tile != 0


def _itemsize(aval: Any) -> int:
    dtype = getattr(aval, "dtype", None)
    try:
        return int(np.dtype(dtype).itemsize)
    except TypeError:
        return 4


def _nbytes(aval: Any) -> int:
    inner = getattr(aval, "inner_aval", None)  # Ref avals wrap a ShapedArray
    a = inner if inner is not None else aval
    return _size(a) * _itemsize(a)


def _pad(n: int, m: int) -> int:
    return -(-n // m) * m if m > 0 else n


def _dot_work(eqn: jex_core.JaxprEqn, spec: TpuSpec, passes: int | None = None) -> _Work:
    """MXU work of one dot; `passes` overrides the f32 pass count (None: the kernel's precision rule)."""
    lhs, rhs = (v.aval for v in eqn.invars[:2])
    (lc, rc), (lb, _rb) = eqn.params["dimension_numbers"]
    out = eqn.outvars[0].aval
    k = math.prod(lhs.shape[d] for d in lc) if lc else 1
    flops = 2.0 * _size(out) * k
    # Pad K and N (the rhs non-contracting dims) up to the MXU tile; M streams through unpadded.
    rhs_free = [d for d in range(len(rhs.shape)) if d not in rc and d not in _rb]
    n = math.prod(rhs.shape[d] for d in rhs_free) if rhs_free else 1
    batch = math.prod(lhs.shape[d] for d in lb) if lb else 1
    m = _size(out) // max(1, batch * n)
    mxu_k, mxu_n = spec.mxu_shape
    padded = 2.0 * batch * m * _pad(k, mxu_k) * _pad(n, mxu_n)

    dtypes = {np.dtype(lhs.dtype).name, np.dtype(rhs.dtype).name}
    w = _Work(mxu_flops=flops, mxu_padded_flops=padded)
    if dtypes <= {"int8", "uint8", "int4", "uint4"} and spec.device_peak_int8_ops:
        rate = spec.device_peak_int8_ops
    elif passes is not None:
        rate = spec.device_peak_flops / passes
    elif "float32" in dtypes or "float64" in dtypes:
        prec = eqn.params.get("precision")
        highest = prec is not None and "HIGHEST" in str(prec).upper()
        passes = F32_MXU_PASSES["highest" if highest else "default"]
        rate = spec.device_peak_flops / passes
        w.notes.add(
            f"f32 matmul at {'HIGHEST' if highest else 'DEFAULT'} precision charged {passes} bf16 MXU pass(es), "
            "as Mosaic lowers it"
        )
    else:
        rate = spec.device_peak_flops
    w.mxu_seconds = padded / rate
    return w


def _dma_bytes(eqn: jex_core.JaxprEqn) -> float:
    """Bytes of one manual async copy: the (sliced) source view, else the destination buffer.

    A view of a jaxpr ref is its ref's type put through the view's transforms (a `pl.ds(start, rows)` of
    an HBM operand: the rows, whatever the start); the view's own `.shape` cannot be read off a jaxpr
    variable, and reading it raised, so every such copy was priced as the smallest ref of the equation (a
    28-byte semaphore: a 12 MB window per grid step was 28 bytes)."""
    try:
        parts = jax.tree_util.tree_unflatten(eqn.params["tree"], eqn.invars)
        for view in parts[:2]:  # the source, then the destination
            inner = _view_type(view)
            if inner is not None:
                return float(math.prod(inner.shape) * _itemsize(inner))
    except Exception:  # noqa: BLE001 - tree layout differs across JAX versions; fall back, say so upstream
        pass
    refs = [v.aval for v in eqn.invars if hasattr(v.aval, "inner_aval")]
    return float(min((_nbytes(a) for a in refs), default=0))


def _view_type(view: Any) -> Any:
    """The array type a DMA operand addresses: a ref's, or a transformed ref's (its slices applied)."""
    if hasattr(view, "transforms") and hasattr(view, "ref"):
        ty = getattr(view.ref, "aval", view.ref)
        for t in view.transforms:
            ty = t.transform_type(ty)
        return getattr(ty, "inner_aval", ty)
    aval = getattr(view, "aval", None)
    return getattr(aval, "inner_aval", None)


def _body_work(jaxpr: jex_core.Jaxpr, spec: TpuSpec, facts: _StepFacts | None = None) -> _Work:
    """MXU / VPU / EUP / DMA work of one execution of a kernel body (one grid step, averaged over steps
    for conds whose branch fractions and while loops whose trip counts per grid step are known)."""
    w = _Work()
    for pos, eqn in enumerate(jaxpr.eqns):
        name = eqn.primitive.name
        if name == "dot_general":
            w.add(_dot_work(eqn, spec))
        elif name == "cond":
            branches = [_body_work(as_jaxpr(b)[0], spec) for b in eqn.params["branches"]]
            frac = (facts.fractions if facts else {}).get(pos)
            if frac is not None:
                for b, f in zip(branches, frac, strict=True):
                    if f:
                        w.add(b, float(f))
                w.notes.add("cond: each branch charged for the fraction of grid steps that take it")
            else:
                w.add(max(branches, key=lambda b: b.cost_key(spec)))
                w.notes.add("cond: most expensive branch charged every step (pl.when bodies included)")
        elif name == "scan":
            w.add(_body_work(as_jaxpr(eqn.params["jaxpr"])[0], spec), float(eqn.params["length"]))
        elif name == "while":
            trips = (facts.trips if facts else {}).get(pos)
            if trips is None:
                static = loop_pricing.jaxpr_loop_trips(eqn)
                trips = None if static is None else float(static)
            if trips is None:
                body = _body_work(as_jaxpr(eqn.params["body_jaxpr"])[0], spec)
                w.add(body)
                # a scalar loop (a walk over group sizes) costs the step overhead; a loop doing vector or
                # MXU work an unknown number of times has no price: charged once, it would be a false speedup
                w.notes.add(UNPRICED_KERNEL_LOOP if body.cost_key(spec) > 0 else
                            "while loop in kernel: trip count unknown, scalar body charged once")  # fmt: skip
            else:
                w.add(_body_work(as_jaxpr(eqn.params["body_jaxpr"])[0], spec), trips)
                w.notes.add("while loop in kernel: body charged per trip (mean trip count over grid steps)")
        elif name == "dma_start":
            w.dma_bytes += _dma_bytes(eqn)
        elif name == "reshape" and _sublane_relayout(eqn):
            # splits or merges the second-minor (sublane) dim off its tile: Mosaic moves the data between
            # vregs (a (W, C) -> (W / 2, 2, C) split of a 2-column pool); charged as a write of the result
            w.vpu_ops += sum(_vreg_size(v.aval) for v in eqn.outvars)
        elif name in KERNEL_CALL_PRIMITIVES or (name in FREE_IN_KERNEL and sub_jaxprs(eqn)):
            for sub in sub_jaxprs(eqn):
                w.add(_body_work(sub, spec))
        elif name in FREE_IN_KERNEL:
            continue
        elif name in TRANSCENDENTAL:
            elements = sum(_vreg_size(v.aval) for v in eqn.outvars if getattr(v.aval, "shape", ()))
            half = _half_float(eqn)
            w.transcendentals += elements * (spec.bf16_eup_cost if half else 1.0)
            w.vpu_ops += (
                TRANSCENDENTAL_VPU_OPS.get(name, 0) * elements * (spec.bf16_valu_cost if half else 1.0)
            )
        elif name in REDUCTIONS:
            ops = sum(_vreg_size(v.aval) for v in eqn.invars if getattr(v.aval, "shape", ()))
            w.vpu_ops += ops * _valu_dtype_cost(eqn, spec)
        else:
            # Elementwise / layout / compare / select / convert / iota / broadcast / addupdate: charge the
            # elements written. Scalars run on the scalar unit and are not charged.
            ops = sum(
                _vreg_size(v.aval) for v in eqn.outvars if getattr(getattr(v, "aval", None), "shape", ())
            )
            if name == "addupdate":
                ops += sum(_vreg_size(v.aval) for v in eqn.invars[1:2] if getattr(v.aval, "shape", ()))
            w.vpu_ops += ops * _valu_dtype_cost(eqn, spec)
    return w


HALF_FLOATS = frozenset({"bfloat16", "float16"})


def _valu_dtype_cost(eqn: jex_core.JaxprEqn, spec: TpuSpec) -> float:
    """Vector-ALU time per element of an in-kernel op against the f32 rate: `TpuSpec.bf16_valu_cost` when it
    computes on 16-bit floats (a result or an operand of one), 1 otherwise. A cast is priced as one op in
    either direction: the unpack or pack it does is the op itself. A transcendental's EUP time scales by
    `TpuSpec.bf16_eup_cost` instead (the EUP computes in f32; the unpack and repack around it is the cost)."""
    if eqn.primitive.name == "convert_element_type":
        return 1.0
    return spec.bf16_valu_cost if _half_float(eqn) else 1.0


def _half_float(eqn: jex_core.JaxprEqn) -> bool:
    """Does the op compute on 16-bit floats (one of its array operands or results is one)?"""
    for v in (*eqn.invars, *eqn.outvars):
        aval = getattr(v, "aval", None)
        if getattr(aval, "shape", ()) and str(getattr(aval, "dtype", "")) in HALF_FLOATS:
            return True
    return False


# Index maps: a tiny numpy interpreter for the integer primitives index maps use, with JAX as fallback.
_NP_BINOPS: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "max": np.maximum,
    "min": np.minimum,
    "and": np.bitwise_and,
    "or": np.bitwise_or,
    "eq": np.equal,
    "ne": np.not_equal,
    "lt": np.less,
    "le": np.less_equal,
    "gt": np.greater,
    "ge": np.greater_equal,
    "shift_left": np.left_shift,
    "shift_right_arithmetic": np.right_shift,
}


def _np_eval(jaxpr: jex_core.Jaxpr, consts: Sequence[Any], args: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Evaluate an integer index-map jaxpr on vectors of grid indices; KeyError for unsupported prims."""
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return np.asarray(v.val) if isinstance(v, jex_core.Literal) else env[v]

    for v, c in zip(jaxpr.constvars, consts, strict=True):
        env[v] = np.asarray(c)
    for v, a in zip(jaxpr.invars, args, strict=True):
        env[v] = a
    for eqn in jaxpr.eqns:
        outs = _np_prim(eqn, [read(v) for v in eqn.invars])
        for v, o in zip(eqn.outvars, outs, strict=True):
            env[v] = o
    return [read(v) for v in jaxpr.outvars]


def _np_prim(eqn: jex_core.JaxprEqn, x: list[Any]) -> list[Any]:
    """One integer/boolean primitive on numpy vectors (one entry per grid step); KeyError if unsupported.
    Results are wrapped to the equation's own integer type (int32 on a TPU): index arithmetic that
    overflows there must overflow here too, or a guard that is always true on the chip (`step * 2**32 == 0`)
    reads as almost never true and the compute under it goes unpriced."""
    outs = _np_prim_wide(eqn, x)
    if len(outs) != len(eqn.outvars) or eqn.primitive.name in ("pjit", "jit", "closed_call", "scan", "while"):
        return outs
    with np.errstate(over="ignore"):
        return [_wrap_to(o, v) for o, v in zip(outs, eqn.outvars, strict=True)]


def _wrap_to(value: Any, var: Any) -> Any:
    dtype = np.dtype(getattr(getattr(var, "aval", None), "dtype", np.int64))
    if dtype.kind not in "iu" or dtype.itemsize >= 8:
        return value
    return np.asarray(value).astype(np.int64).astype(dtype).astype(np.int64)


def _np_prim_wide(eqn: jex_core.JaxprEqn, x: list[Any]) -> list[Any]:
    name = eqn.primitive.name
    if name in _NP_BINOPS:
        out = _NP_BINOPS[name](x[0], x[1])
    elif name == "div":  # lax.div truncates toward zero
        out = np.trunc(np.divide(x[0], x[1])).astype(np.int64)
    elif name == "rem":
        out = np.fmod(x[0], x[1])
    elif name == "neg":
        out = np.negative(x[0])
    elif name == "not":
        out = np.logical_not(x[0]) if np.asarray(x[0]).dtype == bool else np.invert(x[0])
    elif name == "select_n":
        out = np.choose(np.asarray(x[0]).astype(np.int64), x[1:])
    elif name == "convert_element_type":
        new = np.dtype(eqn.params["new_dtype"])
        if new.kind not in "biu":
            raise KeyError(name)  # float index arithmetic: not an index map
        out = np.asarray(x[0]).astype(bool) if new == np.bool_ else np.asarray(x[0]).astype(np.int64)
    elif name == "clamp":
        out = np.clip(x[1], x[0], x[2])
    elif name in ("pjit", "jit", "closed_call"):
        sub, sub_consts = as_jaxpr(eqn.params.get("jaxpr") or eqn.params["call_jaxpr"])
        return _np_eval(sub, sub_consts, x)
    elif name == "get":  # a scalar read of a scalar-prefetch ref whose contents are known
        out = _np_get(eqn, x)
    elif name == "scan":
        return _np_scan(eqn, x)
    elif name == "while":
        return _np_while(eqn, x)
    else:
        raise KeyError(name)
    return [out]


def _np_get(eqn: jex_core.JaxprEqn, x: list[Any]) -> np.ndarray:
    """`ref[i, j]` with integer (per-step) indices into a known array; KeyError for slices or an unknown
    ref (a VMEM block, whose contents the model never has)."""
    ref = np.asarray(x[0])
    if ref.dtype.kind not in "biu":
        raise KeyError("get")
    try:
        (indexer,) = jax.tree_util.tree_unflatten(eqn.params["tree"], list(x[1:]))
        idx = tuple(np.asarray(i, np.int64) for i in indexer.indices)
    except (TypeError, ValueError, AttributeError) as exc:
        raise KeyError("get") from exc
    if len(idx) != ref.ndim or any(i.dtype.kind not in "iu" for i in idx):
        raise KeyError("get")
    return ref[tuple(np.clip(i, 0, n - 1) for i, n in zip(idx, ref.shape, strict=True))]


def _np_scan(eqn: jex_core.JaxprEqn, x: list[Any]) -> list[Any]:
    """A `fori_loop` lowered to `scan` (consts and carries only, no xs/ys), run `length` times."""
    p = eqn.params
    n_consts, n_carry = int(p["num_consts"]), int(p["num_carry"])
    body, consts = as_jaxpr(p["jaxpr"])
    if len(x) != n_consts + n_carry or len(body.outvars) != n_carry or int(p["length"]) > 1 << 16:
        raise KeyError("scan")
    carry = list(x[n_consts:])
    for _ in range(int(p["length"])):
        carry = _np_eval(body, consts, list(x[:n_consts]) + carry)
    return carry


def _np_while(eqn: jex_core.JaxprEqn, x: list[Any]) -> list[Any]:
    """A `while` on per-step values: every step iterates until its own condition is false."""
    p = eqn.params
    n_cc, n_bc = int(p["cond_nconsts"]), int(p["body_nconsts"])
    cond, cond_consts = as_jaxpr(p["cond_jaxpr"])
    body, body_consts = as_jaxpr(p["body_jaxpr"])
    cc, bc, carry = list(x[:n_cc]), list(x[n_cc : n_cc + n_bc]), list(x[n_cc + n_bc :])
    for _ in range(1 << 16):
        (live,) = _np_eval(cond, cond_consts, cc + carry)
        live = np.asarray(live, bool)
        if not live.any():
            return carry
        new = _np_eval(body, body_consts, bc + carry)
        carry = [np.where(live, n, c) for n, c in zip(new, carry, strict=True)]
    raise KeyError("while")


@dataclass
class _StepFacts:
    """What the grid position alone decides in a kernel body, averaged over grid steps (eqn position ->)."""

    fractions: dict[int, np.ndarray] = field(default_factory=dict)
    """Top-level conds: the fraction of grid steps taking each branch."""
    trips: dict[int, float] = field(default_factory=dict)
    """Top-level counter-form while loops: the mean trip count over grid steps."""


def _step_facts(
    jaxpr: jex_core.Jaxpr,
    grid: tuple[int, ...],
    cap: int = 1 << 20,
    prefetch: Sequence[np.ndarray] | None = None,
) -> _StepFacts:
    """For each top-level `cond` of a kernel body whose branch index depends only on the grid position
    (program_id, num_programs and integer arithmetic - what `pl.when` guards such as causal or window
    masks compile to): the fraction of grid steps that take each branch; for each top-level `while` in
    counter form (a `fori_loop` whose bounds depend on the grid position, e.g. up to the causal diagonal)
    its mean trip count. Keyed by eqn position.

    This is what lets the block model credit skipped compute (a key block a mask rules out runs the empty
    branch of its `pl.when`) and charge an in-kernel loop per trip. Grids beyond `cap` steps, or
    predicates and bounds that read data (refs, scalar prefetch), are left out: their conds are charged
    the most expensive branch and their loops once (flagged) -- unless `prefetch` gives the contents of
    the scalar-prefetch refs (the body's leading refs, e.g. a grouped matmul's group sizes), in which case
    predicates that read them are replayed exactly too.
    """
    facts = _StepFacts()
    steps = math.prod(grid) if grid else 1
    if steps > cap or not any(e.primitive.name in ("cond", "while") for e in jaxpr.eqns):
        return facts
    idx = np.unravel_index(np.arange(steps, dtype=np.int64), grid) if grid else ()
    known: dict[Any, Any] = dict(zip(jaxpr.invars, prefetch or (), strict=False))

    def value(v: Any) -> Any:
        if isinstance(v, jex_core.Literal):
            return np.asarray(v.val)
        return known[v]

    for pos, eqn in enumerate(jaxpr.eqns):
        name = eqn.primitive.name
        try:
            if name == "program_id":
                known[eqn.outvars[0]] = np.asarray(idx[int(eqn.params["axis"])])
            elif name == "num_programs":
                known[eqn.outvars[0]] = np.asarray(grid[int(eqn.params["axis"])])
            elif name == "cond":
                branch = np.broadcast_to(np.asarray(value(eqn.invars[0]), np.int64), (steps,))
                n = len(eqn.params["branches"])
                facts.fractions[pos] = np.bincount(np.clip(branch, 0, n - 1), minlength=n) / steps
            elif name == "while":
                trips = loop_pricing.while_trip_count(eqn, value)
                if trips is not None:
                    facts.trips[pos] = float(np.mean(np.broadcast_to(trips, (steps,))))
            elif all(isinstance(v, jex_core.Literal) or v in known for v in eqn.invars):
                if any(getattr(getattr(v, "aval", None), "shape", ()) for v in eqn.outvars):
                    continue  # a vector op of the body, not scalar index arithmetic
                for v, o in zip(eqn.outvars, _np_prim(eqn, [value(v) for v in eqn.invars]), strict=True):
                    known[v] = o
        except (KeyError, TypeError, ValueError):
            continue
    return facts


def _block_indices(
    closed: Any, grid_idx: Sequence[np.ndarray], n: int, prefetch: Sequence[np.ndarray] = ()
) -> np.ndarray:
    """Block index tuple per step, shape (n, n_dims), evaluated vectorised over all steps (with the
    scalar-prefetch contents, when the map reads them: numpy only, KeyError if it cannot)."""
    jaxpr, consts = as_jaxpr(closed)
    try:
        outs = _np_eval(jaxpr, consts, list(grid_idx) + list(prefetch))
    except KeyError:
        if prefetch:
            raise
        fun = jax.vmap(lambda *g: jax.core.eval_jaxpr(jaxpr, consts, *g))
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            outs = [np.asarray(o) for o in jax.jit(fun)(*(np.asarray(g, np.int32) for g in grid_idx))]
    cols = [
        np.broadcast_to(np.asarray(o, dtype=np.int64).reshape(-1) if np.ndim(o) else o, (n,)) for o in outs
    ]
    return np.stack(cols, axis=1) if cols else np.zeros((n, 0), np.int64)


def _reads_prefetch(closed: Any, n_grid: int) -> bool:
    """Whether an index map uses any argument beyond the grid indices (the scalar-prefetch refs)."""
    jaxpr, _ = as_jaxpr(closed)
    extra = set(jaxpr.invars[n_grid:])
    if not extra:
        return False
    used = {v for e in jaxpr.eqns for v in e.invars if not isinstance(v, jex_core.Literal)}
    used |= {v for v in jaxpr.outvars if not isinstance(v, jex_core.Literal)}
    return bool(extra & used)


def _grid_only(closed: Any, n_grid: int) -> Any:
    """The index map with unused trailing (scalar-prefetch) parameters dropped."""
    jaxpr, consts = as_jaxpr(closed)
    if len(jaxpr.invars) == n_grid:
        return closed
    trimmed = jaxpr.replace(invars=list(jaxpr.invars[:n_grid]))
    return jex_core.ClosedJaxpr(trimmed, list(consts))


def _count_transfers(
    closed: Any, grid: tuple[int, ...], cap: int, prefetch: Sequence[np.ndarray] = ()
) -> tuple[float, bool]:
    """1 + number of block-index changes between consecutive steps (last grid axis fastest).

    Returns (transfers, sampled). Long grids are replayed in chunks; beyond `cap` steps the change rate
    of the replayed prefix is extrapolated. `prefetch`: the contents of the scalar-prefetch refs the index
    map reads after the grid indices (none: the map must not read them).
    """
    total = math.prod(grid) if grid else 1
    replay = min(total, cap)
    chunk = 1 << 20
    changes = 0
    prev: np.ndarray | None = None
    for start in range(0, replay, chunk):
        stop = min(replay, start + chunk)
        flat = np.arange(start, stop, dtype=np.int64)
        idx = np.unravel_index(flat, grid) if grid else ()
        blocks = _block_indices(
            closed, [np.asarray(i, np.int64) for i in idx], stop - start, [np.asarray(p) for p in prefetch]
        )
        if prev is not None:
            blocks_full = np.concatenate([prev[None, :], blocks], axis=0)
        else:
            blocks_full = blocks
        if len(blocks_full) > 1:
            changes += int(np.any(blocks_full[1:] != blocks_full[:-1], axis=1).sum())
        prev = blocks[-1]
    if replay < total:
        rate = changes / max(1, replay - 1)
        return 1.0 + rate * (total - 1), True
    return 1.0 + changes, False


def _memory_space(aval: Any) -> str:
    ms = getattr(aval, "memory_space", None)
    s = str(getattr(ms, "value", ms) if ms is not None else "default").lower()
    return s.split(".")[-1]


def _estimate_call(
    eqn: jex_core.JaxprEqn,
    spec: TpuSpec,
    multiplicity: float,
    prefetch: Sequence[np.ndarray] | None = None,
) -> PallasCallEstimate:
    """One pallas_call through the block model. `prefetch`: the contents of its scalar-prefetch operands
    when the program's inputs determine them (the task's own group sizes, lengths); with them, index maps
    and `pl.when` guards that read those refs are replayed step by step like grid-only ones."""
    params = eqn.params
    gm = params["grid_mapping"]
    grid = tuple(int(g) for g in gm.grid)
    steps = math.prod(grid) if grid else 1
    notes: set[str] = set()
    if getattr(gm, "num_dynamic_grid_bounds", 0):
        notes.add("dynamic grid bounds: the static grid values were used")
    n_index_ops = int(getattr(gm, "num_index_operands", 0) or 0)
    n_inputs = int(gm.num_inputs)

    operands: list[OperandTraffic] = []
    vmem = 0
    hbm = 0.0
    exposed_bytes = 0.0
    for i, bm in enumerate(gm.block_mappings):
        role: Literal["input", "output"] = "input" if i < n_inputs else "output"
        block_aval = bm.block_aval
        inner = getattr(block_aval, "inner_aval", block_aval)
        space = _memory_space(block_aval)
        block_bytes = _nbytes(block_aval)
        array_shape = tuple(int(d) for d in bm.array_aval.shape)
        exact = True
        if space in ("any", "hbm", "semaphore", "semaphore_mem"):
            transfers = 0.0  # not pipelined: the kernel moves it by hand (counted via dma_start)
        elif n_index_ops and _reads_prefetch(bm.index_map_jaxpr, len(grid)):
            replayed = None
            if prefetch is not None:
                try:
                    replayed = _count_transfers(bm.index_map_jaxpr, grid, MAX_EXACT_STEPS, prefetch)
                except (KeyError, TypeError, ValueError, IndexError):
                    replayed = None
            if replayed is None:
                transfers, exact = float(steps), False
                notes.add(
                    "scalar-prefetch index maps depend on data the model does not have: every step counted "
                    "as a re-fetch (upper bound)"
                )
            else:
                transfers, sampled = replayed
                notes.add(
                    "scalar-prefetch index maps replayed with the task's own prefetch values (an unchanged "
                    "block index issues no copy)"
                )
                if sampled:
                    notes.add(
                        f"grid of {steps} steps: re-fetches extrapolated from the first {MAX_EXACT_STEPS}"
                    )
        else:
            # Index maps that ignore the scalar-prefetch refs are replayed exactly like any other.
            transfers, sampled = _count_transfers(
                _grid_only(bm.index_map_jaxpr, len(grid)), grid, MAX_EXACT_STEPS
            )
            if sampled:
                notes.add(f"grid of {steps} steps: re-fetches extrapolated from the first {MAX_EXACT_STEPS}")
        if space in ("default", "vmem"):
            buffers = 2
            pm = getattr(bm, "pipeline_mode", None)
            if pm is not None and getattr(pm, "buffer_count", None):
                buffers = int(pm.buffer_count)
            vmem += block_bytes * buffers
        est_bytes = transfers * block_bytes
        hbm += est_bytes
        if transfers:
            exposed_bytes += block_bytes  # first fetch (inputs) / last write-back (outputs) is not hidden
        operands.append(
            OperandTraffic(
                role=role,
                origin=str(getattr(bm, "origin", f"operand {i}")),
                memory_space=space,
                block_shape=tuple(int(d) for d in getattr(inner, "shape", ())),
                array_shape=array_shape,
                dtype=str(np.dtype(inner.dtype)) if hasattr(inner, "dtype") else "?",
                block_bytes=block_bytes,
                est_transfers=transfers,
                est_bytes=est_bytes,
                index_map_exact=exact,
            )
        )
    for aval in getattr(gm, "scratch_avals", ()) or ():
        if _memory_space(aval) in ("vmem", "default"):
            vmem += _nbytes(aval)

    body, _ = as_jaxpr(params["jaxpr"])
    work = _body_work(body, spec, _step_facts(body, grid, prefetch=prefetch if n_index_ops else None))
    notes |= work.notes
    manual_dma = work.dma_bytes * steps
    if manual_dma:
        notes.add("manual DMA bytes counted from dma_start source views")
    hbm += manual_dma

    cp = params.get("compiler_params")
    limit = getattr(cp, "vmem_limit_bytes", None) if cp is not None else None
    if isinstance(cp, dict):  # older JAX kept {"mosaic": {...}}
        limit = (cp.get("mosaic") or {}).get("vmem_limit_bytes")
    vmem_limit = int(limit) if limit else spec.default_scoped_vmem_bytes

    compute_factor, step_factor, split_note = _core_split(spec, grid, cp)
    if split_note:
        notes.add(split_note)
    t_mem = hbm / spec.device_hbm_bytes_per_s
    t_mxu = work.mxu_seconds * steps * compute_factor
    t_vpu = work.vpu_ops * steps / _vpu_rate(spec) * compute_factor
    t_eup = work.transcendentals * steps / spec.compiler_transcendentals_per_s * compute_factor
    t_ovh = steps * PER_STEP_OVERHEAD_S * step_factor
    t_exposed = exposed_bytes / spec.device_hbm_bytes_per_s
    t_compute = max(t_mxu, t_vpu, t_eup)
    est = max(t_mem, t_compute + t_exposed) + t_ovh
    terms: dict[BoundClass, float] = {"memory": t_mem, "compute": t_compute, "overhead": t_ovh}
    bound = max(terms, key=lambda k: terms[k])
    if vmem > spec.vmem_bytes:
        notes.add(
            f"VMEM footprint {vmem / 2**20:.1f} MiB exceeds the {spec.vmem_mib} MiB VMEM of {spec.name}: "
            "will not compile"
        )
    elif vmem > vmem_limit:
        notes.add(
            f"VMEM footprint {vmem / 2**20:.1f} MiB exceeds the scoped limit {vmem_limit / 2**20:.0f} MiB: "
            "set vmem_limit_bytes or shrink blocks"
        )
    return PallasCallEstimate(
        name=pallas_call_name(eqn),
        grid=grid,
        multiplicity=multiplicity,
        est_grid_steps=steps,
        operands=operands,
        est_hbm_bytes=hbm,
        est_manual_dma_bytes=manual_dma,
        est_mxu_flops=work.mxu_flops * steps,
        est_mxu_padded_flops=work.mxu_padded_flops * steps,
        est_vpu_elementwise_ops=work.vpu_ops * steps,
        est_transcendentals=work.transcendentals * steps,
        est_vmem_bytes=vmem,
        vmem_limit_bytes=vmem_limit,
        vmem_capacity_bytes=spec.vmem_bytes,
        vmem_exceeds_limit=vmem > vmem_limit,
        vmem_exceeds_capacity=vmem > spec.vmem_bytes,
        est_memory_seconds=t_mem,
        est_mxu_seconds=t_mxu,
        est_vpu_seconds=t_vpu,
        est_eup_seconds=t_eup,
        est_overhead_seconds=t_ovh,
        est_exposed_dma_seconds=t_exposed,
        estimated_seconds=est,
        bound=bound,
        notes=sorted(notes),
    )


def _core_split(spec: TpuSpec, grid: tuple[int, ...], cp: Any) -> tuple[float, float, str | None]:
    """(compute factor, step factor, note) for devices with several TensorCores (v5p megacore).

    The per-device peaks in tpu_specs count every TensorCore of the device. Mosaic splits only the grid
    dimensions marked 'parallel' across them: with P parallel steps on C cores the busiest core runs
    ceil(P/C)/P of the work at 1/C of the device peak (factor C*ceil(P/C)/P, 1.0 when P divides evenly);
    with no parallel dimension one core does everything (factor C). HBM bandwidth is shared: unchanged.
    """
    cores = spec.tensorcores_per_device
    if cores <= 1:
        return 1.0, 1.0, None
    sem = getattr(cp, "dimension_semantics", None) if cp is not None else None
    if isinstance(cp, dict):
        sem = (cp.get("mosaic") or {}).get("dimension_semantics")
    sem = list(sem or [])
    parallel = math.prod(
        g for g, d in zip(grid, sem, strict=False) if "parallel" in str(d).lower() and "arbitrary" not in str(d)
    ) if sem else 1  # fmt: skip
    if parallel < 2:
        return (
            float(cores),
            1.0,
            f"no 'parallel' grid dimension: one of the {cores} TensorCores of {spec.name} works",
        )
    share = math.ceil(parallel / cores) / parallel
    return cores * share, share, f"'parallel' grid steps split over {cores} TensorCores ({spec.name})"


@dataclass
class _ProgramWalk:
    spec: TpuSpec
    calls: list[PallasCallEstimate] = field(default_factory=list)
    xla_bytes: float = 0.0
    xla_seconds: float = 0.0
    xla_ops: int = 0
    notes: set[str] = field(default_factory=set)

    known: dict[Any, np.ndarray] = field(default_factory=dict)
    """Values the program's given inputs determine (small integer arrays: group sizes, lengths, offsets),
    propagated through cheap XLA ops so pallas_calls see their scalar-prefetch contents."""

    def walk(self, jaxpr: jex_core.Jaxpr, mult: float) -> None:
        folded = _folded_transposes(jaxpr)
        if folded:
            self.notes.add(
                "transposes outside kernels that feed only other transposes, or undo the one before, are "
                "folded as XLA's algebraic simplifier folds them (no HBM copy)"
            )
        fusions = _loop_fusions(jaxpr, folded)
        if any(len(f.members) > 1 for f in fusions.values()):
            self.notes.add(
                "elementwise and layout ops outside kernels that feed one another are priced as XLA's loop "
                "fusions: each chain reads its inputs once and writes what leaves it once"
            )
        charged: set[int] = set()
        for pos, eqn in enumerate(jaxpr.eqns):
            name = eqn.primitive.name
            if pos in folded:
                continue
            fusion = fusions.get(pos)
            if fusion is not None:
                self._propagate(eqn)
                if id(fusion) not in charged:
                    charged.add(id(fusion))
                    if fusion.nbytes:
                        self.xla_ops += 1
                        self.xla_bytes += fusion.nbytes * mult
                        self.xla_seconds += fusion.nbytes / self.spec.device_hbm_bytes_per_s * mult
                continue
            if name == "pallas_call":
                n_prefetch = int(getattr(eqn.params["grid_mapping"], "num_index_operands", 0) or 0)
                pre = [self._value(v) for v in eqn.invars[:n_prefetch]]
                prefetch = pre if n_prefetch and all(p is not None for p in pre) else None
                self.calls.append(_estimate_call(eqn, self.spec, mult, prefetch))
            elif name in ("pjit", "jit", "closed_call") and sub_jaxprs(eqn):
                (sub,) = sub_jaxprs(eqn)
                for v, x in zip(sub.invars, eqn.invars, strict=True):
                    if (val := self._value(x)) is not None:
                        self.known[v] = val
                self.walk(sub, mult)
                for v, x in zip(eqn.outvars, sub.outvars, strict=True):
                    if (val := self._value(x)) is not None:
                        self.known[v] = val
            elif name == "scan":
                self.walk(as_jaxpr(eqn.params["jaxpr"])[0], mult * float(eqn.params["length"]))
            elif name == "while":
                trips = loop_pricing.jaxpr_loop_trips(eqn)
                if trips is None:
                    self.notes.add("while loop outside kernels: trip count unknown, body counted once")
                self.walk(as_jaxpr(eqn.params["body_jaxpr"])[0], mult * float(1 if trips is None else trips))
            elif name == "cond":
                self.notes.add("cond outside kernels: every branch counted (upper bound)")
                for sub in sub_jaxprs(eqn):
                    self.walk(sub, mult)
            elif sub_jaxprs(eqn):
                for sub in sub_jaxprs(eqn):
                    self.walk(sub, mult)
            elif name in FREE_IN_XLA:
                self._propagate(eqn)
            else:
                self._propagate(eqn)
                self._xla_op(eqn, mult)

    def _value(self, v: Any) -> np.ndarray | None:
        if isinstance(v, jex_core.Literal):
            return np.asarray(v.val)
        return self.known.get(v)

    def _propagate(self, eqn: jex_core.JaxprEqn) -> None:
        """Evaluate an XLA op whose inputs are all known and whose results are small integer arrays."""
        if not self.known:
            return
        vals = [self._value(v) for v in eqn.invars]
        if any(x is None for x in vals):
            return
        outs = [v.aval for v in eqn.outvars]
        if any(
            np.dtype(getattr(a, "dtype", np.float32)).kind not in "biu" or _size(a) > MAX_KNOWN_ELEMENTS
            for a in outs
        ):
            return
        try:
            got = _np_prim(eqn, vals)
        except KeyError:
            try:
                with jax.default_device(jax.local_devices(backend="cpu")[0]):
                    res = eqn.primitive.bind(*vals, **eqn.params)
                got = list(res) if eqn.primitive.multiple_results else [res]
            except Exception:  # noqa: BLE001 - an op the model cannot replay leaves its result unknown
                return
        for v, x in zip(eqn.outvars, got, strict=True):
            self.known[v] = np.asarray(x)

    def _xla_op(self, eqn: jex_core.JaxprEqn, mult: float) -> None:
        avals = [v.aval for v in eqn.invars if not isinstance(v, jex_core.Literal)] + [
            v.aval for v in eqn.outvars
        ]
        if all(not getattr(a, "shape", ()) for a in avals):
            return  # scalar bookkeeping
        nbytes = float(sum(_nbytes(a) for a in avals if hasattr(a, "dtype")))
        if eqn.primitive.name in ("gather", "dynamic_slice"):
            # it reads the slices it picks, not its whole operand (a page table picks 8192 of 10240 pages)
            operand, out = _nbytes(eqn.invars[0].aval), sum(_nbytes(v.aval) for v in eqn.outvars)
            nbytes -= max(0, operand - out)
        elif eqn.primitive.name.startswith("scatter") and len(eqn.invars) == 3:
            # in place: it reads the indices and updates and reads and writes the rows they hit, never the
            # whole operand it returns (one decode token's row of a 4096-token buffer)
            nbytes = float(_nbytes(eqn.invars[1].aval) + 3 * _nbytes(eqn.invars[2].aval))
        t = nbytes / self.spec.device_hbm_bytes_per_s
        if eqn.primitive.name == "dot_general":
            t = max(t, _dot_work(eqn, self.spec).mxu_seconds)
        self.xla_ops += 1
        self.xla_bytes += nbytes * mult
        self.xla_seconds += t * mult


@dataclass
class _LoopFusion:
    """Ops outside kernels that XLA runs as one loop fusion, and the HBM bytes it moves."""

    members: list[int]
    nbytes: float = 0.0


def _array_bytes(v: Any) -> float:
    a = v.aval
    return float(_nbytes(a)) if hasattr(a, "dtype") and hasattr(a, "shape") else 0.0


def _loop_fusions(jaxpr: jex_core.Jaxpr, folded: set[int]) -> dict[int, _LoopFusion]:
    """The loop fusions among the ops outside kernels (`XLA_LOOP_FUSIBLE`): ops joined by producer ->
    consumer edges, each group read and written once. A group reads each input produced outside it once -
    only the slices it takes, when slices are the only ops that read it - and writes each value used
    outside it (by a kernel, another op or the program's result); a group of bitcasts alone (reshapes,
    folded transposes) moves nothing. Ops at the program's top level only reach here; scalar bookkeeping
    is free either way."""
    eqns = jaxpr.eqns
    members = [
        i
        for i, e in enumerate(eqns)
        if (e.primitive.name in XLA_LOOP_FUSIBLE or i in folded)
        and any(getattr(v.aval, "shape", ()) for v in (*e.invars, *e.outvars) if hasattr(v, "aval"))
    ]
    if not members:
        return {}
    member = set(members)
    parent = {i: i for i in members}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    producer: dict[Any, int] = {}
    consumers: dict[Any, list[int]] = {}
    for i, e in enumerate(eqns):
        for v in e.outvars:
            producer[v] = i
        for v in e.invars:
            if not isinstance(v, jex_core.Literal):
                consumers.setdefault(v, []).append(i)
    for i in members:
        for v in eqns[i].invars:
            p = producer.get(v) if not isinstance(v, jex_core.Literal) else None
            if p is not None and p in member:
                parent[find(i)] = find(p)
    groups: dict[int, _LoopFusion] = {}
    for i in members:
        groups.setdefault(find(i), _LoopFusion(members=[])).members.append(i)
    results = {v for v in jaxpr.outvars if not isinstance(v, jex_core.Literal)}
    out: dict[int, _LoopFusion] = {}
    for fusion in groups.values():
        inside = set(fusion.members)
        moves = any(eqns[i].primitive.name not in FREE_IN_XLA and i not in folded for i in inside)
        read: dict[Any, float] = {}
        written = 0.0
        for i in fusion.members:
            e = eqns[i]
            for v in e.invars:
                if isinstance(v, jex_core.Literal) or producer.get(v) in inside or v in read:
                    continue
                readers = [eqns[c] for c in consumers.get(v, []) if c in inside]
                if readers and all(r.primitive.name == "slice" for r in readers):
                    read[v] = min(_array_bytes(v), float(sum(_array_bytes(r.outvars[0]) for r in readers)))
                else:
                    read[v] = _array_bytes(v)
            for v in e.outvars:
                if v in results or any(c not in inside for c in consumers.get(v, [])):
                    written += _array_bytes(v)
        fusion.nbytes = (sum(read.values()) + written) if moves else 0.0
        for i in fusion.members:
            out[i] = fusion
    return out


def _folded_transposes(jaxpr: jex_core.Jaxpr) -> set[int]:
    """Positions of the transposes XLA folds away between kernels: one whose result only feeds other
    transposes (XLA composes the pair into one), and one that undoes the transpose before it (the composed
    permutation is the identity: no copy at all).

    Channels-first conv kernels read the NCHW input that the task's own code transposes to NHWC: the
    generated wrapper transposes it back, and XLA cancels the pair. Charged as two HBM copies, a 128 x 8 x
    256 x 256 bf16 input cost 537 MB and 0.73 ms of glue on v5e beside a 1.6 ms kernel."""
    producer: dict[Any, int] = {}
    consumers: dict[Any, list[int]] = {}
    for i, e in enumerate(jaxpr.eqns):
        for v in e.invars:
            if not isinstance(v, jex_core.Literal):
                consumers.setdefault(v, []).append(i)
        for v in e.outvars:
            producer[v] = i
    results = {v for v in jaxpr.outvars if not isinstance(v, jex_core.Literal)}
    folded: set[int] = set()
    for i, e in enumerate(jaxpr.eqns):
        if e.primitive.name != "transpose":
            continue
        src = e.invars[0]
        p = producer.get(src) if not isinstance(src, jex_core.Literal) else None
        if p is not None and jaxpr.eqns[p].primitive.name == "transpose":
            first = tuple(int(a) for a in jaxpr.eqns[p].params["permutation"])
            composed = tuple(first[int(a)] for a in e.params["permutation"])
            if composed == tuple(range(len(composed))):
                folded.add(i)
        out = e.outvars[0]
        uses = consumers.get(out, [])
        if uses and out not in results and all(jaxpr.eqns[u].primitive.name == "transpose" for u in uses):
            folded.add(i)
    return folded


def estimate_pallas(
    closed_jaxpr: Any, gen: str, input_values: dict[int, Any] | None = None
) -> PallasEstimate:
    """Block-model TPU time of a program's pallas_calls (and a bytes/bandwidth charge for the rest).

    Takes a jaxpr rather than a function so it needs no execution, no TPU and no compile: the agents call
    it on every candidate, at production shapes, in milliseconds. `input_values` (position -> array): the
    contents of the program's small integer inputs, if known (the task's own group sizes); what they
    determine reaches the pallas_calls' scalar prefetch, whose index maps and guards are then replayed
    exactly instead of priced as an upper bound.
    """
    spec = get_spec(gen)
    jaxpr, consts = as_jaxpr(closed_jaxpr)
    walk = _ProgramWalk(spec)
    # constants the program closes over (a schedule table built while tracing) are known as they are
    for v, c in zip(jaxpr.constvars, consts, strict=False):
        arr = np.asarray(c) if hasattr(c, "shape") or np.isscalar(c) else None
        if arr is not None and arr.dtype.kind in "biu" and arr.size <= MAX_KNOWN_ELEMENTS:
            walk.known[v] = arr
    for pos, val in (input_values or {}).items():
        if 0 <= int(pos) < len(jaxpr.invars) and val is not None:
            v = jaxpr.invars[int(pos)]
            arr = np.asarray(val)
            if tuple(arr.shape) == tuple(v.aval.shape) and arr.dtype.kind in "biu":
                walk.known[v] = arr.astype(np.dtype(v.aval.dtype))
    walk.walk(jaxpr, 1.0)
    calls = walk.calls
    pallas_s = sum(c.estimated_seconds * c.multiplicity for c in calls)
    total = pallas_s + walk.xla_seconds
    notes = set(walk.notes)
    if not calls:
        notes.add("no pallas_call found: only the XLA bytes/bandwidth charge applies")
    if calls and walk.xla_seconds >= pallas_s:
        bound: BoundClass = "memory"
    elif calls:
        bound = max(calls, key=lambda c: c.estimated_seconds * c.multiplicity).bound
    else:
        bound = "memory"
    return PallasEstimate(
        method=f"maxkernel block model v1 ({spec.name}, per-device compiler-model peaks; see assumptions)",
        gen=spec.name,
        estimated_seconds=total,
        est_pallas_seconds=pallas_s,
        est_xla_seconds=walk.xla_seconds,
        bound=bound,
        est_hbm_bytes=sum(c.est_hbm_bytes * c.multiplicity for c in calls) + walk.xla_bytes,
        est_xla_bytes=walk.xla_bytes,
        est_mxu_flops=sum(c.est_mxu_flops * c.multiplicity for c in calls),
        est_vpu_elementwise_ops=sum(c.est_vpu_elementwise_ops * c.multiplicity for c in calls),
        est_transcendentals=sum(c.est_transcendentals * c.multiplicity for c in calls),
        est_grid_steps=int(sum(c.est_grid_steps * c.multiplicity for c in calls)),
        est_vmem_bytes=max((c.est_vmem_bytes for c in calls), default=0),
        vmem_exceeds_limit=any(c.vmem_exceeds_limit for c in calls),
        vmem_exceeds_capacity=any(c.vmem_exceeds_capacity for c in calls),
        pallas_calls=calls,
        xla_op_count=walk.xla_ops,
        assumptions=dict(ASSUMPTIONS),
        notes=sorted(notes),
        unpriced=UNPRICED_KERNEL_LOOP if any(UNPRICED_KERNEL_LOOP in c.notes for c in calls) else None,
    )


def estimated_speedup(
    reference: float | XlaEstimate | PallasEstimate, candidate: float | XlaEstimate | PallasEstimate
) -> float:
    """reference_estimate / candidate_estimate (>1 means the candidate is estimated faster).

    Only estimates go in: a measured time belongs in a measured speedup, never mixed with a model.
    """

    def seconds(x: float | XlaEstimate | PallasEstimate, which: str) -> float:
        if isinstance(x, XlaEstimate | PallasEstimate):
            s = x.estimated_seconds
        else:
            s = float(x)
        if s is None or not math.isfinite(s) or s <= 0:
            raise ValueError(f"{which} estimate must be a positive number of seconds, got {s!r}")
        return s

    return seconds(reference, "reference") / seconds(candidate, "candidate")
