"""Block sizes: the VMEM model, the default config and the tuning space of a generated program.

Figures used (per TensorCore, from `maxkernel.tools.tpu_specs`, measured against libtpu 0.0.42.1):

* physical VMEM: v4 16 MiB, v5e 128 MiB, v5p 64 MiB, v6e 128 MiB, 7x 64 MiB;
* default scoped limit without `vmem_limit_bytes`: 16 MiB (v4, v5e, v5p), 32 MiB (v6e, 7x).

Every generated kernel sets `vmem_limit_bytes` explicitly, so the default scoped limit does not bind; the
budget a config must fit is half the smallest physical VMEM among the targets (64 MiB for v5e + v6e). Half,
because the model counts blocks (double-buffered), scratch and a rough allowance for in-kernel temporaries,
and Mosaic needs room of its own. Defaults aim lower, at 16 MiB, so they also fit the default scoped limit
of every generation. A config is valid when every block dim is a multiple of its alignment (lanes: 128;
sublanes: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit dtypes) or covers the whole dim, and when its VMEM
estimate fits the budget.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from maxkernel.authors.base import TileConfig
from maxkernel.authors.offline.spec import KernelSpec, ParamSpec, ProgramSpec, block_for
from maxkernel.tools.tpu_specs import DEFAULT_GENERATIONS, PER_STEP_OVERHEAD_S, get_spec

MiB = 1 << 20
DEFAULT_TARGET = 16 * MiB

LADDERS = {
    "lane": [128, 256, 512, 1024, 2048, 4096],
    "sublane": [8, 16, 32, 64, 128, 256, 512, 1024, 2048],
    "leading": [1, 2, 4, 8, 16, 32, 64],
}

STARTS = {
    "BLOCK_M": 512,
    "BLOCK_N": 512,
    "BLOCK_K": 512,
    # attention: a grid step costs ~0.35 us of overhead, and 1024 x 1024 score tiles (12 MiB of f32 temporaries)
    # still fit the 16 MiB default target; the block model rates them faster than 256 x 512 on the suite's causal,
    # sliding-window and grouped-query tasks (their coarser mask skip costs less than the steps saved)
    "BLOCK_Q": 1024,
    "BLOCK_KV": 1024,
    "BLOCK_ROWS": 256,
    "BLOCK_COLS": 1024,
    "BLOCK_RED": 4096,
    "BLOCK_LEAD": 8,
}


def key_of(param: str) -> str:
    """TileConfig key of a constant: BLOCK_M -> block_m, K1_BLOCK_M -> k1_block_m."""
    return param.lower()


def vmem_budget(tpu: list[str]) -> int:
    return min(get_spec(t).vmem_bytes for t in tpu) // 2


def vmem_ceiling(tpu: list[str]) -> int:
    """Largest `vmem_limit_bytes` a kernel may ask for: three quarters of the smallest physical VMEM."""
    return min(get_spec(t).vmem_bytes for t in tpu) * 3 // 4


def kernel_values(kernel: KernelSpec, config: TileConfig) -> dict[str, int]:
    vals: dict[str, int] = {}
    for p in kernel.params:
        v = config.get(key_of(p.name))
        vals[p.name] = int(v) if v is not None else p.default
    return vals


def vmem_estimate(kernel: KernelSpec, values: dict[str, int]) -> int:
    """VMEM the kernel's blocks, scratch and temporaries take: what a config must fit into the budget."""
    return sum(b.vmem_bytes(values) for b in kernel.buffers if b.kind != "compiler")


def compiler_vmem(kernel: KernelSpec, values: dict[str, int]) -> int:
    """Scoped VMEM Mosaic takes for itself on top (the bf16 splits of a HIGHEST f32 dot's operands)."""
    return sum(b.vmem_bytes(values) for b in kernel.buffers if b.kind == "compiler")


def vmem_limit(kernel: KernelSpec, values: dict[str, int], tpu: list[str]) -> int:
    need = vmem_estimate(kernel, values)
    want = max(32 * MiB, int(need * 1.5) + 8 * MiB + compiler_vmem(kernel, values))
    return min(_round_mib(want), vmem_ceiling(tpu))


def _round_mib(n: int) -> int:
    return -(-n // MiB) * MiB


def hbm_traffic(kernel: KernelSpec, values: dict[str, int]) -> int:
    """Bytes moved between HBM and VMEM: each operand block is fetched again whenever its block index
    changes, i.e. once per step of every grid axis up to the innermost axis it is indexed by that has more
    than one step (an lhs row block whose K is whole stays resident while an outer N axis walks)."""
    steps = [a.steps(values) for a in kernel.grid]
    total = 0
    for b in kernel.buffers:
        if b.kind not in ("input", "output"):
            continue
        walked = [a for a in b.axes if steps[a] > 1]
        if not walked:
            fetches = 1
        else:
            last = max(walked)
            fetches = 1
            for s in steps[: last + 1]:
                fetches *= s
        total += fetches * b.hbm_block_bytes(values)
    return total


def grid_steps(kernel: KernelSpec, values: dict[str, int]) -> int:
    n = 1
    for a in kernel.grid:
        n *= a.steps(values)
    return n


def predicted_seconds(program: ProgramSpec, config: TileConfig, tpu: list[str]) -> float:
    """A coarse TPU-time prediction for ranking configs, summed over the target generations.

    Pure arithmetic on the program's plain data (no JAX: this runs in the agent process): per kernel,
    max(HBM traffic / bandwidth, flops / MXU peak, transcendentals / EUP rate) + grid steps x the per-step
    overhead. It ranks configs of one program against each other; the harness's block model (on the
    kernel's real jaxpr) is what estimates a kernel's time.
    """
    total = 0.0
    for gen in tpu:
        spec = get_spec(gen)
        for k in program.kernels:
            vals = kernel_values(k, config)
            t_mem = hbm_traffic(k, vals) / spec.device_hbm_bytes_per_s
            t_mxu = k.flops * k.mxu_passes / spec.device_peak_flops
            t_eup = k.transcendentals / spec.compiler_transcendentals_per_s
            total += max(t_mem, t_mxu, t_eup) + grid_steps(k, vals) * PER_STEP_OVERHEAD_S
    return total


def candidates(p: ParamSpec) -> list[int]:
    """Aligned values for one param; everything at least the dim's extent collapses into one entry."""
    ladder = [v for v in LADDERS[p.role] if v % p.align == 0 or p.role == "leading"]
    out: list[int] = []
    for v in ladder:
        out.append(v)
        if v >= p.extent:
            break
    return out or [p.align]


def default_values(
    kernel: KernelSpec, budget: int, mxu: int = 128, gens: Sequence[str] = DEFAULT_GENERATIONS
) -> dict[str, int]:
    """Start from sizes that suit the MXU and the pipeline, then halve the largest block until the
    estimate fits the default target (16 MiB), or at least the budget. `mxu` is the widest MXU side among
    the targets (256 on v6e): matmul K and N blocks narrower than it leave part of the array idle. `gens`
    are the run's target generations, whose block-model terms choose a matmul's blocks."""
    vals: dict[str, int] = {}
    for p in kernel.params:
        base = p.name.split("_", 1)[1] if p.name.startswith("K") and "_BLOCK_" in p.name else p.name
        start = STARTS.get(base, 256)
        cands = candidates(p)
        fit = [c for c in cands if c <= start] or cands[:1]
        vals[p.name] = fit[-1]
        if kernel.family in LEAST_PADDING_FAMILIES:
            vals[p.name] = _least_padding(p, cands, vals[p.name])
    if kernel.family == "rowwise" and vals:
        _size_rows(kernel, vals)
        # a leading block too (rows of a rowwise kernel over short trailing axes): MoE routing's rank
        # kernels over [512 chunks, 128, 1, 128] took 8192 steps of 8-row blocks, 2.2 ms of step overhead on
        # v5e around 1.1 ms of work (block model)
        _size_rows(kernel, vals, suffix="BLOCK_LEAD", hbm=True, grow_only=True)
    if kernel.family == "elementwise" and vals:
        _size_rows(kernel, vals, suffix="BLOCK_LEAD", hbm=True)
        _size_rows(kernel, vals, hbm=True, grow_only=True)
    start = dict(vals)
    # a tile of grouped query heads is `row_group` tiles of one head's rows: the target grows with it
    for target in (min(DEFAULT_TARGET * kernel.row_group, budget), budget):
        # each target shrinks from the start: a kernel that cannot fit the small target (a whole output row
        # per tile) gets the largest blocks that fit the budget, not the smallest ones
        vals = dict(start)
        guard = 0
        while vmem_estimate(kernel, vals) > target and guard < 64:
            guard += 1
            shrinkable = [p for p in kernel.params if _smaller(p, vals[p.name]) is not None]
            if not shrinkable:
                break
            rows_first = [
                p
                for p in shrinkable
                if kernel.family in LEAST_PADDING_FAMILIES
                and p.role == "sublane"
                and vals[p.name] > MIN_ROWS_FIRST
            ]
            if rows_first:
                # attention: fewer query rows before fewer keys (a narrow key block leaves the score tile's lanes
                # and the per-row softmax bookkeeping poorly used; a grouped-query block is group x rows tall)
                shrinkable = rows_first
            p = max(shrinkable, key=lambda p: (block_for(p.extent, vals[p.name], 1), p.role != "sublane"))
            vals[p.name] = _smaller(p, vals[p.name])  # type: ignore[assignment]
        if vmem_estimate(kernel, vals) <= target:
            break
    if ("matmul" in kernel.family or kernel.family == "conv") and kernel.params:
        # matmuls may take ROW_TILE_TARGET (their VMEM limit is set explicitly); the conv family keeps the
        # default target its halo'd row blocks were sized for
        target = (
            budget
            if kernel.family == "matmul_rowreduce"
            else DEFAULT_TARGET
            if kernel.family == "conv"
            else ROW_TILE_TARGET
        )
        modelled = _modelled_values(kernel, min(budget, target), mxu, gens)
        if target == ROW_TILE_TARGET and budget > target and modelled is not None:
            wider = _modelled_values(kernel, budget, mxu, gens)
            if wider is not None and _worth_wider(kernel, modelled, wider, gens):
                modelled = wider
        if modelled is not None and (
            _fills_mxu(kernel, modelled, mxu) > _fills_mxu(kernel, vals, mxu)
            or _modelled_cost(kernel, modelled, gens) < _modelled_cost(kernel, vals, gens)
        ):
            vals = modelled
    if kernel.family == "grouped_matmul":
        _whole_contraction(kernel, vals, budget)
    for p in kernel.params:
        p.default = vals[p.name]
    return vals


def _whole_contraction(kernel: KernelSpec, vals: dict[str, int], budget: int) -> None:
    """A grouped matmul visits a row block once per group it holds rows of. With a K block narrower than
    K the lhs block changes every step, so it is read again on every visit (under skewed routing a
    2048-row block holds a dozen small groups: a dozen reads of it); with the whole K in one block it
    stays in VMEM across its visits. Take the whole K where it fits the budget, narrowing N (then M) to
    make room; otherwise keep `vals`."""
    ks = [p for p in kernel.params if p.name.endswith("BLOCK_K")]
    if not ks or all(vals[p.name] >= p.extent for p in ks):
        return
    trial = dict(vals)
    for p in ks:
        trial[p.name] = candidates(p)[-1]
    others = [p for p in kernel.params if p.name.endswith(("BLOCK_N", "BLOCK_M"))]
    others.sort(key=lambda p: not p.name.endswith("BLOCK_N"))  # N first: it keeps the lhs block whole
    while vmem_estimate(kernel, trial) > budget:
        for p in others:
            smaller = _smaller(p, trial[p.name])
            if smaller is not None and smaller >= 128:
                trial[p.name] = smaller
                break
        else:
            return
    vals.update(trial)


ROW_TILE_TARGET = 32 * MiB
"""VMEM a matmul default may use (one that walks N online for its row reductions, or a plain one): a 16 MiB
cap forces small row blocks and K blocks, so the lhs is re-read once per N block, and a compute-bound
matmul pays ~0.27 us per grid step for nothing (a 8192 x 4096 x 4096 f32 product in 1024 steps: 276 us of
8.6 ms on v5e, 13% of its 2.1 ms on v6e); still half the 64 MiB budget. A matmul
that keeps whole output rows (N full, `matmul_rowreduce`) may use the whole budget: it re-reads the whole
weight matrix once per row block, and its K block must also fill the MXU (a 4096 x 8192 f32 linear +
softmax: 128-row blocks read 4 GiB of weights; 256-row blocks with 256-deep K blocks half that, and fill
v6e's 256-deep MXU, which a 128-deep K block runs at half rate)."""

MXU_PARAMS = ("BLOCK_K", "BLOCK_N", "BLOCK_O")
"""Matmul block constants that set an MXU operand's depth (K) or width (N): narrower than the MXU (256 on
v6e and 7x, 128 before) and the block model pads them to it (the systolic array runs at the fraction used).
A direct convolution's output-channel block (`BLOCK_O`) is the N of every tap's matmul: a 256-channel conv
in 128-channel blocks ran v6e's MXU at half rate (its VMEM went to whole-image row blocks instead)."""


def _mxu_param(p: ParamSpec) -> bool:
    return p.name.endswith(MXU_PARAMS)


def _fills_mxu(kernel: KernelSpec, values: dict[str, int], mxu: int) -> bool:
    """True when every matmul K/N block is a multiple of the MXU side or the whole (short) dim."""
    return all(
        values[p.name] % mxu == 0 or values[p.name] >= p.extent for p in kernel.params if _mxu_param(p)
    )


WIDER_GAIN = 0.9
"""A matmul default goes past `ROW_TILE_TARGET` (up to the whole budget) only when the block model's terms
say that saves at least 10% on some target generation and costs more on none. Larger blocks are not free:
Mosaic unrolls the body over the block, and the AOT compile grows several times with them, for a few percent
on compute-bound tiles. Where a tile is memory-bound on one generation the gain is large (an 8192^3 bf16 GEMM
on v6e: 1024 x 1024 blocks re-read both operands 8 times and are HBM-bound, 1024 x 2048 x 2048 ones are
compute-bound)."""


def _worth_wider(
    kernel: KernelSpec,
    narrow: dict[str, int],
    wide: dict[str, int],
    gens: Sequence[str] = DEFAULT_GENERATIONS,
) -> bool:
    per_gen = [(_modelled_cost(kernel, wide, (gen,)), _modelled_cost(kernel, narrow, (gen,))) for gen in gens]
    return all(w <= n for w, n in per_gen) and any(w <= WIDER_GAIN * n for w, n in per_gen)


def _modelled_cost(
    kernel: KernelSpec, values: dict[str, int], gens: Sequence[str] = DEFAULT_GENERATIONS
) -> float:
    """The block-model terms block sizes change, as the block model combines them: the larger of HBM time
    (re-fetched blocks) and MXU time (fixed flops x the precision's passes), plus grid-step overhead. A
    compute-bound kernel gains nothing from less traffic, only from fewer steps; a memory-bound one weighs
    both. Generations differ in where that ridge lies (v5e ~270 flops/byte, v6e ~560), so the cost is
    summed over the run's target generations `gens`."""
    traffic = hbm_traffic(kernel, values)
    steps = grid_steps(kernel, values)
    flops = kernel.flops * _padding_factor(kernel, values)
    total = 0.0
    for gen in gens:
        spec = get_spec(gen)
        t_mxu = flops * kernel.mxu_passes / spec.device_peak_flops
        total += max(traffic / spec.device_hbm_bytes_per_s, t_mxu) + steps * PER_STEP_OVERHEAD_S
    return total


def _padding_factor(kernel: KernelSpec, values: dict[str, int]) -> float:
    """How much more work the blocks do than the dims hold: a dim that does not divide its block is
    computed in whole blocks (zero-padded or masked), so the MXU runs over the padding too. A 5000-deep K
    in 2048-deep blocks is 6144 deep on the MXU (23% more), in 1024-deep blocks 5120 (2.4%); left out, the
    tuner took the deeper block for its fewer steps and the block model then charged the padded product."""
    factor = 1.0
    for p in kernel.params:
        if p.extent > 0:
            b = block_for(p.extent, values[p.name], p.align)
            factor *= (-(-p.extent // b) * b) / p.extent
    return factor


def _modelled_values(
    kernel: KernelSpec, target: int, mxu: int = 128, gens: Sequence[str] = DEFAULT_GENERATIONS
) -> dict[str, int] | None:
    """Matmul kernels: the aligned config within `target` with the least modelled cost (ties: less VMEM),
    preferring configs whose K/N blocks fill the MXU (`_fills_mxu`). Halving the largest block shrinks M as
    readily as K, and for a kernel that keeps whole output rows (N full) a small M re-reads the whole
    weight matrix once per row block."""
    names = [p.name for p in kernel.params]
    best: tuple[tuple[bool, float, int], dict[str, int]] | None = None
    for values in itertools.product(*(candidates(p) for p in kernel.params)):
        vals = dict(zip(names, values, strict=True))
        vmem = vmem_estimate(kernel, vals)
        if vmem > target:
            continue
        key = (not _fills_mxu(kernel, vals, mxu), _modelled_cost(kernel, vals, gens), vmem)
        if best is None or key < best[0]:
            best = (key, vals)
    return None if best is None else best[1]


def _size_rows(
    kernel: KernelSpec,
    vals: dict[str, int],
    suffix: str = "BLOCK_ROWS",
    hbm: bool = False,
    grow_only: bool = False,
) -> None:
    """Row-wise kernels (and the leading block of an elementwise map over short trailing axes): aim for
    ~1 MiB per input block, the sweet spot of the pipelined DMA. `hbm`: count the bytes a step copies, not
    their padded VMEM layout (a map over 64-lane rows moves half what it occupies; sized by its VMEM
    footprint it took 4x the steps, each ~0.35 us, for nothing). `grow_only`: never below the start (the
    row block of an elementwise map over narrow rows: a ResNet bottleneck's batch-norm apply over
    (64 * 56 * 56, 64) bf16 took 784 steps of 256 rows, 32 KiB per input block, ~0.27 us of overhead
    each, about as long as its pass over HBM)."""
    rows = [p for p in kernel.params if p.name.endswith(suffix)]
    if not rows:
        return
    p = rows[0]
    probe = dict(vals)
    probe[p.name] = p.align if p.role != "leading" else 1
    size = (lambda b: b.hbm_block_bytes(probe)) if hbm else (lambda b: b.block_bytes(probe))
    per_row = max(sum(size(b) for b in kernel.buffers if b.kind == "input"), 1) / probe[p.name]
    want = int((1 * MiB) / per_row)
    cands = candidates(p)
    fit = [c for c in cands if c <= max(want, cands[0])]
    sized = fit[-1] if fit else cands[0]
    vals[p.name] = max(sized, vals[p.name]) if grow_only else sized


LEAST_PADDING_FAMILIES = ("attention", "linear_attention")
"""Families whose padded rows/keys are computed in full (a score tile per block pair): an unaligned sequence
(577 ViT tokens) padded up to whole 256/512 blocks does 2-3x the work, where one whole-dim block pads only to
the (8, 128) tile inside VMEM, with no HBM pad copy."""

MAX_PADDING = 1.125
"""Padded extent / extent above which a block that needs no padding is preferred."""

MAX_WHOLE_SEQUENCE = 1024
"""Longest dim taken whole to avoid padding: beyond it a masked (causal, banded) kernel loses the key
blocks it skips, and the score tile grows past what the start sizes were chosen for."""


MIN_ROWS_FIRST = 256
"""Attention query blocks shrink first, down to this many rows, when the default tiles exceed the target."""


def _least_padding(p: ParamSpec, cands: list[int], v: int) -> int:
    """The start value, unless it pads the dim by more than `MAX_PADDING` while a larger candidate up to
    `MAX_WHOLE_SEQUENCE` needs no padding at all (a divisor, or the whole dim); the VMEM fit is checked
    after, as for any start."""

    def padded(c: int) -> int:
        b = block_for(p.extent, c, p.align)
        return -(-p.extent // b) * b

    if padded(v) <= p.extent * MAX_PADDING:
        return v
    exact = [c for c in cands if v < c <= MAX_WHOLE_SEQUENCE and padded(c) == p.extent]
    return exact[0] if exact else v


def _smaller(p: ParamSpec, v: int) -> int | None:
    cands = [c for c in candidates(p) if c < block_for(p.extent, v, 1)]
    return cands[-1] if cands else None


def default_config(program: ProgramSpec, tpu: list[str]) -> TileConfig:
    budget = vmem_budget(tpu)
    mxu = max(get_spec(t).mxu_shape[0] for t in tpu)
    values: dict[str, int] = {}
    for k in program.kernels:
        for name, v in default_values(k, budget, mxu, tpu).items():
            values[key_of(name)] = v
    return TileConfig.of(values)


def validate(program: ProgramSpec, config: TileConfig, tpu: list[str]) -> list[str]:
    """Problems with a config (empty when valid): misaligned blocks, VMEM over budget, unknown keys."""
    problems = []
    budget = vmem_budget(tpu)
    known = {key_of(p.name) for k in program.kernels for p in k.params}
    for key in config.as_dict():
        if key not in known:
            problems.append(f"unknown parameter {key}")
    for k in program.kernels:
        vals = kernel_values(k, config)
        for p in k.params:
            v = vals[p.name]
            if v < p.extent and v % p.align:
                problems.append(f"{key_of(p.name)}={v} is not a multiple of {p.align} ({p.role})")
        est = vmem_estimate(k, vals)
        if est > budget:
            problems.append(
                f"{k.name}: VMEM estimate {est / MiB:.1f} MiB exceeds the budget {budget / MiB:.0f} MiB"
            )
    return problems


OVERSIZED_FACTOR = 4
"""A kernel whose VMEM figure is more than this many times the smallest physical VMEM among the targets is
out of reach, not merely over budget: no compiler can place it, and Mosaic/XLA may grow past any memory
limit trying (a 2^16 x 2^16 comparison block of an argsort: 12 GB and still growing, the judge killed)."""


def oversized(program: ProgramSpec, config: TileConfig, tpu: list[str]) -> list[str]:
    """Kernels whose own VMEM figure at `config` is out of reach (see OVERSIZED_FACTOR), as reasons."""
    limit = OVERSIZED_FACTOR * min(get_spec(t).vmem_bytes for t in tpu)
    out = []
    for k in program.kernels:
        est = vmem_estimate(k, kernel_values(k, config))
        if est > limit:
            out.append(f"{k.name} needs {est / MiB:.0f} MiB of VMEM at its smallest blocks")
    return out


def tuning_space(
    program: ProgramSpec, tpu: list[str], *, per_kernel: int = 48, total: int = 64
) -> list[TileConfig]:
    """Valid configs: every aligned combination per kernel that fits VMEM, at most `per_kernel` of them
    (spread over the range of VMEM use); several kernels vary one at a time around the default."""
    budget = vmem_budget(tpu)
    default = default_config(program, tpu)
    per: list[list[dict[str, int]]] = []
    for k in program.kernels:
        names = [p.name for p in k.params]
        combos = []
        for values in itertools.product(*(candidates(p) for p in k.params)):
            vals = dict(zip(names, values, strict=True))
            if vmem_estimate(k, vals) <= budget and vmem_estimate(k, vals) + compiler_vmem(
                k, vals
            ) <= vmem_ceiling(tpu):
                combos.append(vals)
        combos.sort(key=lambda v: vmem_estimate(k, v))
        if len(combos) > per_kernel:
            step = len(combos) / per_kernel
            combos = [combos[int(i * step)] for i in range(per_kernel)]
        per.append(combos)
    out: list[TileConfig] = [default]
    seen = {default}
    base = default.as_dict()
    for combos in per:
        for vals in combos:
            cfg = TileConfig.of(base, **{key_of(n): v for n, v in vals.items()})
            if cfg not in seen:
                seen.add(cfg)
                out.append(cfg)
    return out[:total]
