"""Sandbox entry: trace the task's reference and analyse it into a `ProgramSpec`. Runs only in the child.

`maxkernel.authors.offline.analysis_job:analyse_job` is called through `maxkernel.tools.sandbox.run_sandboxed`,
like the harness's own jobs: the reference is task code and never runs in the agent's process. Tracing
uses abstract inputs (`jax.ShapeDtypeStruct`), so nothing is allocated; the whole job takes a few seconds.
"""

from __future__ import annotations

import inspect
import keyword
import re
from typing import Any

from maxkernel.tools import taskcode
from maxkernel.tools.worker import WorkerContext

RESERVED = {
    "jax",
    "jnp",
    "lax",
    "pl",
    "pltpu",
    "functools",
    "math",
    "out",
    "outs",
    "cost",
    "out_shape",
    "computation",
}


def arg_names(fn: Any, n: int) -> list[str]:
    """The reference's parameter names (so the kernel's signature reads the same), made safe to use."""
    names: list[str] = []
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    for p in params:
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
    names = names[:n]
    while len(names) < n:
        names.append(f"arg{len(names)}")
    safe = []
    for i, nm in enumerate(names):
        bad = (
            nm in RESERVED
            or keyword.iskeyword(nm)
            or nm.startswith("_")
            or re.fullmatch(r"[tc]\d+|n_\w+|b(m|n|k\d*|q|kv|rows|cols)|\w+_(ref|index|blk)|[a-z]+\d+", nm)
            is not None
        )
        safe.append(f"arg{i}_{nm}" if bad else nm)
    return safe


def analyse_job(payload: dict[str, Any], ctx: WorkerContext) -> dict[str, Any]:
    from maxkernel.authors.offline.lower import lower_program
    from maxkernel.authors.offline.partition import Options
    from maxkernel.authors.offline.trace import Config, Unsupported, trace_reference

    ctx.guard()
    ctx.stage("load")
    try:
        ref = taskcode.Reference(payload["source"])
    except taskcode.TaskCodeError as exc:
        return {"ok": False, "task_error": str(exc)}
    configs: list[Config] = []
    seen = set()
    for c in [*payload["configs"], *payload.get("validation_configs", [])]:
        knobs = c.get("knobs") or {}
        try:
            computation = taskcode.reference_for(ref.source, knobs).computation if knobs else None
        except taskcode.TaskCodeError as exc:
            return {"ok": False, "task_error": str(exc)}
        cfg = Config(
            dynamic=[(tuple(a["shape"]), a["dtype"]) for a in c["dynamic"]],
            static=list(c.get("static", [])),
            computation=computation,
        )
        key = repr((cfg.dynamic, cfg.static, sorted(knobs.items())))
        if key not in seen:
            seen.add(key)
            configs.append(cfg)
    n_args = len(configs[0].dynamic) + len(configs[0].static)
    names = arg_names(ref.computation, n_args)
    ctx.stage("trace")
    options = Options(**payload.get("options", {}))
    traces = None
    try:
        try:  # convolutions as direct kernels first; im2col patches + a matmul when that does not fit
            traces = trace_reference(ref.computation, configs, names, direct_conv=True)
            ctx.stage("analyse")
            program = lower_program(traces, payload.get("task_id", ""), options)
        except Unsupported:
            if traces is None or "conv_general_dilated" not in {
                e.primitive.name for e in traces.primary.jaxpr.eqns
            }:
                raise
            traces = trace_reference(ref.computation, configs, names, direct_conv=False)
            program = lower_program(traces, payload.get("task_id", ""), options)
    except Unsupported as exc:
        return {"ok": False, "unsupported": str(exc)}
    except Exception as exc:  # noqa: BLE001 - a bug here must read as "no kernel", with the reason
        import traceback

        return {
            "ok": False,
            "unsupported": f"the offline author failed on this reference ({type(exc).__name__}: {exc})",
            "internal_error": traceback.format_exc(limit=6),
        }
    return {"ok": True, "program": program.model_dump(mode="json")}
