"""Validation shapes chosen by a budget: the largest shapes whose predicted cost on this machine fits.

Correctness runs on a CPU: the reference in XLA:CPU and the candidate in TPU interpret mode, which costs
far more per flop and per grid step than XLA. A production workload (attention over `[4, 64, 4096, 128]`,
a convolution over a batch of 128, a 14336-wide MoE) does not fit either, and a fixed shrink factor leaves
some tasks still too large (the reference runs out of memory) and others needlessly small. So the sizes
are searched for:

* **What may change**: the generator's size knobs (`generator_knobs`): the task's own generator runs
  again with some literals changed, so index-like inputs (page tables, group sizes) stay consistent.
  A task with no knobs falls back to scaling its arrays' dimensions (`plan_factor`).
* **What a size costs**: predicted from the reference's jaxpr at that size (`program_cost`: flops,
  element work, bytes) and rates measured once per machine (`measure_rates`): the candidate's
  TPU-interpret time (flops, element ops, and grid steps guessed from the bytes moved) and the
  reference's peak memory. Nothing is allocated to predict.
* **What stays**: the structure of the reference (the same primitives at every size the search keeps),
  the tile multiples its arrays need (a lane dim that is a multiple of 128 stays one; for JAXBench a power
  of two up to 2048 first, which hand-written kernels tile with, then 128 if the budget needs it), and at
  least two along leading axes.
* **How**: greedy halving, round robin (shapes shrink evenly) while the prediction is over the budget; a
  step that breaks the generator, the reference's trace or structure, a tile multiple or the range of
  an integer input (a page table must still index its pool) freezes that knob at its last good value.
  Each step is one abstract trace.

The path the search took is kept: the last size on it that fits a larger budget is the harness's
larger-shape check (`Plan.larger`), so it too is a size the task's own generator makes.

Runs only in the sandboxed describe child (task code). JAX is imported lazily.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from maxkernel.tools.generator_knobs import Knob
from maxkernel.tools.results import ArraySpec

# --- what work costs on this machine ----------------------------------------------------------------------


@dataclass(frozen=True)
class Rates:
    """Seconds per unit of work on this machine."""

    xla_flop_s: float
    """Per flop of an XLA:CPU matmul (the reference)."""
    xla_elem_s: float
    """Per element of XLA:CPU elementwise work (fused chains: a few ops per element)."""
    interp_flop_s: float
    """Per flop of a matmul inside a kernel in TPU interpret mode."""
    interp_elem_s: float
    """Per element of a kernel's elementwise work in TPU interpret mode."""
    interp_step_s: float
    """Per grid step of a kernel in TPU interpret mode (DMA and bookkeeping callbacks)."""
    measured: bool = False


DEFAULT_RATES = Rates(
    xla_flop_s=1 / 120e9,
    xla_elem_s=1 / 400e6,
    interp_flop_s=1 / 30e9,
    interp_elem_s=1 / 40e6,
    interp_step_s=4e-3,
)
"""A 2-core x86 machine, idle (benchmarks/validation_sizing.md): used where nothing was measured."""

STEP_BYTES = 512 << 10
"""Bytes a typical kernel moves per grid step, to guess its steps from the bytes it reads and writes: a
(256, 512) f32 block. Small blocks make more steps; the rate absorbs the error at the sizes it is used."""


def measure_rates() -> Rates:
    """Time four small programs (about a second in all): an XLA matmul and elementwise chain, and a Pallas
    matmul at two block sizes (flops vs per-step cost) plus an elementwise kernel in TPU interpret mode."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    def best(fn: Callable[..., Any], *args: Any) -> float:
        jitted = jax.jit(fn)
        jax.block_until_ready(jitted(*args))
        times = []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            jax.block_until_ready(jitted(*args))
            times.append(time.perf_counter() - t0)
        return max(min(times), 1e-6)

    def mm_kernel(x_ref: Any, w_ref: Any, o_ref: Any) -> None:
        @pl.when(pl.program_id(2) == 0)
        def _init() -> None:
            o_ref[...] = jnp.zeros_like(o_ref)

        o_ref[...] += jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)

    def matmul(x: Any, w: Any, block: int) -> Any:
        n = x.shape[0]
        return pl.pallas_call(
            mm_kernel,
            grid=(n // block, n // block, n // block),
            in_specs=[
                pl.BlockSpec((block, block), lambda i, j, k: (i, k)),
                pl.BlockSpec((block, block), lambda i, j, k: (k, j)),
            ],
            out_specs=pl.BlockSpec((block, block), lambda i, j, k: (i, j)),
            out_shape=jax.ShapeDtypeStruct((n, n), jnp.float32),
            interpret=pltpu.InterpretParams(),
        )(x, w)

    def ew_kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = jnp.tanh(x_ref[...]) * 2.0 + 1.0

    def elementwise(x: Any) -> Any:
        rows = x.shape[0] // 8
        return pl.pallas_call(
            ew_kernel,
            grid=(8,),
            in_specs=[pl.BlockSpec((rows, x.shape[1]), lambda i: (i, 0))],
            out_specs=pl.BlockSpec((rows, x.shape[1]), lambda i: (i, 0)),
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            interpret=pltpu.InterpretParams(),
        )(x)

    n = 512
    x = jnp.ones((n, n), jnp.float32)
    flops = 2.0 * n**3
    xla_mm = best(lambda a, b: a @ b, x, x)
    big = jnp.ones((1024, 2048), jnp.float32)
    xla_ew = best(lambda a: jnp.tanh(a) * 2.0 + 1.0, big)
    coarse = best(lambda a, b: matmul(a, b, 256), x, x)  # 8 steps
    fine = best(lambda a, b: matmul(a, b, 128), x, x)  # 64 steps
    step = max(1e-5, (fine - coarse) / 56)
    interp_mm = max(1e-6, coarse - 8 * step)
    interp_ew = max(1e-6, best(elementwise, big) - 8 * step)
    return within_band(
        Rates(
            xla_flop_s=xla_mm / flops,
            xla_elem_s=xla_ew / big.size,
            interp_flop_s=interp_mm / flops,
            interp_elem_s=interp_ew / big.size,
            interp_step_s=step,
            measured=True,
        )
    )


REPEATS = 3
"""Timings per program in `measure_rates`; the fastest counts (other processes only ever slow one down)."""

BAND = 4.0
"""A measured rate stays within this factor of `DEFAULT_RATES`: timings taken while the machine is busy can
make one term of a difference vanish (a matmul's flops "free", its steps dearer), which would size
validation shapes for a machine that does not exist."""


def within_band(rates: Rates) -> Rates:
    """`rates` with each term clamped to [DEFAULT / BAND, DEFAULT * BAND]."""
    clamped = {
        name: min(
            max(getattr(rates, name), getattr(DEFAULT_RATES, name) / BAND),
            getattr(DEFAULT_RATES, name) * BAND,
        )
        for name in ("xla_flop_s", "xla_elem_s", "interp_flop_s", "interp_elem_s", "interp_step_s")
    }
    return Rates(**clamped, measured=rates.measured)


def measure_rates_job(payload: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Sandbox entry: `measure_rates` in a fresh child (no task code), as a dict."""
    import dataclasses

    ctx.guard()
    return dataclasses.asdict(measure_rates())


# --- what a program costs ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cost:
    """The reference's work at one size (all of a task's configurations together)."""

    flops: float = 0.0
    elements: float = 0.0
    io_bytes: int = 0
    """Inputs and outputs."""
    peak_bytes: int = 0
    """Predicted peak memory of one reference run: inputs, outputs and the two largest intermediates
    (XLA:CPU fuses elementwise chains, so what it keeps are dot and reduction results and fusion outputs)."""

    def __add__(self, other: Cost) -> Cost:
        return Cost(
            self.flops + other.flops,
            self.elements + other.elements,
            self.io_bytes + other.io_bytes,
            self.peak_bytes + other.peak_bytes,
        )

    def reference_seconds(self, rates: Rates) -> float:
        return self.flops * rates.xla_flop_s + self.elements * rates.xla_elem_s

    def candidate_seconds(self, rates: Rates) -> float:
        steps = max(1.0, self.io_bytes / STEP_BYTES)
        return (
            self.flops * rates.interp_flop_s
            + self.elements * rates.interp_elem_s
            + steps * rates.interp_step_s
        )

    def describe(self, rates: Rates) -> str:
        return (
            f"predicted {self.candidate_seconds(rates):.1f} s per input set in TPU interpret mode, reference "
            f"{self.reference_seconds(rates):.1f} s and {_mib(self.peak_bytes)} peak"
        )


def _mib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _nbytes(aval: Any) -> int:
    import numpy as np

    shape = getattr(aval, "shape", None)
    if shape is None:
        return 0
    try:
        itemsize = np.dtype(aval.dtype).itemsize
    except TypeError:
        itemsize = 4  # typed PRNG keys and the like
    return int(math.prod(int(d) for d in shape)) * itemsize


def _size(aval: Any) -> int:
    shape = getattr(aval, "shape", None)
    return int(math.prod(int(d) for d in shape)) if shape is not None else 0


def _walk_cost(jaxpr: Any, mult: float, acc: dict[str, Any]) -> None:
    from maxkernel.tools.jaxpr import REDUCTIONS, as_jaxpr, sub_jaxprs

    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        out = max((_size(v.aval) for v in eqn.outvars), default=0)
        if name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval
            k = math.prod(int(lhs.shape[d]) for d in contract) if contract else 1
            acc["flops"] += 2.0 * out * k * mult
        elif name == "conv_general_dilated":
            rhs = eqn.invars[1].aval
            per_output = _size(rhs) // max(1, int(rhs.shape[eqn.params["dimension_numbers"].rhs_spec[0]]))
            acc["flops"] += 2.0 * out * per_output * mult
        elif name == "scan":
            _walk_cost(as_jaxpr(eqn.params["jaxpr"])[0], mult * float(eqn.params["length"]), acc)
            continue
        elif name in REDUCTIONS:
            acc["elements"] += max((_size(v.aval) for v in eqn.invars), default=0) * mult
        elif subs := sub_jaxprs(eqn):
            for sub in subs:
                _walk_cost(sub, mult, acc)
            continue
        else:
            acc["elements"] += out * mult
        for v in eqn.outvars:
            acc["largest"] = sorted([*acc["largest"], _nbytes(v.aval)], reverse=True)[:2]


def program_cost(
    fn: Callable[..., Any], dynamic: list[ArraySpec], static: list[Any]
) -> tuple[Cost, tuple[str, ...], tuple[int, ...]]:
    """The cost of `fn(*dynamic, *static)`, its structure (the primitives in program order, nested jaxprs
    included) and every dimension of its program in order (`Probe.dims`), from one abstract trace. Raises
    whatever tracing raises."""
    import jax
    import numpy as np

    from maxkernel.tools.jaxpr import walk_eqns
    from maxkernel.tools.results import np_dtype

    specs = [jax.ShapeDtypeStruct(a.shape, np.dtype(np_dtype(a.dtype))) for a in dynamic]
    closed = jax.make_jaxpr(lambda *d: fn(*d, *static))(*specs)
    acc: dict[str, Any] = {"flops": 0.0, "elements": 0.0, "largest": []}
    _walk_cost(closed.jaxpr, 1.0, acc)
    io = sum(_nbytes(v.aval) for v in [*closed.jaxpr.invars, *closed.jaxpr.outvars])
    eqns = list(walk_eqns(closed.jaxpr))
    structure = tuple(e.primitive.name for e in eqns)
    dims = tuple(
        int(d)
        for v in [*closed.jaxpr.invars, *(o for e in eqns for o in e.outvars)]
        for d in getattr(v.aval, "shape", ())
    )
    return Cost(acc["flops"], acc["elements"], io, io + sum(acc["largest"])), structure, dims


# --- the budget and the search ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Budget:
    """What one input set of a validation size may cost."""

    seconds_per_set: float = 4.0
    """The candidate's predicted TPU-interpret time for one input set (every configuration)."""
    memory_bytes: int = 4 << 30
    """The reference's predicted peak (the judge and the candidate's interpreter hold such sets at once)."""
    larger_factor: float = 3.0
    """The larger-shape check may cost this many sets."""
    tiles_first: bool = False
    """Keep the format's tile multiples (2048 for JAXBench) while any knob, small counts included, can still
    shrink: a batch of 4 halves before a sequence of 2048 does, so that a hand-written kernel tiled with
    2048-wide blocks still tiles the shapes it is judged at (`--scale tiles`)."""

    def fits(self, cost: Cost, rates: Rates) -> bool:
        return cost.candidate_seconds(rates) <= self.seconds_per_set and self._memory_fits(cost)

    def fits_larger(self, cost: Cost, rates: Rates) -> bool:
        return cost.candidate_seconds(
            rates
        ) <= self.seconds_per_set * self.larger_factor and self._memory_fits(cost)

    def _memory_fits(self, cost: Cost) -> bool:
        # the reference's peak, and the sets' arrays as the evaluation holds them (judge, candidate, the
        # agent's read-back: `tasks.load_task` refuses a task whose 4 x inputs+outputs exceed the budget)
        return max(cost.peak_bytes, 4 * cost.io_bytes) <= self.memory_bytes

    def shrunk(self, factor: float) -> Budget:
        return replace(
            self, seconds_per_set=self.seconds_per_set * factor, memory_bytes=int(self.memory_bytes * factor)
        )


@dataclass
class Probe:
    """The task at one setting of its knobs: its configurations (shapes and statics), cost and structure."""

    values: dict[str, int]
    configs: list[tuple[list[ArraySpec], list[Any]]]
    cost: Cost
    structure: tuple[str, ...]
    dims: tuple[int, ...] = ()
    """Every dimension of the reference's program in order (inputs, then each equation's results): the
    same structure lines them up between two sizes."""
    int_max_of: Callable[[], tuple[int | None, ...]] | None = field(default=None, repr=False)
    """Computes, per dynamic input (all configurations in order), the largest value of an integer input,
    else None: a run of the generator, so only done when a step is about to be kept (`int_max`)."""
    _int_max: tuple[int | None, ...] | None = field(default=None, repr=False)

    @property
    def int_max(self) -> tuple[int | None, ...]:
        if self._int_max is None:
            self._int_max = self.int_max_of() if self.int_max_of is not None else ()
        return self._int_max


@dataclass
class Plan:
    """Where the search stopped, and why."""

    probe: Probe
    larger: Probe | None
    fits: bool
    frozen: dict[str, str] = field(default_factory=dict)
    """Knob label -> why it stopped before its floor (its next step broke the generator or the reference)."""
    steps: int = 0


@dataclass(frozen=True)
class Keep:
    """The multiples lane and sublane axes keep in one phase of the search."""

    lane: int = 128
    sublane: int = 8
    leading: int = 2


AxisKey = tuple[int, int, int]
"""(configuration, input, axis)."""


def pow2_part(d: int) -> int:
    return d & -d


def _role(configs: list[tuple[list[ArraySpec], list[Any]]], key: AxisKey) -> str:
    """`lane` (an array's last axis), `sublane` (second to last) or `leading`; every axis of an integer
    input is `leading`: index arrays (lengths, page tables) are read as scalars, never tiled."""
    ci, ai, ax = key
    spec = configs[ci][0][ai]
    if not spec.dtype.startswith(("float", "bfloat")):
        return "leading"
    from_end = len(spec.shape) - 1 - ax
    return "lane" if from_end == 0 else "sublane" if from_end == 1 else "leading"


def axis_floor(size: int, role: str, keep: Keep) -> int | None:
    """The smallest size an input axis may shrink to, or None when it must not shrink: a lane axis keeps a
    multiple of 128 (of the largest power of two dividing it, up to `keep.lane`), a sublane axis a multiple
    of 8 (likewise, up to `keep.sublane`), a leading axis at least 2 (and one larger than `keep.leading` a
    multiple of the largest power of two dividing it up to that: a sequence axis in `[B, S, H, D]` tiles
    like a sublane, while batch and heads below it shrink freely).
    An unaligned lane or sublane axis keeps its size (its ragged edge is part of what is validated)."""
    if role == "lane":
        return max(128, min(pow2_part(size), keep.lane)) if size % 128 == 0 else None
    if role == "sublane":
        return max(8, min(pow2_part(size), keep.sublane)) if size % 8 == 0 else None
    if size < 2:
        return None
    return max(2, min(pow2_part(size), keep.leading)) if size > keep.leading else 2


def _axis_ok(size: int, own: int, role: str, keep: Keep) -> bool:
    if size == own:
        return True
    floor = axis_floor(own, role, keep)
    return floor is not None and size >= floor and size % (2 if role == "leading" else floor) == 0


def _axes_map(probe: Probe) -> dict[AxisKey, int]:
    return {
        (ci, ai, ax): int(d)
        for ci, (dyn, _) in enumerate(probe.configs)
        for ai, a in enumerate(dyn)
        for ax, d in enumerate(a.shape)
    }


def _same_layout(a: Probe, b: Probe) -> bool:
    return len(a.configs) == len(b.configs) and all(
        len(da) == len(db)
        and all(len(x.shape) == len(y.shape) and x.dtype == y.dtype for x, y in zip(da, db, strict=True))
        for (da, _), (db, _) in zip(a.configs, b.configs, strict=True)
    )


SMALL_KNOB = 16
"""Knob values at or below this are structure (page size, K/V heads, group size), shrunk last."""

SMALL_COUNT = 128
"""Integer inputs whose values stay under this are counts and flags (active sequences, a mask), not indices
into a dimension: next to dims of a few dozen (heads, slots) their relations are coincidences."""


def _indices_in_range(trial: Probe, own: Probe) -> bool:
    """An integer input's values must keep indexing what they index: a dimension of the task's own program
    at or just above the input's largest value (up to twice it: a page pool of 16384 for a page table up
    to 16383, 4096 keys for lengths up to 4096) must stay at least the input's largest value at the trial
    size (a page table into a smaller pool, token offsets past a smaller buffer, lengths past the keys
    gathered are refused). Larger dimensions are products the value has nothing to do with."""
    if len(own.dims) != len(trial.dims):
        return False
    for own_max, trial_max in zip(own.int_max, trial.int_max, strict=False):
        if own_max is None or trial_max is None or own_max < SMALL_COUNT:
            continue
        for d_own, d_trial in zip(own.dims, trial.dims, strict=True):
            if own_max <= d_own <= 2 * own_max and d_trial < trial_max:
                return False
    return True


def plan_knobs(
    evaluate: Callable[[dict[str, int]], Probe],
    knobs: list[Knob],
    own: Probe,
    budget: Budget,
    rates: Rates,
    keep_multiple: int = 128,
    max_steps: int = 80,
) -> Plan:
    """Halve knobs until the prediction fits `budget` (see the module doc).

    `evaluate(values)` traces the task with those knob values; it raises when the generator or the
    reference fails there. Each step halves the knob halved the fewest times so far (shapes shrink
    evenly). Phases: sizes keeping `keep_multiple` on lanes and sublanes; then the TPU tile (128 lanes, 8
    sublanes); then also the knobs of a head's or a tile's size (<= 128 on a lane or sublane axis)."""
    own_axes = _axes_map(own)
    labels = {k.key: k.label for k in knobs}
    value_of = {k.key: k.value for k in knobs}
    # Which input axes each knob moves (one trial step each; a knob that moves none is not a size).
    moves: dict[str, list[AxisKey]] = {}
    frozen: dict[str, str] = {}
    for knob in knobs:
        if knob.value % 2 or not any(d % knob.value == 0 for d in own_axes.values()):
            continue
        try:
            trial = evaluate({knob.key: knob.value // 2})
        except Exception as exc:  # noqa: BLE001 - a literal whose change breaks the task is not a knob
            if knob.value in own_axes.values():  # it looks like a size: say why it stays
                frozen[labels[knob.key]] = f"kept at {knob.value}: at {knob.value // 2} {error_gist(exc)}"
            continue
        if _same_layout(trial, own):
            changed = [key for key, d in _axes_map(trial).items() if own_axes.get(key) != d]
            if changed:
                moves[knob.key] = changed
    # A knob of a head's or a tile's size (<= 128 on some array's lane axis: a head dim, or heads in a fused
    # heads x head-dim axis), or a small structural count (<= SMALL_KNOB: a page's tokens, K/V heads, a
    # group) only moves when the sizes alone cannot fit: halving it saves little, and it changes the
    # program's structure at the validation shapes (a page of 2 tokens is no longer the 16-token page the
    # kernel fetches whole, so the validated program would not be the one that ships).
    tier = {
        key: 2
        if value_of[key] <= SMALL_KNOB
        or (value_of[key] <= 128 and any(_role(own.configs, a) == "lane" for a in axes))
        else 1
        for key, axes in moves.items()
    }
    values: dict[str, int] = {}
    probe = own
    path = [own]
    steps = 0
    tiles = Keep(keep_multiple, keep_multiple, keep_multiple)
    order = (
        [(tiles, 1), (tiles, 2), (Keep(), 1), (Keep(), 2)]
        if budget.tiles_first
        else [(tiles, 1), (Keep(), 1), (Keep(), 2)]
    )
    phases = list(dict.fromkeys(order))
    for keep, max_tier in phases:
        stuck: set[str] = set()
        while not budget.fits(probe.cost, rates) and steps < max_steps:
            now = _axes_map(probe)
            # Round robin, so shapes shrink evenly: the knob halved the fewest times so far (by value), the
            # one whose tightest axis is largest among those.
            movable = {
                key: (
                    -math.log2(value_of[key] / values.get(key, value_of[key])),
                    min(now[a] for a in moves[key]),
                )
                for key in moves
                if key not in stuck and tier[key] <= max_tier and _can_halve(moves[key], now, own, keep)
            }
            if not movable:
                break
            key = max(movable, key=lambda k: movable[k])
            current = values.get(key, value_of[key])
            if current % 2:
                stuck.add(key)
                continue
            trial_values = {**values, key: current // 2}
            steps += 1
            try:
                trial = evaluate(trial_values)
            except Exception as exc:  # noqa: BLE001 - the generator or the reference breaks there: stop this knob
                stuck.add(key)
                frozen[labels[key]] = (
                    f"kept at {current}: at {current // 2} {type(exc).__name__}: {str(exc)[:160]}"
                )
                continue
            why = _refused(trial, own, keep)
            riders = _riders(trial, trial_values, value_of, set(moves)) if why == INDEX_REFUSAL else {}
            if riders:
                # The value that no longer fits is a literal of its own (lengths of CONFIG['max_seq_len']
                # next to CONFIG['pages_per_seq']): it halves with the size it measures.
                steps += 1
                try:
                    ridden = evaluate({**trial_values, **riders})
                except Exception:  # noqa: BLE001 - the pair breaks the generator: the size stays refused
                    ridden = None
                if ridden is not None and not _refused(ridden, own, keep):
                    trial_values, trial, why = {**trial_values, **riders}, ridden, ""
            if why:
                stuck.add(key)
                if why != "tile":  # a tile multiple is the normal end of a knob, not worth a note
                    frozen[labels[key]] = f"kept at {current}: at {current // 2} {why}"
                continue
            frozen.pop(labels[key], None)
            values, probe = trial_values, trial
            path.append(probe)
    fits = budget.fits(probe.cost, rates)
    # The larger-shape check: the last size on the way here that fits the larger budget (the task's own
    # shapes, when they do).
    larger = next((p for p in reversed(path[:-1]) if budget.fits_larger(p.cost, rates)), None)
    return Plan(probe=probe, larger=larger, fits=fits, frozen=frozen, steps=steps)


def error_gist(exc: BaseException) -> str:
    """`Type: message` in one line; for an error that carries a traceback (a callback's), its last line."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    if "Traceback (most recent call last)" in str(exc) and len(lines) > 1:
        return lines[-1][:200]
    return f"{type(exc).__name__}: {lines[0][:200] if lines else ''}"


def _riders(
    trial: Probe, values: dict[str, int], value_of: dict[str, int], movers: set[str]
) -> dict[str, int]:
    """Knobs that move no shape and whose value is the largest value of an integer input at this trial
    (a length, a position): halved with a size they index, {knob: halved value}."""
    maxima = {m for m in trial.int_max if m is not None and m >= SMALL_COUNT}
    return {
        key: value // 2
        for key in value_of
        if key not in movers and (value := values.get(key, value_of[key])) in maxima and value % 2 == 0
    }


def _can_halve(axes: list[AxisKey], now: dict[AxisKey, int], own: Probe, keep: Keep) -> bool:
    """Whether each of a knob's axes can still halve above its floor."""
    own_axes = _axes_map(own)
    for axis in axes:
        floor = axis_floor(own_axes[axis], _role(own.configs, axis), keep)
        if floor is None or now[axis] // 2 < floor:
            return False
    return True


INDEX_REFUSAL = "an integer input's values no longer fit the dimensions they index"


def _refused(trial: Probe, own: Probe, keep: Keep) -> str:
    """Why a trial size cannot be kept ("" when it can)."""
    if trial.structure != own.structure:
        return "the reference's operations change"
    own_axes = _axes_map(own)
    if not all(
        _axis_ok(d, own_axes[key], _role(own.configs, key), keep)
        for key, d in _axes_map(trial).items()
        if key in own_axes
    ):
        return "tile"
    if not _indices_in_range(trial, own):
        return INDEX_REFUSAL
    return ""


def describe_plan(plan: Plan, rates: Rates, budget: Budget, change: str) -> str:
    """One line for `KernelTask.validation_note`: what changed and what it is predicted to cost."""
    head = f"the task's own generator with {change}" if change else "the task's own shapes"
    fit = "within" if plan.fits else "OVER"
    note = f"{head} ({plan.probe.cost.describe(rates)}; {fit} the budget of {budget.seconds_per_set:g} s and {_mib(budget.memory_bytes)})"
    if plan.frozen:
        note += "; kept: " + "; ".join(f"{k} {v}" for k, v in list(plan.frozen.items())[:4])
    return note
