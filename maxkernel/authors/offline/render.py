"""Render a `ProgramSpec` at a tile config into a kernel module, and write the plan. Agent side, no JAX.

The module is self-contained (JAX only): block-size constants and VMEM limits at the top, a docstring with
the tiling and the figures behind it, small padding helpers, then per kernel its index maps, body and
wrapper, and finally `computation` with the reference's signature.
"""

from __future__ import annotations

import builtins
import inspect
import symtable
import textwrap
from typing import Any

from maxkernel.authors.base import TileConfig
from maxkernel.authors.offline.spec import KernelSpec, ProgramSpec, block_for, chunk_rows
from maxkernel.authors.offline.tuning import (
    MiB,
    grid_steps,
    hbm_traffic,
    kernel_values,
    key_of,
    vmem_budget,
    vmem_estimate,
    vmem_limit,
)
from maxkernel.tools.tpu_specs import get_spec

_HELPERS_TEMPLATE = '''
def _round_up(x, multiple):
    return -(-x // multiple) * multiple


{BLOCK_RULE}


def _pad_to(x, shape):
    """Zero-pad `x` at the end of each dim up to `shape` (no-op where it already matches)."""
    if tuple(x.shape) == tuple(shape):
        return x
    return jnp.pad(x, [(0, t - s) for s, t in zip(x.shape, shape)])


def _crop(x, shape):
    """Drop the padding again."""
    if tuple(x.shape) == tuple(shape):
        return x
    return x[tuple(slice(0, s) for s in shape)]


def _nbytes(*arrays):
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in arrays)
'''


def _rule_source(fn: Any, head: str, generated: str) -> str:
    """A `spec` rule as the generated module's own function (`head` renamed to `generated`): the tuner's
    figures and the kernel's own choice come from one function, so they cannot drift apart."""
    src = textwrap.dedent(inspect.getsource(fn))
    if head not in src:
        raise AssertionError(f"spec.{fn.__name__}'s signature changed; update render")
    return src.replace(head, generated)


def _block_rule_source() -> str:
    """`spec.block_for` as the generated module's `_block`."""
    return _rule_source(
        block_for,
        "def block_for(extent: int, target: int, align: int) -> int:",
        "def _block(extent, target, align):",
    )


HELPERS = _HELPERS_TEMPLATE.replace("{BLOCK_RULE}", _block_rule_source().strip("\n"))
"""Helpers every generated module carries (padding, cropping, the block-size rule, byte counts)."""

ROW_CHUNKS_HELPER = (
    _rule_source(chunk_rows, "def chunk_rows(rows: int, chunk: int) -> int:", "def _chunk_rows(rows, chunk):")
    + '''

def _row_chunks(body, rows, *refs):
    """Run `body` on the refs `rows` leading rows at a time (`_chunk_rows`), so its temporaries are a
    chunk's, not the block's. A counted `while_loop` at every shape, one trip or several: a `fori_loop` of
    one trip lowers without its counter, and the program must be one at all shapes."""
    total = refs[0].shape[0]
    chunk = _chunk_rows(total, rows)

    def step(i):
        r0 = pl.multiple_of(i * chunk, chunk)
        body(*(r.at[pl.ds(r0, chunk)] for r in refs))
        return i + 1

    lax.while_loop(lambda i: i < total // chunk, step, 0)
'''
)
"""Carried by a module whose kernels walk a block in row chunks (`spec.chunk_rows` is its rule, as `_chunk_rows`)."""


def _mib(n: float) -> str:
    return f"{n / MiB:.1f} MiB" if n >= 0.1 * MiB else f"{n / 1024:.0f} KiB"


def _fmt_bytes(n: float) -> str:
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    return _mib(n)


def kernel_figures(kernel: KernelSpec, config: TileConfig, tpu: list[str]) -> dict[str, float | int | str]:
    vals = kernel_values(kernel, config)
    blocks = {p.name: block_for(p.extent, vals[p.name], p.align) for p in kernel.params}
    est = vmem_estimate(kernel, vals)
    traffic = hbm_traffic(kernel, vals)
    return {
        "blocks": ", ".join(f"{k}={v}" for k, v in blocks.items()) or "whole arrays",
        "vmem": est,
        "limit": vmem_limit(kernel, vals, tpu),
        "steps": grid_steps(kernel, vals),
        "traffic": traffic,
        "grid": " x ".join(str(a.steps(vals)) for a in kernel.grid),
    }


def _tiling_lines(kernel: KernelSpec, config: TileConfig, tpu: list[str]) -> list[str]:
    vals = kernel_values(kernel, config)
    f = kernel_figures(kernel, config, tpu)
    lines = [f"{kernel.name}: {kernel.title}", f"  {kernel.structure}" if kernel.structure else ""]
    lines.append(f"  blocks at the task's shapes: {f['blocks']}; grid {f['grid']} = {f['steps']} steps")
    for b in kernel.buffers:
        size = b.block_bytes(vals)
        extra = (
            (" x2 (double-buffered)" if b.copies == 2 else "")
            if b.kind not in ("temporary", "compiler")
            else (f" x{b.copies}" if b.copies > 1 else "")
        )
        lines.append(f"    {b.what}: {_mib(size)}{extra}")
    lines.append(
        f"  VMEM: ~{_mib(float(f['vmem']))} estimated (budget {_mib(vmem_budget(tpu))}); "
        f"vmem_limit_bytes {_mib(float(f['limit']))}"
    )
    ai = kernel.flops / max(float(f["traffic"]), 1.0)
    lines.append(
        f"  HBM traffic ~{_fmt_bytes(float(f['traffic']))}, {kernel.flops:.3g} flops: {ai:.1f} flops/byte"
    )
    return [ln for ln in lines if ln]


def render(program: ProgramSpec, config: TileConfig, tpu: list[str]) -> str:
    """The kernel module for one config."""
    parts: list[str] = []
    doc = [program.summary.rstrip(".") + ".", ""]
    doc.append(
        "Generated by maxkernel's offline author from the reference's jaxpr. "
        + (f"{len(program.kernels)} Pallas kernels; " if len(program.kernels) > 1 else "One Pallas kernel; ")
        + "only layout work (reshape, transpose, pad, slice) runs outside them."
    )
    doc.append("")
    doc.append(f"Tiling (figures at the task's own shapes, for {', '.join(tpu)}):")
    for k in program.kernels:
        doc.extend(_tiling_lines(k, config, tpu))
    doc.append("")
    doc.append(
        "Dims that do not divide their block are zero-padded outside the kernel and cropped afterwards; "
        "reductions only run along dims that are whole in a block, and padded keys are masked."
    )
    parts.append('"""' + "\n".join(doc).replace('"""', "'''") + '\n"""')
    parts.append(
        "import functools\nimport math\n\nimport jax\nimport jax.numpy as jnp\nfrom jax import lax\n"
        "from jax.experimental import pallas as pl\nfrom jax.experimental.pallas import tpu as pltpu"
    )
    consts = []
    for k in program.kernels:
        vals = kernel_values(k, config)
        if len(program.kernels) > 1:
            consts.append(f"# {k.name}: {k.title}")
        for p in k.params:
            consts.append(
                f"{p.name} = {vals[p.name]}  # {p.doc} ({p.role}, multiple of {p.align} unless whole)"
            )
        prefix = p_prefix(k)
        lim = vmem_limit(k, vals, tpu)
        consts.append(
            f"{prefix}VMEM_LIMIT_BYTES = {lim // MiB} * 1024 * 1024  # ~{_mib(vmem_estimate(k, vals))} estimated use"
        )
    parts.append("\n".join(consts))
    parts.append(HELPERS.strip("\n"))
    if any("_row_chunks(" in k.code for k in program.kernels):
        parts.append(ROW_CHUNKS_HELPER.strip("\n"))
    for k in program.kernels:
        parts.append(k.code.strip("\n"))
    parts.append(program.computation_code.strip("\n"))
    return "\n\n\n".join(parts) + "\n"


def p_prefix(kernel: KernelSpec) -> str:
    """The constants' prefix of a kernel (K0_ ... in multi-kernel programs, none otherwise)."""
    for p in kernel.params:
        head = p.name.split("BLOCK_")[0]
        return head
    stem = kernel.name.rsplit("_", 1)
    return f"K{stem[-1]}_" if stem[-1].isdigit() else ""


def plan_text(
    program: ProgramSpec, config: TileConfig, tpu: list[str], space_size: int, hints: list[str]
) -> str:
    """The plan, as an expert would write it: what, how, tiling with figures, what to tune."""
    L: list[str] = []
    L.append(f"# Plan: {program.task_id or 'task'} — {program.family}")
    L.append("")
    L.append("## What the reference computes")
    L.append(program.summary.rstrip(".") + ".")
    L.append(f"Inputs: {', '.join(program.inputs)}; outputs: {', '.join(program.outputs)}.")
    ops = [o.split(" -> ")[0] for o in program.ops]
    if ops:
        L.append(f"Primitives after inlining ({len(ops)}): {', '.join(_compress(ops))}.")
    L.append("")
    L.append("## Kernel structure")
    for k in program.kernels:
        L.append(f"- **{k.name}** ({k.family}): {k.title}. {k.structure}.")
        for n in k.notes:
            L.append(f"  - {n}")
    if program.glue:
        L.append(
            f"- Outside Pallas, as plain XLA layout work: {', '.join(program.glue)} (no arithmetic), plus each "
            "kernel's operand transposes/reshapes/padding into its block layout."
        )
    else:
        L.append("- Outside Pallas: only each kernel's operand reshapes/padding into its block layout.")
    L.append("")
    L.append("## Tiling and why")
    peak = {t: get_spec(t) for t in tpu}
    for k in program.kernels:
        f = kernel_figures(k, config, tpu)
        L.extend(_tiling_lines(k, config, tpu))
        for t, s in peak.items():
            t_flops = k.flops / s.device_peak_flops
            t_mem = float(f["traffic"]) / s.device_hbm_bytes_per_s
            bound = "compute" if t_flops >= t_mem else "memory"
            L.append(
                f"  on {t}: ≥{max(t_flops, t_mem) * 1e6:.1f} µs by the roofline "
                f"({t_flops * 1e6:.1f} µs MXU, {t_mem * 1e6:.1f} µs HBM): {bound}-bound"
            )
    L.append("")
    L.append(
        f"VMEM budget per config: {_mib(vmem_budget(tpu))} (half the smallest physical VMEM among "
        f"{', '.join(tpu)}); every kernel sets vmem_limit_bytes explicitly."
    )
    L.append("")
    L.append("## What to tune")
    for k in program.kernels:
        for p in k.params:
            L.append(
                f"- `{key_of(p.name)}` ({p.doc}): multiples of {p.align} up to the dim ({p.extent}); "
                + _tradeoff(p.name)
            )
    L.append(f"- {space_size} valid configs in the tuning space (aligned, within the VMEM budget).")
    if hints:
        L.append("")
        L.append("## Hints taken into account")
        L.extend(f"- {h}" for h in hints)
    return "\n".join(L) + "\n"


def _tradeoff(name: str) -> str:
    base = name.split("BLOCK_")[-1]
    return {
        "M": "bigger tiles reuse each weight block for more rows (less HBM traffic) but need more VMEM.",
        "N": "bigger tiles reuse each lhs block more; with an epilogue reduction N stays whole.",
        "K": "bigger K blocks mean fewer accumulator updates and grid steps; VMEM grows with bm+bn.",
        "Q": "more query rows per step reuse every key/value block more; VMEM and vreg pressure grow.",
        "KV": "longer key blocks amortise the online-softmax rescaling; the score tile grows as bq x bkv.",
        "ROWS": "more rows per step amortise the ~0.35 µs per-step overhead; VMEM grows linearly.",
        "COLS": "wider lane blocks mean fewer steps and longer DMAs.",
    }.get(base, "trade VMEM for fewer grid steps.")


def _compress(ops: list[str]) -> list[str]:
    out: list[str] = []
    for o in ops:
        if out and out[-1].split(" x")[0] == o:
            head, _, n = out[-1].partition(" x")
            out[-1] = f"{head} x{int(n or 1) + 1}"
        else:
            out.append(o)
    return out[:40] + (["..."] if len(out) > 40 else [])


def undefined_names(source: str) -> list[str]:
    """Names a module reads that nothing defines: not imported, assigned or defined at module level, not a
    parameter or local of the function that reads them, and not a builtin. A generated module that uses
    `np` without importing it fails only when that line runs (on a TPU, in a user's program); this finds it
    from the text, with the standard library's own symbol tables."""
    top = symtable.symtable(source, "<generated kernel module>", "exec")
    defined = set(dir(builtins)) | {
        s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()
    }
    missing: set[str] = set()

    def walk(table: symtable.SymbolTable) -> None:
        for s in table.get_symbols():
            if not s.is_referenced() or s.get_name() in defined:
                continue
            if table.get_type() == "module" or s.is_global():
                missing.add(s.get_name())
        for child in table.get_children():
            walk(child)

    walk(top)
    return sorted(missing)
