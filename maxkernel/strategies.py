"""The optimisation strategy library: what a plan can set out to change, in this project's own words.

Each strategy is rendered into the plan prompt of a round or search branch that applies it. Strategies
with a `prefers` rule also map to concrete kernel variants for authors that have a tuning space (the
offline author): the rule picks, among valid configs, the one the strategy argues for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

HOPELESS_FACTOR = 10.0
"""A config predicted more than this many times slower than the best config of the same space is not worth
an evaluation: the ranking model is coarse, but not wrong by 10x, and such configs (8-row blocks, many tiny
steps) are also the slowest to check in interpret mode. Used by the autotuner and the offline transforms."""

Category = Literal["data movement", "layout", "compute", "tuning"]

# A preference over configs: a sort key (higher is preferred) on the config's parameters.
Prefer = Callable[[dict[str, int | str]], float]


def _blocks(params: dict[str, int | str]) -> list[int]:
    """Block sizes of a config: `block_m`, `bm`, and per-kernel keys such as `k1_block_m`."""
    return [
        int(v)
        for k, v in params.items()
        if isinstance(v, int) and (k.lower().startswith(("block", "b")) or "block" in k.lower())
    ]


def _block_product(params: dict[str, int | str]) -> float:
    total = 1.0
    for v in _blocks(params):
        total *= v
    return total


def _named(name: str) -> Prefer:
    return lambda p: float(sum(int(v) for k, v in p.items() if name in k.lower() and isinstance(v, int)))


@dataclass(frozen=True)
class Strategy:
    name: str
    category: Category
    title: str
    guidance: str
    prefers: Prefer | None = field(default=None, compare=False, repr=False)

    def render(self) -> str:
        return f"**{self.title}** ({self.category}). {self.guidance}"


STRATEGIES: tuple[Strategy, ...] = (
    # --- data movement --------------------------------------------------------------------------------
    Strategy(
        "larger_tiles",
        "data movement",
        "Grow the tiles",
        "Fewer, larger blocks cut per-step overhead and re-fetches: grow the block sizes as far as VMEM "
        "(double-buffered) allows, keeping them multiples of (8, 128).",
        _block_product,
    ),
    Strategy(
        "smaller_tiles",
        "data movement",
        "Shrink the tiles",
        "When VMEM is tight or the grid has too few steps to pipeline and to spread over TensorCores, "
        "use smaller blocks so the next block's DMA overlaps this block's compute.",
        lambda p: -_block_product(p),
    ),
    Strategy(
        "fuse_epilogue",
        "data movement",
        "Fuse the epilogue",
        "Apply bias, activation, scaling, residual and casts to the f32 accumulator in VMEM before the "
        "single store, instead of writing the raw product and re-reading it.",
    ),
    Strategy(
        "fuse_prologue",
        "data movement",
        "Fuse the prologue",
        "Normalisations, casts or scalings of an input belong in the kernel that reads it, so the "
        "input crosses HBM once.",
    ),
    Strategy(
        "fuse_chain",
        "data movement",
        "One kernel for the chain",
        "Merge consecutive pallas_calls whose intermediate round-trips through HBM into one kernel "
        "that keeps the intermediate in VMEM.",
    ),
    Strategy(
        "cache_reused_block",
        "data movement",
        "Keep the reused block resident",
        "Give the operand that every step of an inner axis reuses an index map that ignores that axis, "
        "so it is fetched once per outer step (e.g. the whole K panel of x when it fits).",
    ),
    Strategy(
        "full_k_panel",
        "data movement",
        "Whole contraction in one block",
        "If a full K panel of both operands fits in VMEM, drop the K grid axis and the accumulator: one "
        "dot per output tile, no init/finalise branches.",
        _named("k"),
    ),
    Strategy(
        "deeper_pipelining",
        "data movement",
        "Deeper pipelining",
        "Use pipeline_mode=pl.Buffered(3) on the operand whose fetch is exposed, when VMEM allows a "
        "third buffer, to hide irregular DMA latency.",
    ),
    Strategy(
        "scalar_prefetch",
        "data movement",
        "Scalar prefetch for indirection",
        "Pass page tables, group offsets or lengths with PrefetchScalarGridSpec(num_scalar_prefetch=...) "
        "so index maps can read them and only the needed blocks are fetched.",
    ),
    Strategy(
        "skip_masked_blocks",
        "data movement",
        "Skip fully masked blocks",
        "For causal, sliding-window or ragged masks, clamp the kv index map and guard the body with "
        "pl.when so blocks that are entirely masked are neither fetched nor computed.",
    ),
    Strategy(
        "manual_dma",
        "data movement",
        "Manual double-buffered DMA",
        "Where BlockSpecs cannot express the access (gathers over a page table), use memory_space=ANY "
        "with pltpu.make_async_copy into VMEM scratch and semaphores, starting the next copy before "
        "computing on the current one.",
    ),
    Strategy(
        "input_output_alias",
        "data movement",
        "Alias output to input",
        "When the output overwrites an input of the same shape (residual updates), alias them with "
        "input_output_aliases to save an HBM allocation and a copy.",
    ),
    # --- layout ---------------------------------------------------------------------------------------
    Strategy(
        "align_8x128",
        "layout",
        "Align blocks to (8, 128)",
        "Make the last two block dims multiples of (8, 128) — (16, 128) for bf16 — or the full array "
        "dims; pad ragged edges once outside the kernel and slice the result.",
    ),
    Strategy(
        "lane_dense_output",
        "layout",
        "Lane-dense outputs",
        "Arrange outputs so the last dim is a multiple of 128 (e.g. reshape (m, 64) to (m/2, 128)), "
        "avoiding masked partial stores.",
    ),
    Strategy(
        "reduce_on_lanes",
        "layout",
        "Reduce along the lane axis",
        "Put the reduced axis last so reductions run across lanes within a vreg row, and keep the "
        "independent axis on sublanes.",
    ),
    Strategy(
        "no_singleton_trailing",
        "layout",
        "No singleton trailing dims",
        "Blocks like (n, 1) waste 127 of 128 lanes: keep statistics as (n, 128)-broadcast or (1, n) rows.",
    ),
    Strategy(
        "transpose_outside",
        "layout",
        "Transpose once, outside",
        "Pre-transpose a weight outside the kernel (a layout op XLA fuses into the producer) so the "
        "kernel's dot is a plain (m, k) @ (k, n) with no in-kernel transpose.",
    ),
    Strategy(
        "head_major_layout",
        "layout",
        "Head-major attention layout",
        "Lay q/k/v out as (batch, heads, seq, head_dim) so each grid step reads contiguous (seq, d) "
        "tiles; put grouped-query sharing in the index map, not in a repeat.",
    ),
    # --- compute --------------------------------------------------------------------------------------
    Strategy(
        "f32_accumulation",
        "compute",
        "Accumulate in f32",
        "Keep bf16 operands into the MXU with preferred_element_type=float32 and an f32 scratch; cast "
        "once at the store.",
    ),
    Strategy(
        "bf16_operands",
        "compute",
        "bf16 MXU operands",
        "Where the task's tolerance allows, feed the MXU bf16 operands (its native input) and keep f32 "
        "only for accumulation and normalisation statistics.",
    ),
    Strategy(
        "cheap_transcendentals",
        "compute",
        "Cheaper transcendentals",
        "Use exp2 with a folded log2(e) scale, tanh-form GELU when the reference uses it, reciprocal "
        "via pl.reciprocal(approx=True) only where tolerance allows, and compute exp once per element.",
    ),
    Strategy(
        "online_softmax",
        "compute",
        "Online softmax",
        "Replace a two-pass softmax over a long axis with running max/sum across blocks (flash style), "
        "rescaling the accumulator by exp(m_old - m_new).",
    ),
    Strategy(
        "hoist_invariants",
        "compute",
        "Hoist loop invariants",
        "Compute scales, masks and broadcast bias rows once per outer step (under pl.when on the first "
        "inner step, kept in scratch) rather than every step.",
    ),
    Strategy(
        "remove_redundant_work",
        "compute",
        "Remove redundant work",
        "Drop recomputation of statistics, repeated casts and ops whose results are discarded; fold "
        "constant scalings into one multiply.",
    ),
    Strategy(
        "grid_order_reuse",
        "compute",
        "Order the grid for reuse",
        "Choose which output axis iterates fastest so that the larger operand's block stays resident "
        "between consecutive steps.",
        _named("order"),
    ),
    Strategy(
        "parallel_semantics",
        "compute",
        "Mark parallel axes",
        "Declare independent grid axes 'parallel' (megacore and multi-TensorCore chips split them) and "
        "only reduction axes 'arbitrary'.",
    ),
    Strategy(
        "split_for_cores",
        "compute",
        "Enough steps for every core",
        "On chips with two TensorCores (v4, v5p, 7x) make the parallel grid extent at least 2 and even.",
    ),
    Strategy(
        "mxu_shaped_tiles",
        "compute",
        "MXU-shaped tiles",
        "Use matmul tiles that are multiples of the MXU (128 on v5e, 256 on v6e/7x) in both the "
        "contraction and output dims.",
        lambda p: float(sum(1 for v in _blocks(p) if v % 256 == 0)),
    ),
    # --- tuning ---------------------------------------------------------------------------------------
    Strategy(
        "joint_block_search",
        "tuning",
        "Joint block-size search",
        "Search block sizes jointly rather than one at a time, under the double-buffered VMEM budget of "
        "the target generation, and keep the fastest per (shape bucket, dtype, generation).",
    ),
    Strategy(
        "raise_vmem_limit",
        "tuning",
        "Raise the scoped VMEM limit",
        "Set CompilerParams(vmem_limit_bytes=...) toward the physical VMEM when larger tiles measured or "
        "estimated faster but overflow the default scoped limit.",
    ),
    Strategy(
        "per_generation_config",
        "tuning",
        "Per-generation configs",
        "Keep separate tuned configs for v5e (128-wide MXU, 16 MiB default scoped VMEM) and v6e/7x "
        "(256-wide MXU, larger VMEM): one config rarely wins on both.",
    ),
    Strategy(
        "shape_bucketing",
        "tuning",
        "Bucket shapes",
        "Key tuned configs by rounded shape buckets so nearby production shapes reuse a winner instead "
        "of re-tuning.",
    ),
)

_BY_NAME = {s.name: s for s in STRATEGIES}


def strategy_names() -> list[str]:
    return [s.name for s in STRATEGIES]


def get_strategy(name: str) -> Strategy:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown strategy {name!r}; known: {', '.join(_BY_NAME)}") from None


def pick_config(strategy: Strategy, configs: list[dict[str, int | str]]) -> int | None:
    """Index of the config a strategy argues for (None when it has no rule or nothing to choose)."""
    if strategy.prefers is None or not configs:
        return None
    scores = [strategy.prefers(c) for c in configs]
    best = max(range(len(configs)), key=lambda i: scores[i])
    return best
