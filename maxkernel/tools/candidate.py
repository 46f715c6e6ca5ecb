"""The untrusted side of an evaluation: the only process that ever imports a candidate.

`candidate_job` runs inside the sandbox (`maxkernel.tools.worker`), as `nobody`, with no key worth
stealing and nothing to decide. It produces data and nothing else, in this order:

1. load the candidate module;
2. trace it at every validation shape twice — once in TPU interpret mode (the program that is run for
   correctness, lowered here and compiled on a background thread with the agent's choice of
   `INTERPRET_COMPILE_OPTIONS`) and once plainly (the program a TPU would get) — and at the task's
   production shapes; each trace goes out as a `program_tree` (plain JSON). The larger-shape check's
   program is interpreted plainly when it lowers so (`LARGER_PLAIN`), else in TPU interpret mode;
3. lower it for the TPU at the production shapes with `jax.export` and write the serialized artifact,
   which the judge deserializes, inspects and compiles itself;
4. only then announce `await_inputs` and block on stdin. The judge's inputs (drawn from a secret seed in
   another process) arrive after the programs above are fixed and have been read by the agent; they are
   run through the executables compiled from the programs lowered in step 2 (joined first), and the
   outputs are written to `outputs.npz`.

It never sees the reference outputs, the comparison, the Pallas check or a signing key that matters: the
agent treats every byte written here as untrusted (`readback`). A candidate that rewrites JAX inside this
process can still hand over programs and outputs that do not belong together — see the README's harness
section for what that does and does not buy it.

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
from maxkernel.tools.results import ArraySpec, InputConfig, np_dtype
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
    "tpu": "TPU interpret mode: simulated TPU memory, uninitialised memory NaN, out-of-bounds reads raise",
    "plain": "Pallas's plain interpreter: the kernel inlined into one XLA loop, no memory simulation",
}
"""How a program is interpreted on the CPU, by name (the name is what a result reports)."""
LARGER_PLAIN = ("plain", "no-fusion-emitters")
"""The larger-shape check's first choice: plain interpretation, compiled without fusion emitters.

Its purpose is values that go wrong with shape (issue 10: a Python float picked from a shape); the hazards
only TPU interpret mode finds (reads of uninitialised or out-of-bounds memory) are checked on every
validation set. Plain interpretation runs the kernel body as ordinary XLA ops instead of a host callback
per memory access: on one input set at the larger shape, lowering + compile + run took 2.1 s against
10.4 s for the bundled kernel, 3.2 against 8.0 for causal flash attention and 3.8 against 6.9 for a conv
(A/B in one process, interleaved, 2 cores under a load of ~12; outputs bitwise equal, and so on the
suite's layernorm, softmax, sliding-window and GQA kernels). Backend -O0 ("fast-compile") is no good here:
without its copy elision the loop copies whole buffers per grid step (9.3 s on flash attention). The
plain interpreter lowers manual DMAs and semaphores too; a program it cannot lower (or that refuses it)
falls back to TPU interpret mode (`larger_modes`), and so does one that XLA:CPU fails to run once lowered."""


def larger_modes(cfg: InputConfig) -> list[tuple[str, str]]:
    """(interpret mode, compile option) for the larger-shape check, in order of preference: the candidate
    uses the first its program lowers in and reports which; the agent's choice, from shapes alone."""
    return [LARGER_PLAIN, ("tpu", pick_interpret_compile(cfg, 1))]


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


def _first_lines(text: str, n: int = 12) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return "\n".join(lines[:n]) + ("\n..." if len(lines) > n else "")


def _specs(cfg: InputConfig, sharding: Any = None) -> list[Any]:
    import jax

    return [jax.ShapeDtypeStruct(a.shape, np_dtype(a.dtype), sharding=sharding) for a in cfg.dynamic]


def _out_specs(traced: Any) -> list[dict[str, Any]]:
    import jax

    leaves = jax.tree_util.tree_leaves(traced.out_info)
    return [{"shape": [int(d) for d in x.shape], "dtype": str(np.dtype(x.dtype))} for x in leaves]


def candidate_job(payload: dict[str, Any], ctx: WorkerContext) -> dict[str, Any]:
    """Load, trace, export, then run the judge's inputs. Returns a small status dict; the data is in files."""
    import jax
    from jax import export
    from jax.experimental.pallas import tpu as pltpu

    from maxkernel.tools.program_tree import to_tree

    ctx.guard()
    run_dir = Path(ctx.run_dir)
    val = [InputConfig.model_validate(c) for c in payload["validation_configs"]]
    own = [InputConfig.model_validate(c) for c in payload["configs"]]
    larger = InputConfig.model_validate(payload["larger_config"]) if payload.get("larger_config") else None
    # One compile mode per validation config (the agent's choice; default: XLA's), then the larger check's
    # (interpret mode, compile mode) pairs in the agent's order of preference.
    modes = list(payload.get("interpret_compile") or [])
    compile_options = [INTERPRET_COMPILE_OPTIONS.get(m, {}) for m in modes]
    compile_options += [{}] * (len(val) - len(compile_options))
    larger_choices = [(str(m), str(c)) for m, c in payload.get("larger_modes") or [("tpu", "optimised")]]
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()

    ctx.stage("load")
    try:
        module = _load_candidate(run_dir / Path(payload["candidate_path"]).name)
    except SyntaxError as exc:
        return {"ok": False, "stage": "load", "message": f"syntax error line {exc.lineno}: {exc.msg}"}
    except Exception as exc:  # noqa: BLE001 - whatever the candidate raises is its failure
        return {"ok": False, "stage": "load", "message": f"{type(exc).__name__}: {_first_lines(str(exc))}"}
    candidate = taskcode.candidate_entry(module)
    if candidate is None:
        names = " or ".join(f"`{n}`" for n in taskcode.CANDIDATE_ENTRY_POINTS)
        return {"ok": False, "stage": "load", "message": f"the candidate module has no function {names}"}
    seconds["load"] = time.perf_counter() - t0

    ctx.stage("trace")
    t0 = time.perf_counter()
    interpret = pltpu.InterpretParams(uninitialized_memory="nan", out_of_bounds_reads="raise")
    programs: dict[str, Any] = {"validation": [], "production": [], "estimates": None, "larger": None}
    executables = []
    larger_exe = None
    larger_trace_error: str | None = None
    larger_choice, larger_params = None, None
    larger_fallback: str | None = None  # why the larger set ran in a later mode than the one it lowered in
    try:
        for ci, cfg in enumerate(val):
            # Two separate traces of the same shapes: interpret mode (what runs here) and plain (what a TPU
            # gets). Fresh jit wrappers each time, so neither trace is served from the other's cache.
            with pltpu.force_tpu_interpret_mode(interpret):
                traced = jax.jit(bind_static(candidate, cfg.static)).trace(*_specs(cfg))
                executables.append(_BackgroundCompile(traced.lower(), compile_options[ci]))
            plain = jax.jit(bind_static(candidate, cfg.static)).trace(*_specs(cfg))
            programs["validation"].append(
                {"interpret": to_tree(traced.jaxpr), "plain": to_tree(plain.jaxpr), "out": _out_specs(traced)}
            )
        production_jaxprs = []
        for cfg in own:
            plain = jax.jit(bind_static(candidate, cfg.static)).trace(*_specs(cfg))
            programs["production"].append({"plain": to_tree(plain.jaxpr), "out": _out_specs(plain)})
            production_jaxprs.append(plain.jaxpr)
    except Exception as exc:  # noqa: BLE001
        _reset_interpret()
        return {"ok": False, "stage": "trace", "message": f"{type(exc).__name__}: {_first_lines(str(exc))}"}
    if larger is not None:  # the larger-shape check: traced and compiled now, run on the judge's one set
        try:
            traced, larger_exe, larger_choice, larger_params = _lower_larger(
                candidate, larger, larger_choices, 0, interpret
            )
            plain = jax.jit(bind_static(candidate, larger.static)).trace(*_specs(larger))
            programs["larger"] = {
                "interpret": to_tree(traced.jaxpr), "plain": to_tree(plain.jaxpr), "out": _out_specs(traced)
            }  # fmt: skip
        except Exception as exc:  # noqa: BLE001
            # Not a failure yet: the larger shape is grown axis by axis, and a reference whose sizes are
            # coupled (tokens = (image / patch)^2) may not run there either; the judge skips the check
            # then. Where the reference does run, this is the candidate's failure (see below).
            _reset_interpret()
            larger_exe, larger_choice = None, None  # nothing of a half-traced larger program runs
            larger_trace_error = f"tracing: {type(exc).__name__}: {_first_lines(str(exc))}"
    seconds["trace"] = time.perf_counter() - t0

    # The program for the TPU, at the task's own shapes, as an artifact the judge compiles itself. A Pallas
    # lowering error here (block shapes, primitives with no TPU lowering) is a compile failure.
    t0 = time.perf_counter()
    export_errors: list[str | None] = []
    for ci, cfg in enumerate(own):
        try:
            exported = export.export(jax.jit(bind_static(candidate, cfg.static)), platforms=("tpu",))(
                *_specs(cfg)
            )
            (run_dir / tpu_program_file(ci)).write_bytes(exported.serialize())
            export_errors.append(None)
        except Exception as exc:  # noqa: BLE001
            export_errors.append(f"{type(exc).__name__}: {exc}")
    programs["export_errors"] = export_errors
    seconds["export"] = time.perf_counter() - t0

    gens = [str(g) for g in payload.get("estimate_generations") or []]
    if gens:  # one estimate per requested generation (the block model is cheap); the first is the headline
        programs["estimates"] = _estimate_candidate(production_jaxprs[0], own[0], gens)
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
                with pltpu.force_tpu_interpret_mode(interpret):
                    out = executables[ci].result()(*[jax.numpy.asarray(a) for a in inputs])
                    leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(out)]
            except Exception as exc:  # noqa: BLE001
                _reset_interpret()
                run_error = {
                    "config": ci,
                    "input_set": si,
                    "message": f"running input set {si}: {type(exc).__name__}: {_first_lines(str(exc))}",
                }
                break
            for k, leaf in enumerate(leaves):
                outputs[output_name(ci, si, k)] = leaf
        if run_error:
            break
    # The judge drew a set at the larger shape only when the reference ran there within its memory budget.
    drawn = input_name(len(val), 0, 0) in arrays
    larger_error = larger_trace_error if drawn and run_error is None else None
    if larger_exe is not None and larger is not None and run_error is None and drawn:
        inputs = [_typed(arrays[input_name(len(val), 0, k)], a) for k, a in enumerate(larger.dynamic)]
        while True:
            try:
                with pltpu.force_tpu_interpret_mode(larger_params):
                    out = larger_exe.result()(*[jax.numpy.asarray(a) for a in inputs])
                    for k, leaf in enumerate(jax.tree_util.tree_leaves(out)):
                        outputs[output_name(len(val), 0, k)] = np.asarray(leaf)
                break
            except Exception as exc:  # noqa: BLE001
                _reset_interpret()
                larger_error = f"{type(exc).__name__}: {_first_lines(str(exc))}"
                if larger_choice is None or larger_choice + 1 >= len(larger_choices):
                    break
            # The mode failed to run a program it lowered: XLA:CPU can lack a kernel for what it made of
            # the plain interpreter's program (a transpose folded into a bf16 x bf16 -> f32 dot:
            # "Unsupported element type for DotThunk::Execute"), which says nothing of the kernel. The next
            # mode runs the same function at the same shapes; its outputs come from this process either way.
            failed = f"{larger_choices[larger_choice][0]} interpreter failed to run it ({larger_error[:300]})"
            try:
                _t, larger_exe, larger_choice, larger_params = _lower_larger(
                    candidate, larger, larger_choices, larger_choice + 1, interpret
                )
            except Exception as exc:  # noqa: BLE001
                _reset_interpret()
                larger_error = f"{failed}; then {type(exc).__name__}: {_first_lines(str(exc))}"
                break
            larger_fallback = failed
            larger_error = None
    (run_dir / OUTPUTS_FILE).write_bytes(pack_arrays(outputs))
    seconds["correctness"] = time.perf_counter() - t0
    compiled = [c.seconds for c in [*executables, larger_exe] if c is not None and c.seconds is not None]
    seconds["interpret_compile"] = sum(compiled)  # overlapping the stages above: not part of their sum
    return {"ok": True, "run_error": run_error, "larger_error": larger_error, "seconds": seconds,
            "larger_mode": larger_choice, "larger_fallback": larger_fallback}  # fmt: skip


COMPILE_THREADS = 2
"""Interpret-mode programs compiled at once, in the background (XLA compiles without the GIL)."""
_COMPILE_SLOTS = threading.BoundedSemaphore(COMPILE_THREADS)


def _lower_larger(
    candidate: Any, larger: InputConfig, choices: list[tuple[str, str]], start: int, interpret: Any
) -> tuple[Any, _BackgroundCompile, int, Any]:
    """Trace and lower the larger-shape program in the first mode from `start` that lowers it, and start
    its compile: (traced, compile, choice, interpret params). The last mode's error is raised."""
    import jax
    from jax.experimental.pallas import tpu as pltpu

    for choice in range(start, len(choices)):
        mode, compile_mode = choices[choice]
        params = True if mode == "plain" else interpret  # True: Pallas's own (plain) interpreter
        try:
            with pltpu.force_tpu_interpret_mode(params):
                traced = jax.jit(bind_static(candidate, larger.static)).trace(*_specs(larger))
                lowered = traced.lower()
        except Exception:
            _reset_interpret()
            if choice == len(choices) - 1:
                raise
            continue  # a program the plain interpreter cannot lower: the next mode
        return (
            traced,
            _BackgroundCompile(lowered, INTERPRET_COMPILE_OPTIONS.get(compile_mode, {})),
            choice,
            params,
        )
    raise ValueError("no interpret mode left for the larger-shape check")


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
