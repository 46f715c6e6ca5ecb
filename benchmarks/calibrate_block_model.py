"""Calibrate the Pallas block model against the TPU compiler's own cost model, on a CPU machine.

For plain tiled kernels (matmul in bf16 and f32 at several sizes and block shapes, an elementwise
add / gelu tiling, a row reduction) this prints

* the block model's estimate of the Pallas kernel (``estimate_pallas`` on its jaxpr),
* the TPU compiler's estimate of the equivalent plain XLA program (``estimate_xla``, ``optimal_seconds``),
* their ratio (block / XLA), the model's bound class and whether Mosaic actually compiles the kernel for
  that generation (an ahead-of-time compile through libtpu; no TPU needed).

Both sides are *estimates*. Agreement means the block model and the compiler tell the same story for
simple programs whose best tiling is obvious; it does not validate either against hardware. Where they
disagree on purpose (tiny tiles pay per-step overhead that XLA's own tiling avoids; f32 matmul passes)
the table says so.

It also checks what ``pl.CostEstimate`` does to ``cost_analysis()`` of a Pallas program.

Run: ``.venv/bin/python benchmarks/calibrate_block_model.py [--gens v5e v6e] [--no-compile]``
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import maxkernel.tools.estimate as estimate_module
from maxkernel.tools.estimate import ASSUMPTIONS, estimate_pallas, estimate_xla, topology_device
from maxkernel.tools.tpu_specs import get_spec

# ---------------------------------------------------------------------------------------------------------
# Kernels under test (written for this script; the plain XLA equivalents sit next to them)
# ---------------------------------------------------------------------------------------------------------


def _matmul_kernel(x_ref, y_ref, o_ref, acc_ref):
    """One (bm, bk) @ (bk, bn) block product accumulated over the last grid axis in an f32 scratch."""

    @pl.when(pl.program_id(2) == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _store():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def tiled_matmul(x, y, *, bm: int, bn: int, bk: int):
    """Grid (m/bm, n/bn, k/bk), k innermost: x and y blocks stream, the output block stays resident."""
    m, k = x.shape  # [m, k]
    n = y.shape[1]  # [k, n]

    def x_index_map(i, j, kk):
        return i, kk

    def y_index_map(i, j, kk):
        return kk, j

    def o_index_map(i, j, kk):
        return i, j

    return pl.pallas_call(
        _matmul_kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        grid=(m // bm, n // bn, k // bk),
        in_specs=[pl.BlockSpec((bm, bk), x_index_map), pl.BlockSpec((bk, bn), y_index_map)],
        out_specs=pl.BlockSpec((bm, bn), o_index_map),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"), vmem_limit_bytes=100 * 2**20
        ),
    )(x, y)


def _add_kernel(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] + y_ref[...]


def _gelu_kernel(x_ref, o_ref):
    o_ref[...] = jax.nn.gelu(x_ref[...])


def _elementwise(kernel: Callable[..., None], n_in: int, *xs, br: int, bc: int):
    rows, cols = xs[0].shape

    def index_map(i, j):
        return i, j

    spec = pl.BlockSpec((br, bc), index_map)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(xs[0].shape, xs[0].dtype),
        grid=(rows // br, cols // bc),
        in_specs=[spec] * n_in,
        out_specs=spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
    )(*xs)


def _row_sum_kernel(x_ref, o_ref):
    o_ref[...] = jnp.sum(x_ref[...], axis=-1, keepdims=True)


def row_sum(x, *, br: int):
    """Sum over the last axis with whole rows per block: out[r, 0] = sum_c x[r, c]."""
    rows, cols = x.shape

    def x_index_map(i):
        return i, 0

    def o_index_map(i):
        return i, 0

    return pl.pallas_call(
        _row_sum_kernel,
        out_shape=jax.ShapeDtypeStruct((rows, 1), x.dtype),
        grid=(rows // br,),
        in_specs=[pl.BlockSpec((br, cols), x_index_map)],
        out_specs=pl.BlockSpec((br, 1), o_index_map),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
    )(x)


# ---------------------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    family: str  # "matmul" | "elementwise" | "reduction"
    name: str
    pallas_fn: Callable[..., Any]
    xla_fn: Callable[..., Any]
    shapes: tuple[tuple[int, ...], ...]
    dtype: Any
    tiles: str = "large"  # "tiny" / "small": chosen to show per-step overhead and re-fetching, not to agree


def _cases() -> list[Case]:
    out: list[Case] = []
    for dtype in (jnp.bfloat16, jnp.float32):
        dn = "bf16" if dtype == jnp.bfloat16 else "f32"
        for size in (1024, 2048, 4096):
            for bm, bn, bk in ((128, 128, 128), (256, 256, 256), (512, 512, 512), (1024, 1024, 512)):
                if bm > size or bk > size:
                    continue
                if dtype == jnp.float32 and size == 1024 and bm != 512:
                    continue  # keep the table short: f32 shows the pass-count assumption at any size
                out.append(
                    Case(
                        "matmul",
                        f"matmul {dn} {size}^3 blk {bm}x{bn}x{bk}",
                        functools.partial(tiled_matmul, bm=bm, bn=bn, bk=bk),
                        lambda a, b: a @ b,
                        ((size, size), (size, size)),
                        dtype,
                        tiles={128: "tiny", 256: "small"}.get(bm, "large"),
                    )
                )
    for dtype, dn in ((jnp.bfloat16, "bf16"), (jnp.float32, "f32")):
        for br, bc in ((8, 128), (256, 4096), (512, 4096), (1024, 4096)):
            out.append(
                Case(
                    "elementwise",
                    f"add {dn} 4096^2 blk {br}x{bc}",
                    functools.partial(_elementwise, _add_kernel, 2, br=br, bc=bc),
                    lambda a, b: a + b,
                    ((4096, 4096), (4096, 4096)),
                    dtype,
                    tiles="tiny" if br == 8 else "large",
                )
            )
    for br, bc in ((256, 4096), (512, 4096)):
        out.append(
            Case(
                "elementwise",
                f"gelu f32 4096^2 blk {br}x{bc}",
                functools.partial(_elementwise, _gelu_kernel, 1, br=br, bc=bc),
                jax.nn.gelu,
                ((4096, 4096),),
                jnp.float32,
            )
        )
    for br in (256, 512):
        out.append(
            Case(
                "reduction",
                f"row-sum f32 4096^2 blk {br}x4096",
                functools.partial(row_sum, br=br),
                lambda x: jnp.sum(x, axis=-1, keepdims=True),
                ((4096, 4096),),
                jnp.float32,
            )
        )
    return out


def _mosaic_compiles(fn: Callable[..., Any], specs: list[jax.ShapeDtypeStruct], gen: str) -> str:
    sharding = jax.sharding.SingleDeviceSharding(topology_device(gen))
    sds = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding) for s in specs]
    try:
        jax.jit(fn).trace(*sds).lower().compile()
        return "ok"
    except Exception as e:  # noqa: BLE001 - the table reports the failure class, the run goes on
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"FAIL {type(e).__name__}: {first[:60]}"


def run(gens: list[str], compile_kernels: bool) -> int:
    print("# Block model vs TPU compiler cost model (both estimates; CPU machine, no TPU)\n")
    print("Model assumptions:")
    for k, v in ASSUMPTIONS.items():
        print(f"- {k}: {v}")
    ratios: dict[tuple[str, str, str], list[float]] = {}
    for gen in gens:
        spec = get_spec(gen)
        print(f"\n## {spec.display_name} ({spec.topology})\n")
        print(
            "| case | block est us | XLA est us | ratio | bound | steps | HBM MB (block/XLA) | VMEM MiB "
            "(! = over scoped limit) | mosaic compile |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for case in _cases():
            specs = [jax.ShapeDtypeStruct(s, case.dtype) for s in case.shapes]
            block = estimate_pallas(jax.make_jaxpr(case.pallas_fn)(*specs), gen)
            ref = estimate_xla(case.xla_fn, specs, gen)
            ratio = block.estimated_seconds / ref.estimated_seconds if ref.estimated_seconds else math.nan
            family = f"{case.family} {'bf16' if case.dtype == jnp.bfloat16 else 'f32'}"
            ratios.setdefault((gen, family, case.tiles), []).append(ratio)
            status = _mosaic_compiles(case.pallas_fn, specs, gen) if compile_kernels else "-"
            print(
                f"| {case.name} | {block.estimated_seconds * 1e6:.1f} | {ref.estimated_seconds * 1e6:.1f} | "
                f"{ratio:.2f} | {block.bound} | {block.est_grid_steps} | "
                f"{block.est_hbm_bytes / 1e6:.1f} / {(ref.est_bytes_accessed or 0) / 1e6:.1f} | "
                f"{block.est_vmem_bytes / 2**20:.1f}{' !' if block.vmem_exceeds_limit else ''} | {status} |"
            )
    print("\n## Summary: block / XLA ratio (geometric mean, min-max)\n")
    print("| gen | family | tiles | n | geo-mean | min | max | within 25% |")
    print("|---|---|---|---|---|---|---|---|")
    for (gen, family, tiles), rs in sorted(ratios.items()):
        good = [r for r in rs if math.isfinite(r) and r > 0]
        gm = math.exp(statistics.fmean(math.log(r) for r in good)) if good else math.nan
        within = sum(0.75 <= r <= 1.25 for r in good)
        print(
            f"| {gen} | {family} | {tiles} | {len(rs)} | {gm:.2f} | "
            f"{min(good):.2f} | {max(good):.2f} | {within}/{len(good)} |"
        )
    _cost_estimate_check(gens[0])
    return 0


def _cost_estimate_check(gen: str) -> None:
    """Does pl.CostEstimate change what cost_analysis() reports for a Pallas program? (Yes: it is echoed.)"""
    print(f"\n## pl.CostEstimate and cost_analysis() ({gen})\n")
    n = 2048
    spec = get_spec(gen)
    specs = [jax.ShapeDtypeStruct((n, n), jnp.bfloat16)] * 2
    flops, nbytes = 2 * n**3, 3 * n * n * 2

    def with_ce(ce: pl.CostEstimate | None) -> Callable[..., Any]:
        def f(x, y):
            return pl.pallas_call(
                _matmul_kernel,
                out_shape=jax.ShapeDtypeStruct((n, n), x.dtype),
                grid=(n // 512, n // 512, n // 512),
                in_specs=[
                    pl.BlockSpec((512, 512), lambda i, j, kk: (i, kk)),
                    pl.BlockSpec((512, 512), lambda i, j, kk: (kk, j)),
                ],
                out_specs=pl.BlockSpec((512, 512), lambda i, j, kk: (i, j)),
                scratch_shapes=[pltpu.VMEM((512, 512), jnp.float32)],
                cost_estimate=ce,
            )(x, y)

        return f

    for label, ce in (
        ("no CostEstimate", None),
        (
            "CostEstimate(2n^3 flops, 3n^2*2 bytes)",
            pl.CostEstimate(flops=flops, transcendentals=0, bytes_accessed=nbytes),
        ),
    ):
        est = estimate_xla(with_ce(ce), specs, gen)
        keys = {k: v for k, v in est.raw_cost_analysis.items() if "{" not in k}
        print(f"- {label}: {keys}; opaque custom calls {est.opaque_custom_calls}")
    print(
        f"  -> with a CostEstimate, optimal_seconds = max(flops / {spec.compiler_peak_tflops:g} TFLOP/s, bytes / "
        f"{spec.compiler_hbm_gbps:g} GB/s) = {max(flops / spec.device_peak_flops, nbytes / spec.device_hbm_bytes_per_s) * 1e6:.2f} us:"
        " the compiler echoes the kernel's own claim rather than estimating the kernel."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gens", nargs="+", default=["v5e", "v6e"])
    parser.add_argument(
        "--no-compile", action="store_true", help="skip the Mosaic AOT compile of each kernel"
    )
    parser.add_argument(
        "--f32-passes", type=int, default=None, help="override the block model's f32 MXU pass assumption"
    )
    args = parser.parse_args(argv)
    if args.f32_passes is not None:
        estimate_module.F32_MXU_PASSES = {**estimate_module.F32_MXU_PASSES, "default": args.f32_passes}
        print(f"(override: f32 matmul charged {args.f32_passes} MXU pass(es) at default precision)")
    t0 = time.perf_counter()
    rc = run(args.gens, compile_kernels=not args.no_compile)
    print(f"\n(took {time.perf_counter() - t0:.1f} s)")
    return rc


if __name__ == "__main__":
    sys.exit(main())
