"""The untrusted side of an evaluation: the only process that ever imports a candidate.

`candidate_job` runs inside the sandbox (`maxkernel.tools.worker`), as `nobody`, with no key worth
stealing and nothing to decide. It produces data and nothing else, in this order:

1. load the candidate module;
2. trace it ONCE per distinct shape (validation configs, the larger check's, the task's own; a shape
   shared by two of them is traced once) — the only time the candidate's Python runs;
3. derive every artifact from those jaxprs with `program_artifacts`: the program trees (plain JSON) the
   agent checks; the TPU-interpret-mode programs this process runs (compiled on background threads);
   per validation shape and the larger check a *checked program* (one `jax.export` module: Pallas's plain
   interpreter on "cpu", the Mosaic kernels on "tpu", everything else shared), which the judge runs on its
   secret inputs itself; at the task's own shapes the TPU program that ships; the block-model estimate;
4. only then announce `await_inputs` and block on stdin. The judge's inputs (drawn from a secret seed in
   another process) arrive after the programs above are fixed and have been read by the agent; the
   validation sets are run through the TPU-interpret-mode executables and written to `outputs.npz`, a
   cross-check of the judge's own run (uninitialised memory NaN, out-of-bounds reads raise).

It never sees the reference outputs, the comparison, the Pallas check or a signing key that matters: the
agent treats every byte written here as untrusted (`readback`), and the verdict on correctness rests on
the judge's run of the checked program, not on these outputs. A candidate that rewrites JAX inside this
process can still hand over a checked program whose CPU side is not its TPU side — see the README's
harness section for what the judge compares and what that does not buy.

This module is a clean, separate entry so that a pre-forked worker can call `candidate_job` directly.
"""

from __future__ import annotations

import io
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from maxkernel.tools import taskcode
from maxkernel.tools.evaluation import bind_static
from maxkernel.tools.readback import pack_arrays
from maxkernel.tools.results import ArraySpec, InputConfig, first_lines, np_dtype
from maxkernel.tools.worker import WorkerContext

PROGRAMS_FILE = "programs.json"
OUTPUTS_FILE = "outputs.npz"
STAGE_AWAIT_INPUTS = "await_inputs"
MAX_INPUT_BYTES = 4 << 30

ONE_CODEGEN_PART = {"xla_cpu_parallel_codegen_split_count": 1}
"""XLA CPU splits a program's LLVM module into parts compiled on a thread pool; the two interpret-mode
programs already compile side by side (`COMPILE_THREADS`) next to the judge on a 2-core machine, so the
split only adds work: both programs compiled together in 1.04 s against 1.36 s (bundled kernel) and 1.39
against 1.86 (causal flash attention), medians of 4 interleaved A/B rounds in one process under load;
outputs bitwise equal."""

INTERPRET_COMPILE_OPTIONS: dict[str, dict[str, Any]] = {
    "fast-compile": {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 0,
                     **ONE_CODEGEN_PART},
    "no-fusion-emitters": {"xla_cpu_use_fusion_emitters": False, **ONE_CODEGEN_PART},
    "optimised": {},
}  # fmt: skip
"""XLA CPU options for compiling the interpret-mode program, by name (the name is what a result reports).

The interpret-mode program is a loop over grid steps around host callbacks: XLA's default CPU pipeline
spends ~2 s on it however small the shapes (the largest single cost of an evaluation on the bundled task),
while its runs at validation shapes take a tenth of that. "fast-compile" (no fusion emitters, backend -O0)
compiles it ~3x faster with bitwise-identical outputs (measured on the bundled kernel); its runs are ~20%
slower, which only pays back on large input sets: see `pick_interpret_compile`."""
FAST_COMPILE_MAX_BYTES = 32 << 20
"""Input and output bytes of all the sets run through one executable, up to which "fast-compile" wins:
~1.8 s of compile saved against ~20% more run time, at ~0.3 s of interpret-mode run per MB (bundled kernel,
2-core machine; measured at 256x512x384 and 1024x2048x1536, both f32)."""


INTERPRET_MODES: dict[str, str] = {
    "tpu": "TPU interpret mode, in the candidate's process (a cross-check): simulated TPU memory, "
    "uninitialised memory NaN, out-of-bounds reads raise",
    "plain": "Pallas's plain interpreter, run by the judge on the checked program (the evidence): the kernel "
    "inlined into one XLA loop, uninitialised outputs and scratch NaN",
}
"""How a program is interpreted on the CPU, by name (the name is what a result reports)."""
JUDGE_COMPILE = "no-fusion-emitters"
"""How the judge compiles the checked program's CPU side (an `INTERPRET_COMPILE_OPTIONS` name). Backend -O0
is no good for the plain interpreter: without its copy elision the loop copies whole buffers per grid step
(9.3 s against 3.2 s on causal flash attention at the larger check shape)."""


def pick_interpret_compile(cfg: InputConfig, n_sets: int) -> str:
    """The `INTERPRET_COMPILE_OPTIONS` entry for a configuration run on `n_sets` input sets. Chosen by the
    agent from shapes alone (never by the candidate) and reported with the correctness result."""
    data = (cfg.input_bytes() + cfg.output_bytes()) * max(1, n_sets)
    return "fast-compile" if data <= FAST_COMPILE_MAX_BYTES else "optimised"


def tpu_program_file(index: int) -> str:
    return f"tpu_program_{index}.bin"


def input_name(config: int, input_set: int, arg: int) -> str:
    return f"c{config}s{input_set}i{arg}"


def output_name(config: int, input_set: int, leaf: int) -> str:
    return f"c{config}s{input_set}o{leaf}"


STEPWISE_SUFFIX = "r"


def stepwise_name(config: int, input_set: int, leaf: int) -> str:
    """The judge's second reference output for a low-precision float leaf: the reference compiled to round
    after every op, as its program says (see `judge._precise_outputs`)."""
    return output_name(config, input_set, leaf) + STEPWISE_SUFFIX


def _specs(cfg: InputConfig, sharding: Any = None) -> list[Any]:
    import jax

    return [jax.ShapeDtypeStruct(a.shape, np_dtype(a.dtype), sharding=sharding) for a in cfg.dynamic]


def _out_specs(closed: Any) -> list[dict[str, Any]]:
    return [{"shape": [int(d) for d in x.shape], "dtype": str(np.dtype(x.dtype))} for x in closed.out_avals]


def checked_program_file(index: int) -> str:
    """The checked program (CPU interpreter + TPU kernels, one module) of validation config `index`; the
    larger check's is the one after the last validation config."""
    return f"checked_program_{index}.bin"


def _shape_key(cfg: InputConfig) -> str:
    return json.dumps([[list(a.shape), a.dtype] for a in cfg.dynamic] + [repr(cfg.static)])


def candidate_job(payload: dict[str, Any], ctx: WorkerContext) -> dict[str, Any]:
    """Load, trace once per shape, derive every artifact, then run the judge's inputs (a cross-check).
    Returns a small status dict; the data is in files."""
    import jax
    from jax.experimental.pallas import tpu as pltpu

    from maxkernel.tools import program_artifacts as artifacts
    from maxkernel.tools.program_tree import to_tree

    ctx.guard()
    run_dir = Path(ctx.run_dir)
    val = [InputConfig.model_validate(c) for c in payload["validation_configs"]]
    own = [InputConfig.model_validate(c) for c in payload["configs"]]
    larger = InputConfig.model_validate(payload["larger_config"]) if payload.get("larger_config") else None
    modes = list(payload.get("interpret_compile") or [])
    compile_options = [INTERPRET_COMPILE_OPTIONS.get(m, {}) for m in modes]
    compile_options += [{}] * (len(val) - len(compile_options))
    device_kind, cores = payload.get("lowering_device") or ("TPU v5 lite", 1)
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()

    ctx.stage("load")
    try:
        module = _load_candidate(run_dir / Path(payload["candidate_path"]).name)
    except SyntaxError as exc:
        return {"ok": False, "stage": "load", "message": f"syntax error line {exc.lineno}: {exc.msg}"}
    except Exception as exc:  # noqa: BLE001 - whatever the candidate raises is its failure
        return {"ok": False, "stage": "load", "message": f"{type(exc).__name__}: {first_lines(str(exc))}"}
    candidate = taskcode.candidate_entry(module)
    if candidate is None:
        names = " or ".join(f"`{n}`" for n in taskcode.CANDIDATE_ENTRY_POINTS)
        return {"ok": False, "stage": "load", "message": f"the candidate module has no function {names}"}
    seconds["load"] = time.perf_counter() - t0

    # One trace per distinct shape: the candidate's Python runs here and nowhere else. Every artifact below
    # is derived from these jaxprs by `program_artifacts`, so none of them can be told apart by the
    # candidate (call stack, call count, interpret mode) when it runs.
    ctx.stage("trace")
    t0 = time.perf_counter()
    traces: dict[str, Any] = {}

    def trace(cfg: InputConfig) -> Any:
        key = _shape_key(cfg)
        if key not in traces:
            traces[key] = artifacts.trace_once(
                bind_static(candidate, cfg.static), _specs(cfg), device_kind, cores
            )
        return traces[key]

    interpret = pltpu.InterpretParams(uninitialized_memory="nan", out_of_bounds_reads="raise")
    programs: dict[str, Any] = {"validation": [], "production": [], "estimates": None, "larger": None}
    executables = []
    larger_trace_error: str | None = None
    try:
        val_jaxprs = [trace(cfg) for cfg in val]
        prod_jaxprs = [trace(cfg) for cfg in own]
        for cfg, closed in zip(val, val_jaxprs, strict=True):
            lowered = jax.jit(artifacts.as_function(artifacts.with_interpret(closed, interpret)))
            executables.append(lowered.trace(*_specs(cfg)).lower())
            programs["validation"].append({"tree": to_tree(closed), "out": _out_specs(closed)})
        for closed in prod_jaxprs:
            programs["production"].append({"tree": to_tree(closed), "out": _out_specs(closed)})
    except Exception as exc:  # noqa: BLE001
        _reset_interpret()
        return {"ok": False, "stage": "trace", "message": f"{type(exc).__name__}: {first_lines(str(exc))}"}
    executables = [
        _BackgroundCompile(lw, opts) for lw, opts in zip(executables, compile_options, strict=False)
    ]
    larger_jaxpr = None
    if larger is not None:
        try:
            larger_jaxpr = trace(larger)
            programs["larger"] = {"tree": to_tree(larger_jaxpr), "out": _out_specs(larger_jaxpr)}
        except Exception as exc:  # noqa: BLE001
            # Not a failure yet: the larger shape is grown axis by axis, and a reference whose sizes are
            # coupled (tokens = (image / patch)^2) may not run there either; the judge skips the check
            # then. Where the reference does run, this is the candidate's failure (the agent decides).
            larger_trace_error = f"tracing: {type(exc).__name__}: {first_lines(str(exc))}"
    programs["larger_trace_error"] = larger_trace_error
    seconds["trace"] = time.perf_counter() - t0

    # The checked programs (what the judge runs, validation shapes and the larger check) and the programs
    # that ship (the task's own shapes), all from the traces above. A lowering error here (block shapes,
    # primitives with no TPU lowering) is the kernel's compile failure.
    t0 = time.perf_counter()

    def write_export(export: Any, closed: Any, cfg: InputConfig, name: str) -> str | None:
        try:
            (run_dir / name).write_bytes(export(closed, _specs(cfg), device_kind, cores))
            return None
        except Exception as exc:  # noqa: BLE001
            return f"{type(exc).__name__}: {first_lines(str(exc), 40)}"

    checked_errors: list[str | None] = [
        write_export(artifacts.export_checked, closed, cfg, checked_program_file(ci))
        for ci, (cfg, closed) in enumerate(zip(val, val_jaxprs, strict=True))
    ]
    if larger is None or larger_jaxpr is None:
        checked_errors.append("no larger check" if larger is None else "it did not trace there")
    else:
        checked_errors.append(
            write_export(artifacts.export_checked, larger_jaxpr, larger, checked_program_file(len(val)))
        )
    export_errors = [
        write_export(artifacts.export_tpu, closed, cfg, tpu_program_file(ci))
        for ci, (cfg, closed) in enumerate(zip(own, prod_jaxprs, strict=True))
    ]
    programs["export_errors"] = export_errors
    programs["checked_errors"] = checked_errors
    seconds["export"] = time.perf_counter() - t0

    gens = [str(g) for g in payload.get("estimate_generations") or []]
    if gens:  # one estimate per requested generation (the block model is cheap); the first is the headline
        programs["estimates"] = _estimate_candidate(prod_jaxprs[0], own[0], gens)
    programs["seconds"] = seconds
    (run_dir / PROGRAMS_FILE).write_text(json.dumps(programs))

    # Nothing above could depend on the inputs: they do not exist yet.
    ctx.stage(STAGE_AWAIT_INPUTS)
    data = sys.stdin.buffer.read(MAX_INPUT_BYTES)
    ctx.stage("correctness")
    t0 = time.perf_counter()
    outputs: dict[str, np.ndarray] = {}
    run_error = None
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        arrays = {name: z[name] for name in z.files}
    for ci, cfg in enumerate(val):
        n_sets = int(payload["input_sets"][ci])
        for si in range(n_sets):
            inputs = [_typed(arrays[input_name(ci, si, k)], a) for k, a in enumerate(cfg.dynamic)]
            try:
                out = executables[ci].result()(*[jax.numpy.asarray(a) for a in inputs])
                leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(out)]
            except Exception as exc:  # noqa: BLE001
                _reset_interpret()
                run_error = {
                    "config": ci,
                    "input_set": si,
                    "message": f"running input set {si}: {type(exc).__name__}: {first_lines(str(exc))}",
                }
                break
            for k, leaf in enumerate(leaves):
                outputs[output_name(ci, si, k)] = leaf
        if run_error:
            break
    (run_dir / OUTPUTS_FILE).write_bytes(pack_arrays(outputs))
    seconds["correctness"] = time.perf_counter() - t0
    compiled = [c.seconds for c in executables if c.seconds is not None]
    seconds["interpret_compile"] = sum(compiled)  # overlapping the stages above: not part of their sum
    return {"ok": True, "run_error": run_error, "seconds": seconds}


COMPILE_THREADS = 2
"""Interpret-mode programs compiled at once, in the background (XLA compiles without the GIL)."""
_COMPILE_SLOTS = threading.BoundedSemaphore(COMPILE_THREADS)


class _BackgroundCompile:
    """The XLA compile of a lowered interpret-mode program, started at once on a daemon thread.

    Lowering stays on the main thread, before `await_inputs` (a program that does not lower is a trace
    failure, reported as such). The compile of the already-fixed program overlaps the rest of the tracing,
    the TPU export, the agent's checks and the judge's reference, and is joined when the inputs are run: a
    compile error then surfaces as a failed run of that input set. Moving it after the announcement
    changes nothing the agent relies on: the program trees it checks are fixed before, and the outputs
    come from this (untrusted) process whatever it compiled. A daemon thread, so that a candidate that
    fails early does not wait for a compile nobody needs."""

    def __init__(self, lowered: Any, options: dict[str, Any]) -> None:
        self.seconds: float | None = None
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(lowered, options), daemon=True)
        self._thread.start()

    def _run(self, lowered: Any, options: dict[str, Any]) -> None:
        with _COMPILE_SLOTS:
            t0 = time.perf_counter()
            try:
                self._value = lowered.compile(compiler_options=options) if options else lowered.compile()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the thread that runs the program
                self._error = exc
            self.seconds = time.perf_counter() - t0

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


def _load_candidate(path: Path) -> Any:
    """Import the candidate from its file through a relative path (the working directory is the run dir;
    after a drop to nobody its ancestors may not be searchable, so importlib's absolute paths would fail)."""
    import types

    source = path.read_bytes()
    module = types.ModuleType("maxkernel_candidate")
    module.__file__ = str(path)
    sys.modules["maxkernel_candidate"] = module
    exec(compile(source, str(path), "exec"), module.__dict__)  # noqa: S102 - this process exists for it
    return module


def _typed(a: np.ndarray, spec: ArraySpec) -> np.ndarray:
    return a.view(np_dtype(spec.dtype)) if spec.dtype == "bfloat16" else a


def _reset_interpret() -> None:
    try:
        from jax.experimental.pallas import tpu as pltpu

        pltpu.reset_tpu_interpret_mode_state()
    except Exception:  # noqa: BLE001 - best effort clean-up after a failed interpreted run
        pass


def _estimate_candidate(closed: Any, cfg: InputConfig, gens: list[str]) -> dict[str, dict[str, Any]]:
    """The block model's estimate of the candidate's pallas_calls at the production shapes, per TPU
    generation, from the production trace already made (`closed`, its jaxpr). Computed here because it
    needs the live jaxpr; reported as coming from the candidate's process."""
    from maxkernel.tools.estimate import estimate_pallas

    out: dict[str, dict[str, Any]] = {}
    for gen in gens:
        try:
            est = estimate_pallas(closed, gen, cfg.index_values)
            if est.unpriced:
                out[gen] = {"error": f"estimate withheld: {est.unpriced}"}
                continue
            out[gen] = {
                "estimated_seconds": est.estimated_seconds,
                # what the judge checks against the shipped program's floor (mosaic_audit.contradiction)
                "est_pallas_seconds": est.est_pallas_seconds,
                "est_pallas_hbm_bytes": sum(c.est_hbm_bytes * c.multiplicity for c in est.pallas_calls),
                "est_mxu_flops": est.est_mxu_flops,
                "est_grid_steps": est.est_grid_steps,
                "bound": est.bound,
                "method": est.method,
                "detail_markdown": est.to_markdown(),
            }
        except Exception as exc:  # noqa: BLE001 - an estimate failing must not fail an accepted kernel
            out[gen] = {"error": f"block model failed: {type(exc).__name__}: {exc}"}
    return out
