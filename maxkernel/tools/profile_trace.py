"""Capture a profile of a jitted function and boil it down to a small, honest summary.

What the xplane holds here (JAX 0.10.2, measured on a CPU machine):

* ``/host:CPU`` plane. Every executed HLO instruction is an event on the XLA client's thread-pool line
  (``tf_XLAPjRtCpuClient/...``) named after the instruction (``copy.13``, ``while.9``, ``ynn_fusion``) with
  stats ``hlo_op`` / ``hlo_module`` / ``program_id``. Events nest: a ``while`` contains
  ``ThunkExecutor::Execute`` which contains the loop body's instructions. Each instruction is followed by a
  tiny ``end: <name>`` marker event. The ``python`` line holds Python frames and our step annotations.
* ``pallas_call(..., interpret=True)`` has no op of its own on CPU: the kernel is lowered to an XLA
  ``while`` loop over the grid, and its HLO metadata carries no trace of "pallas_call". So
  :func:`capture_trace` re-evaluates the function's jaxpr with every ``pallas_call`` inside
  ``jax.named_scope("pallas_call[<kernel>]")``; the scope lands in the HLO ``op_name`` metadata, which is
  saved next to the trace, and :func:`summarize_trace` uses it to attribute instructions (and everything
  nested inside them) to the kernel.
* On a TPU the device plane (``/device:TPU:N``) has an "XLA Ops" line; a Pallas kernel is one
  ``tpu_custom_call`` op there. That path is written from the xplane format but was not exercised on real
  TPU hardware here (none was available); a synthetic TPU-shaped xplane is covered by the tests.

Times from a CPU trace are CPU times of an XLA reference or of an interpreted kernel. They say where the
CPU spent its time, never how fast a TPU is, and the summary labels them so.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import jax
import jax.extend.core as jex_core
from pydantic import BaseModel, Field

from maxkernel.tools.estimate import pallas_call_name
from maxkernel.tools.jaxpr import iter_pallas_eqns

STEP_ANNOTATION = "maxkernel.step"
"""Name of the TraceAnnotation wrapped around each traced call; the summary sums these for wall time."""

META_FILE = "maxkernel_trace.json"
"""Written by capture_trace next to the xplane: label, platform, interpret mode, HLO file names."""

PALLAS_SCOPE_PREFIX = "pallas_call["

_DMA_SYNC_RE = re.compile(r"dma|sync|wait|copy-start|copy-done|send|recv", re.IGNORECASE)
_TPU_KERNEL_RE = re.compile(r"custom-call|tpu_custom_call|mosaic|pallas", re.IGNORECASE)
_HLO_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{[^}]*?op_name=\"([^\"]*)\"")
_HLO_MODULE_RE = re.compile(r"^HloModule\s+([\w.\-]+)")


class OpStat(BaseModel):
    """One row of the op table: all executions of one HLO instruction (or device op name)."""

    name: str
    source_op: str | None = Field(description="JAX-level op path from HLO metadata, where known.")
    count: int
    measured_total_us: float = Field(description="Self time: duration minus nested op events.")
    measured_mean_us: float
    share: float = Field(description="Fraction of all op self time.")
    is_kernel: bool
    is_dma_sync: bool


class TraceSummary(BaseModel):
    """Measured facts from one profile, small enough for a prompt. Never a TPU figure unless on_tpu."""

    kind: Literal["measured"] = "measured"
    label: str
    platform: str = Field(description="Where it ran: 'cpu', 'tpu', 'gpu'.")
    device_label: str = Field(description="E.g. 'cpu (XLA reference)', 'cpu (Pallas interpret)'.")
    on_tpu: bool
    trace_path: str
    perfetto_trace_path: str | None
    steps: int = Field(description="Traced calls found (step annotations), 0 if the trace has none.")
    measured_wall_us: float = Field(description="Sum of step wall times; op-event span if no steps.")
    measured_step_us: list[float]
    measured_busy_us: float = Field(description="Sum of op self times over all threads.")
    distinct_ops: int
    ops: list[OpStat] = Field(description="Top N by self time.")
    kernel_detection: str = Field(description="How kernel ops were recognised, or why they were not.")
    measured_kernel_us: float
    measured_non_kernel_us: float
    kernel_share: float
    dma_sync_present: bool
    measured_dma_sync_us: float
    measured_compute_us: float
    dma_sync_share: float
    busiest_line: str | None
    measured_idle_gap_total_us: float = Field(description="Gaps between ops on the busiest line, in steps.")
    measured_idle_gap_max_us: float
    notes: list[str] = Field(default_factory=list)

    def to_markdown(self) -> str:
        """A compact table for an LLM prompt or a report; the heading states where it was measured."""
        warn = "" if self.on_tpu else " - CPU timings, not TPU performance"
        lines = [
            f"**Trace `{self.label}`: measured on {self.device_label}{warn}**",
            "",
            f"- wall {self.measured_wall_us:.1f} us over {self.steps} step(s); op busy "
            f"{self.measured_busy_us:.1f} us; kernel {self.kernel_share:.0%} ({self.kernel_detection})",
            "- DMA/sync: "
            + (
                f"{self.dma_sync_share:.0%} ({self.measured_dma_sync_us:.1f} us)"
                if self.dma_sync_present
                else "absent"
            )
            + f"; idle gaps on busiest line: {self.measured_idle_gap_total_us:.1f} us total, "
            f"largest {self.measured_idle_gap_max_us:.1f} us",
            "",
            "| op | jax op | count | total us | mean us | share | kernel |",
            "|---|---|---|---|---|---|---|",
        ]
        shown = 0.0
        for op in self.ops:
            shown += op.share
            src = _shorten(op.source_op or "", 60)
            lines.append(
                f"| {op.name} | {src} | {op.count} | {op.measured_total_us:.1f} | {op.measured_mean_us:.2f} | "
                f"{op.share:.1%} | {'yes' if op.is_kernel else ''} |"
            )
        rest = self.distinct_ops - len(self.ops)
        if rest > 0:
            lines.append(f"| ({rest} more) | | | | | {max(0.0, 1.0 - shown):.1%} | |")
        lines.extend(f"- {n}" for n in self.notes)
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------
# Capture
# --------------------------------------------------------------------------------------------------------


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "trace"


def _shorten(text: str, n: int) -> str:
    return text if len(text) <= n else "..." + text[-(n - 3) :]


def _eval_scoped(jaxpr: jex_core.Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    """Evaluate a jaxpr, binding each pallas_call inside a named scope (and inlining calls that hold one).

    Re-binding the same primitives with the same params gives the same program; only the HLO metadata
    gains the scope, which is what lets the trace attribute interpreted-kernel ops to the kernel.
    """
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    for v, c in zip(jaxpr.constvars, consts, strict=True):
        env[v] = c
    for v, a in zip(jaxpr.invars, args, strict=True):
        env[v] = a
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        sub = eqn.params.get("jaxpr") if name in ("pjit", "jit", "closed_call") else None
        if name == "pallas_call":
            with jax.named_scope(f"{PALLAS_SCOPE_PREFIX}{pallas_call_name(eqn)}]"):
                outs = eqn.primitive.bind(*invals, **eqn.params)
        elif isinstance(sub, jex_core.ClosedJaxpr) and next(iter_pallas_eqns(sub), None) is not None:
            with jax.named_scope(str(eqn.params.get("name", name))):
                outs = _eval_scoped(sub.jaxpr, sub.consts, invals)
        else:
            bind_params = eqn.primitive.get_bind_params(eqn.params)
            if isinstance(bind_params, tuple):  # JAX < 0.7 returned (subfuns, params)
                subfuns, bind_params = bind_params
                outs = eqn.primitive.bind(*subfuns, *invals, **bind_params)
            else:
                outs = eqn.primitive.bind(*invals, **bind_params)
        if not eqn.primitive.multiple_results:
            outs = [outs]
        for v, o in zip(eqn.outvars, outs, strict=True):
            if not isinstance(v, jex_core.DropVar):
                env[v] = o
    return [read(v) for v in jaxpr.outvars]


def _interpret_mode(eqns: Iterable[jex_core.JaxprEqn]) -> str | None:
    """'plain' for interpret=True, 'tpu' for pltpu.InterpretParams, None when kernels compile natively."""
    mode: str | None = None
    for eqn in eqns:
        interp = eqn.params.get("interpret")
        if interp is True:
            mode = mode or "plain"
        elif interp:
            mode = (
                "tpu" if "tpu" in type(interp).__module__ or "Interpret" in type(interp).__name__ else "plain"
            )
    return mode


def capture_trace(
    fn: Callable[..., Any],
    args: Sequence[Any],
    out_dir: str | Path,
    *,
    label: str,
    repeats: int = 3,
    scope_pallas_calls: bool = True,
) -> Path:
    """Profile `repeats` calls of `fn(*args)` and return the directory holding the xplane.

    The function is compiled and run once before tracing so compilation and first-call costs stay out of
    the trace. Each traced call is wrapped in a ``maxkernel.step`` annotation and blocked on, so step wall
    time is the real latency. `args` must be arrays (close over static arguments). With
    `scope_pallas_calls` the function is re-traced to a jaxpr and re-evaluated with each pallas_call in a
    named scope (see the module docstring); the HLO text and a metadata file are written next to the trace.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    args = tuple(args)
    root = Path(out_dir) / _slug(label)
    root.mkdir(parents=True, exist_ok=True)

    closed = jax.make_jaxpr(fn)(*args)
    pallas_eqns = list(iter_pallas_eqns(closed))
    interp = _interpret_mode(pallas_eqns)
    if scope_pallas_calls and pallas_eqns:

        def run_fn(*flat: Any) -> list[Any]:
            return _eval_scoped(closed.jaxpr, closed.consts, flat)

        run_args: tuple[Any, ...] = tuple(jax.tree_util.tree_leaves(args))
    else:
        run_fn, run_args = fn, args
    compiled = jax.jit(run_fn).lower(*run_args).compile()
    jax.block_until_ready(compiled(*run_args))  # warm-up, outside the trace

    before = {p.resolve() for p in root.rglob("*.xplane.pb")}
    with jax.profiler.trace(str(root), create_perfetto_trace=True):
        for i in range(repeats):
            with jax.profiler.TraceAnnotation(STEP_ANNOTATION, step=i, label=label):
                jax.block_until_ready(compiled(*run_args))
    new = [p for p in root.rglob("*.xplane.pb") if p.resolve() not in before]
    if not new:
        raise RuntimeError(f"jax.profiler.trace wrote no *.xplane.pb under {root}")
    run_dir = max(new, key=lambda p: p.stat().st_mtime).parent

    hlo_text = compiled.as_text() or ""
    m = _HLO_MODULE_RE.search(hlo_text)
    module = m.group(1) if m else "module"
    hlo_file = run_dir / f"{_slug(module)}.hlo.txt"
    hlo_file.write_text(hlo_text)
    leaves = jax.tree_util.tree_leaves(args)
    device = next(iter(leaves[0].devices())) if leaves and hasattr(leaves[0], "devices") else jax.devices()[0]
    meta = {
        "label": label,
        "repeats": repeats,
        "step_annotation": STEP_ANNOTATION,
        "platform": device.platform,
        "device_kind": device.device_kind,
        "hlo_modules": [module],
        "hlo_files": [hlo_file.name],
        "pallas_calls": [pallas_call_name(e) for e in pallas_eqns],
        "pallas_scoped": bool(scope_pallas_calls and pallas_eqns),
        "interpret": interp,
        "captured_at": time.time(),
    }
    (run_dir / META_FILE).write_text(json.dumps(meta, indent=1))
    return run_dir


# --------------------------------------------------------------------------------------------------------
# Parse
# --------------------------------------------------------------------------------------------------------


@dataclass
class _Ev:
    name: str
    start: float  # ns
    dur: float  # ns
    line: str
    module: str | None
    source_op: str | None
    kernel: bool
    child: float = 0.0
    depth_parent: _Ev | None = field(default=None, repr=False)

    @property
    def end(self) -> float:
        return self.start + self.dur


def _find_xplane(path: Path) -> Path:
    if path.is_file():
        return path
    found = sorted(path.rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no *.xplane.pb under {path}")
    return found[-1]


def _load_meta(run_dir: Path) -> dict[str, Any]:
    f = run_dir / META_FILE
    return json.loads(f.read_text()) if f.exists() else {}


def _hlo_op_names(run_dir: Path, meta: dict[str, Any]) -> dict[str, str]:
    """HLO instruction name -> JAX op_name metadata, from the HLO text capture_trace saved."""
    out: dict[str, str] = {}
    for fname in meta.get("hlo_files", []):
        f = run_dir / fname
        if not f.exists():
            continue
        for line in f.read_text().splitlines():
            m = _HLO_INSTR_RE.match(line)
            if m:
                out.setdefault(m.group(1), m.group(2))
    return out


def _nest(events: list[_Ev]) -> None:
    """Per line: charge each op's duration to its nearest enclosing op; inherit kernel attribution."""
    stack: list[_Ev] = []
    for ev in sorted(events, key=lambda e: (e.start, -e.dur)):
        while stack and stack[-1].end <= ev.start:
            stack.pop()
        if stack:
            parent = stack[-1]
            parent.child += ev.dur
            ev.kernel = ev.kernel or parent.kernel
            ev.depth_parent = parent
        stack.append(ev)


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def summarize_trace(path_or_dir: str | Path, *, label: str, top_n: int = 15) -> TraceSummary:
    """Parse an xplane into per-op self times, kernel vs rest, DMA/sync share and idle gaps.

    Self time (duration minus nested op events) is used throughout so that a ``while`` wrapping a kernel's
    body is not counted twice; shares therefore add up to 1 over all ops.
    """
    xplane = _find_xplane(Path(path_or_dir))
    run_dir = xplane.parent
    meta = _load_meta(run_dir)
    op_names = _hlo_op_names(run_dir, meta)
    main_modules = set(meta.get("hlo_modules", []))
    notes: list[str] = []

    data = jax.profiler.ProfileData.from_file(str(xplane))
    planes = list(data.planes)
    tpu_planes = [p for p in planes if p.name.startswith("/device:TPU")]
    gpu_planes = [p for p in planes if p.name.startswith("/device:GPU")]
    host = next((p for p in planes if p.name == "/host:CPU"), None)

    events: list[_Ev] = []
    steps: list[tuple[float, float]] = []
    if host is not None:
        for line in host.lines:
            for e in line.events:
                if e.name == STEP_ANNOTATION or e.name.startswith(STEP_ANNOTATION + "#"):
                    steps.append((e.start_ns, e.start_ns + e.duration_ns))

    device_planes = tpu_planes or gpu_planes
    if device_planes:
        platform = "tpu" if tpu_planes else "gpu"
        for plane in device_planes:
            lines = list(plane.lines)
            op_lines = [ln for ln in lines if ln.name == "XLA Ops"] or [
                ln
                for ln in lines
                if ln.name not in ("Steps", "XLA Modules", "Source code")
                and not ln.name.startswith("Framework")
            ]
            for line in op_lines:
                for e in line.events:
                    st = dict(e.stats)
                    text = " ".join(str(st.get(k, "")) for k in ("long_name", "hlo_category", "tf_op"))
                    source = st.get("tf_op") or op_names.get(e.name)
                    kernel = bool(
                        _TPU_KERNEL_RE.search(e.name)
                        or _TPU_KERNEL_RE.search(text)
                        or (source and PALLAS_SCOPE_PREFIX in str(source))
                    )
                    events.append(
                        _Ev(e.name, e.start_ns, e.duration_ns, f"{plane.name}/{line.name}",
                            st.get("hlo_module"), str(source) if source else None, kernel)
                    )  # fmt: skip
        kernel_detection = "device ops named custom-call / tpu_custom_call / Mosaic, or pallas_call scope"
    else:
        platform = "cpu"
        foreign = 0
        if host is None:
            raise ValueError(f"{xplane} has neither a device plane nor a /host:CPU plane")
        for line in host.lines:
            for e in line.events:
                st = dict(e.stats)
                hlo_op = st.get("hlo_op")
                if hlo_op is None:
                    continue
                module = st.get("hlo_module")
                if main_modules and module not in main_modules:
                    # Programs launched from host callbacks (TPU interpret mode runs its DMA / memory
                    # simulation that way) execute while a main-module io_callback op is running on
                    # another thread; counting them too would count that time twice.
                    foreign += 1
                    continue
                source = op_names.get(str(hlo_op))
                kernel = bool(source and PALLAS_SCOPE_PREFIX in source)
                events.append(_Ev(str(hlo_op), e.start_ns, e.duration_ns, line.name, module, source, kernel))
        if foreign:
            notes.append(
                f"{foreign} events from other XLA programs (run inside host callbacks) were left out: their "
                "time is already inside the calling io_callback op"
            )
        if meta.get("pallas_scoped"):
            kernel_detection = (
                "HLO op_name metadata under the pallas_call[...] scope (and ops nested in them)"
            )
        elif meta:
            kernel_detection = "no pallas_call in the traced function"
        else:
            kernel_detection = "unknown: trace not captured by capture_trace (no HLO metadata saved)"
            notes.append("kernel attribution unavailable without the HLO metadata capture_trace saves")

    by_line: dict[str, list[_Ev]] = {}
    for ev in events:
        by_line.setdefault(ev.line, []).append(ev)
    for evs in by_line.values():
        _nest(evs)

    def self_ns(ev: _Ev) -> float:
        return max(0.0, ev.dur - ev.child)

    busy = sum(self_ns(e) for e in events)
    table: dict[str, dict[str, Any]] = {}
    for ev in events:
        row = table.setdefault(
            ev.name, {"count": 0, "ns": 0.0, "kernel": False, "source": ev.source_op, "dma": False}
        )
        row["count"] += 1
        row["ns"] += self_ns(ev)
        row["kernel"] = row["kernel"] or ev.kernel
        row["dma"] = row["dma"] or (platform != "cpu" and bool(_DMA_SYNC_RE.search(ev.name)))
    ranked = sorted(table.items(), key=lambda kv: kv[1]["ns"], reverse=True)
    ops = [
        OpStat(
            name=name,
            source_op=row["source"],
            count=row["count"],
            measured_total_us=row["ns"] / 1e3,
            measured_mean_us=row["ns"] / 1e3 / row["count"],
            share=row["ns"] / busy if busy > 0 else 0.0,
            is_kernel=row["kernel"],
            is_dma_sync=row["dma"],
        )
        for name, row in ranked[: max(0, top_n)]
    ]
    kernel_ns = sum(self_ns(e) for e in events if e.kernel)
    dma_ns = sum(row["ns"] for _, row in ranked if row["dma"])
    dma_present = any(row["dma"] for _, row in ranked)
    if platform == "cpu":
        notes.append(
            "DMA/sync: not applicable on CPU (no DMA engines in an XLA:CPU trace); reported as absent"
        )

    # Idle gaps on the busiest line, between top-level ops, inside step windows when we have them.
    busiest, gap_total, gap_max = None, 0.0, 0.0
    if by_line:
        busiest = max(by_line, key=lambda k: sum(self_ns(e) for e in by_line[k]))
        top = _merge([(e.start, e.end) for e in by_line[busiest] if e.depth_parent is None])
        if not top:
            windows: list[tuple[float, float]] = []
        else:
            windows = steps or [(top[0][0], top[-1][1])]
        for ws, we in windows:
            inside = [(max(s, ws), min(e, we)) for s, e in top if e > ws and s < we]
            for (_, e0), (s1, _) in zip(inside, inside[1:], strict=False):
                gap = max(0.0, s1 - e0)
                gap_total += gap
                gap_max = max(gap_max, gap)

    if steps:
        step_us = [(e - s) / 1e3 for s, e in sorted(steps)]
        wall_us = sum(step_us)
    else:
        step_us = []
        wall_us = (max(e.end for e in events) - min(e.start for e in events)) / 1e3 if events else 0.0
        notes.append("no maxkernel.step annotations: wall time is the span of op events")
    if not events:
        notes.append("no op events found in the trace")

    interp = meta.get("interpret")
    if platform == "tpu":
        kind = meta.get("device_kind") or next(
            (str(v) for p in tpu_planes for k, v in p.stats if k in ("device_kind", "device_type")), "TPU"
        )
        device_label = f"tpu ({kind})"
    elif platform == "gpu":
        device_label = "gpu"
    elif interp == "tpu":
        device_label = "cpu (Pallas TPU interpret)"
    elif interp or meta.get("pallas_calls"):
        device_label = "cpu (Pallas interpret)"
    elif meta:
        device_label = "cpu (XLA reference)"
    else:
        device_label = "cpu"
    if interp == "tpu":
        notes.append(
            "TPU interpret mode: simulated memory, DMA and semaphore work runs in io_callback ops (Python "
            "on the host), counted as kernel time; it says nothing about TPU DMA cost"
        )

    return TraceSummary(
        label=label,
        platform=platform,
        device_label=device_label,
        on_tpu=platform == "tpu",
        trace_path=str(xplane),
        perfetto_trace_path=next((str(p) for p in sorted(run_dir.glob("*perfetto*.json.gz"))), None),
        steps=len(steps),
        measured_wall_us=wall_us,
        measured_step_us=step_us,
        measured_busy_us=busy / 1e3,
        distinct_ops=len(table),
        ops=ops,
        kernel_detection=kernel_detection,
        measured_kernel_us=kernel_ns / 1e3,
        measured_non_kernel_us=(busy - kernel_ns) / 1e3,
        kernel_share=kernel_ns / busy if busy > 0 else 0.0,
        dma_sync_present=dma_present,
        measured_dma_sync_us=dma_ns / 1e3,
        measured_compute_us=(busy - dma_ns) / 1e3,
        dma_sync_share=dma_ns / busy if busy > 0 else 0.0,
        busiest_line=busiest,
        measured_idle_gap_total_us=gap_total / 1e3,
        measured_idle_gap_max_us=gap_max / 1e3,
        notes=notes,
    )
