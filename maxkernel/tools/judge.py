"""The trusted side of an evaluation, in its own sandboxed child: it never imports a candidate.

`judge_job` runs the task's code (the reference: sandboxed, because it is not ours) and the TPU compiler:

1. loads the reference and draws the input sets: the task's own inputs plus fresh draws from a seed
   derived from the per-run secret the agent hands this process through a pipe. The candidate, in another
   process that never sees the secret, cannot re-derive them;
2. computes the reference outputs and writes `inputs.npz` (handed to the candidate by the agent, after the
   candidate's programs are fixed) and `expected.npz` (read only by the agent, which compares);
3. announces `inputs_ready` and waits on stdin (one JSON line) for the candidate's TPU programs (serialized `jax.export`
   artifacts, forwarded by the agent); deserializes each, checks Pallas does the work in its StableHLO
   text (`stablehlo_check`), and compiles that very program with the Mosaic compiler for each requested
   TPU generation;
4. with a device present, runs and times that same exported program and the reference on the device,
   and re-checks the outputs there (not exercised on this project's CPU-only machines);
5. writes `expected.npz` only when the agent sends `release` (the candidate's process is gone by then).

Its result is signed with the per-run key (the candidate's process never holds it) and is the only
child result the agent treats as trusted. There is no reference cache on disk: expected outputs live and
die with the evaluation, so there is nothing a candidate could poison for the next one. The task's own
(non-secret) input sets may come from the agent's memory instead of the task's `get_inputs`: see
`reference_cache` for what is cached across candidates and why that is safe.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from maxkernel.tools import taskcode
from maxkernel.tools.candidate import input_name, output_name, stepwise_name
from maxkernel.tools.mosaic_audit import ProgramAudit
from maxkernel.tools.readback import pack_arrays
from maxkernel.tools.results import (
    REFUSED_FOR_DEVICE,
    CompileOutcome,
    InputConfig,
    first_lines,
    low_precision_float,
    np_dtype,
    rounding_checked,
)
from maxkernel.tools.worker import WorkerContext

INPUTS_FILE = "inputs.npz"
EXPECTED_FILE = "expected.npz"
JUDGED_FILE = "judged.npz"
# The reference again with its low-precision float inputs widened to float32, for the outputs that are
# low-precision floats (bf16, f16, f8): an estimate of the exact answer, so a kernel's element that misses
# the reference by more than the tolerance is still right when it is as close to that estimate as the
# reference itself is (plus the tolerance). Beside it, where it differs from the expected output, the
# reference compiled to round after every op in its own dtypes (`stepwise_name`): XLA may keep a fused
# chain's bf16 intermediates in float32 (`xla_allow_excess_precision`), a kernel that rounds each op as the
# program says is as faithful a run of it. Written with EXPECTED_FILE; names listed in `precise`.
PRECISE_FILE = "precise.npz"
"""The checked programs' outputs on the judge's inputs, computed here: the evidence of correctness."""
STAGE_INPUTS_READY = "inputs_ready"
STAGE_JUDGE_RUN = "judge_run"
"""The judge runs the candidate's checked programs (interpret mode, validation shapes): what fails here is
the candidate's program, not the task's."""
MAX_PROGRAMS_BYTES = 256 << 20


def secret_seed(secret: bytes, salt: bytes = b"maxkernel input draws") -> int:
    """A 128-bit seed from the per-run secret; without the secret it cannot be predicted."""
    return int.from_bytes(hashlib.sha256(salt + secret).digest()[:16], "big")


def judge_job(payload: dict[str, Any], ctx: WorkerContext) -> dict[str, Any]:
    """Reference outputs on secret inputs, then inspect and compile the candidate's TPU programs."""
    from maxkernel.tools.evaluation import build_input_sets, reference_fn, run_reference

    ctx.guard()
    task = payload["task"]
    run_dir = Path(ctx.run_dir)
    seconds: dict[str, float] = {}
    ctx.stage("reference")
    t0 = time.perf_counter()
    try:
        ref = taskcode.Reference(
            {
                "format": task["format"],
                "reference_path": task["reference_path"],
                "input_gen_code": task.get("input_gen_code"),
            }
        )
        val = [InputConfig.model_validate(c) for c in task["validation_configs"]]
        seed = secret_seed(ctx.secret) if ctx.secret else int(payload.get("seed", 0))
        own_inputs = _cached_task_inputs(run_dir, payload.get("task_inputs"), val)
        task_inputs = "cached" if own_inputs is not None else "computed"
        input_sets = build_input_sets(ref, task, val, int(payload["input_sets"]), seed, own_inputs)
        expected = []
        precise: dict[str, np.ndarray] = {}
        for ci, (cfg, sets) in enumerate(zip(val, input_sets, strict=True)):
            fn = reference_fn(ref, cfg)  # compiled once per configuration
            stepwise = reference_fn(ref, cfg, stepwise=True)
            expected.append([run_reference(ref, cfg, inputs, fn) for inputs, _origin in sets])
            for si, (inputs, _origin) in enumerate(sets):
                precise.update(_precise_outputs(fn, inputs, expected[-1][si], ci, si, stepwise))
        larger = None
        if payload.get("larger") and input_sets:
            larger = _larger_set(ref, payload["larger"], int(payload["larger_budget_bytes"]),
                                 input_sets[0][0][0], seed, len(val), task)  # fmt: skip
    except taskcode.TaskCodeError as exc:
        return {"ok": False, "stage": "task", "message": str(exc)}
    if ctx.violations:
        return {"ok": False, "stage": "task", "message": "the task's code did something the sandbox forbids: "
                + "; ".join(ctx.violations)}  # fmt: skip
    inputs = {input_name(ci, si, k): a for ci, sets in enumerate(input_sets)
              for si, (arrs, _o) in enumerate(sets) for k, a in enumerate(arrs)}  # fmt: skip
    outputs = {output_name(ci, si, k): a for ci, sets in enumerate(expected)
               for si, outs in enumerate(sets) for k, a in enumerate(outs)}  # fmt: skip
    larger_inputs: list[np.ndarray] | None = None
    if larger is not None and larger.get("ran"):
        larger_inputs = list(larger["inputs"].values())
        inputs.update(larger.pop("inputs"))
        outputs.update(larger.pop("outputs"))
        precise.update(larger.pop("precise", {}))
    (run_dir / INPUTS_FILE).write_bytes(pack_arrays(inputs))
    origins = [[origin for _a, origin in sets] for sets in input_sets]
    seconds["reference"] = time.perf_counter() - t0
    ctx.stage(STAGE_INPUTS_READY)

    # While the candidate still traces: the work that does not need its programs.
    base: dict[str, Any] = {"ok": True, "origins": origins, "seconds": seconds, "larger": larger,
                            "task_inputs": task_inputs, "precise": sorted(precise)}  # fmt: skip
    own = [InputConfig.model_validate(c) for c in task["configs"]]
    t0 = time.perf_counter()
    _warm_tpu_compiler(list(payload.get("tpu") or []))
    failed: dict[str, str] = {}
    base["reference_estimated_seconds"] = {  # per generation the agent has no cached figure for
        str(gen): _reference_estimate(ref, own[0], str(gen), failed)
        for gen in payload.get("reference_estimate_generations") or []
    }
    base["reference_estimate_errors"] = failed
    seconds["judge_warmup"] = time.perf_counter() - t0

    message = sys.stdin.buffer.readline(MAX_PROGRAMS_BYTES)
    if not message.strip():
        return base  # the candidate never got as far as a program: nothing to compile
    try:
        request = json.loads(message)
        if not isinstance(request, dict):
            raise ValueError("not an object")
    except ValueError:  # the agent's own message: a malformed one means the harness is broken
        return {"ok": False, "stage": "toolchain", "message": "the agent's program request is malformed"}
    ctx.stage("compile")
    t0 = time.perf_counter()
    programs: list[bytes | None] = [
        base64.b64decode(p) if isinstance(p, str) else None for p in request.get("programs", [])
    ]
    checked_blobs: list[bytes | None] = [
        base64.b64decode(p) if isinstance(p, str) else None for p in request.get("checked", [])
    ]
    try:
        tpu_checks, compiles, audits = _inspect_and_compile(programs, own, list(request.get("tpu", [])),
                                                            request.get("expected_kernels"))  # fmt: skip
        checked = _inspect_checked(checked_blobs, request.get("expected_kernels"))
    except ToolchainBroken as exc:
        return {"ok": False, "stage": "toolchain", "message": str(exc)}
    seconds["compile"] = time.perf_counter() - t0
    base["tpu_checks"] = tpu_checks
    base["tpu_compile"] = compiles
    base["kernel_audit"] = audits[0] if audits else ProgramAudit(error="no TPU program").model_dump()
    base["checked"] = [info for info, _exp in checked]
    base["consistency"] = _shapes_consistency(checked, audits, len(val))

    # The evidence of correctness: the checked programs, run here on the inputs drawn here.
    ctx.stage(STAGE_JUDGE_RUN)
    t0 = time.perf_counter()
    judged, judged_errors = _run_checked(checked, input_sets, larger_inputs)
    base["judged_errors"] = judged_errors
    seconds["judge_run"] = time.perf_counter() - t0
    if request.get("timing") and programs and programs[0] is not None:
        ctx.stage("timing")
        base["timing"] = _measure(ref, own[0], programs[0], payload, ctx.secret)
    # The expected outputs reach the disk only once the agent says the candidate's process is gone, so
    # they never coexist with it (in the fallback mode it could otherwise read them).
    if sys.stdin.buffer.readline(64).strip() == b"release":
        (run_dir / EXPECTED_FILE).write_bytes(pack_arrays(outputs))
        (run_dir / JUDGED_FILE).write_bytes(pack_arrays(judged))
        (run_dir / PRECISE_FILE).write_bytes(pack_arrays(precise))
    return base


def _precise_outputs(
    fn: Any, inputs: list[np.ndarray], outs: list[np.ndarray], ci: int, si: int, stepwise: Any = None
) -> dict[str, np.ndarray]:
    """`PRECISE_FILE`'s arrays for one input set, for each output whose rounding is checked
    (`rounding_checked`: low-precision, or float32 from low-precision inputs): the (jitted)
    reference on the same inputs with the low-precision floats widened to float32, as float32, where its
    shape is unchanged; and the `stepwise` reference's output (rounding after every op), as float32, where
    it differs from `outs`. Empty when no output is checked so; a run that fails or changes the outputs'
    structure is left out (then the tolerance and the other run decide)."""
    import jax

    ins = [np.dtype(a.dtype).name for a in inputs]
    wanted = [k for k, o in enumerate(outs) if rounding_checked(np.dtype(o.dtype).name, ins)]
    if not wanted:
        return {}

    def run(f: Any, args: list[np.ndarray]) -> list[np.ndarray] | None:
        try:
            got = [np.asarray(x) for x in jax.tree_util.tree_leaves(f(*[jax.numpy.asarray(a) for a in args]))]
        except Exception:  # noqa: BLE001 - a reference written for its dtype: the tolerance alone decides
            return None
        return got if len(got) == len(outs) else None

    res: dict[str, np.ndarray] = {}
    widened = run(
        fn, [a.astype(np.float32) if low_precision_float(np.dtype(a.dtype).name) else a for a in inputs]
    )
    if widened is not None:
        res.update({output_name(ci, si, k): widened[k].astype(np.float32) for k in wanted
                    if widened[k].shape == outs[k].shape and np.issubdtype(widened[k].dtype, np.floating)})  # fmt: skip
    rounded = run(stepwise, inputs) if stepwise is not None else None
    if rounded is not None:
        res.update({stepwise_name(ci, si, k): rounded[k].astype(np.float32) for k in wanted
                    if rounded[k].shape == outs[k].shape and rounded[k].dtype == outs[k].dtype
                    and not np.array_equal(rounded[k], outs[k], equal_nan=True)})  # fmt: skip
    return res


def _cached_task_inputs(run_dir: Path, name: Any, val: list[InputConfig]) -> list[list[np.ndarray]] | None:
    """The task's own inputs the agent cached from an earlier evaluation of this task (`reference_cache`)
    and wrote into this run dir, per validation config; None (compute them) when there are none or they do
    not have the configs' exact shapes and dtypes."""
    if not isinstance(name, str) or "/" in name or not (run_dir / name).is_file():
        return None
    out: list[list[np.ndarray]] = []
    with np.load(run_dir / name, allow_pickle=False) as z:
        for ci, cfg in enumerate(val):
            arrays = []
            for k, spec in enumerate(cfg.dynamic):
                key = input_name(ci, 0, k)
                if key not in z.files:
                    return None
                arr = z[key]
                raw = np.dtype(np.uint16) if spec.dtype == "bfloat16" else np_dtype(spec.dtype)
                if arr.dtype != raw or tuple(arr.shape) != tuple(spec.shape):
                    return None
                arrays.append(arr.view(np_dtype(spec.dtype)) if spec.dtype == "bfloat16" else arr)
            out.append(arrays)
    return out


def _larger_set(
    ref: taskcode.Reference,
    cfg_json: dict[str, Any],
    budget: int,
    like: list[np.ndarray],
    seed: int,
    index: int,
    task: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One secret input set at the agent's larger check shape and the reference's outputs on it, stored as
    config `index` (after the validation configs). The draws are the wide family around the statistics of
    the first validation set's inputs (`like`), within the task's input domain. Never fails the task: a
    reference that cannot run there, or outputs over the memory budget, make it a skipped check, with the
    reason."""
    from maxkernel.tools.evaluation import reference_fn, run_reference

    t0 = time.perf_counter()
    cfg = InputConfig.model_validate(cfg_json)
    try:
        cfg.outputs = taskcode.output_specs(
            taskcode.reference_for(ref.source, cfg.knobs), cfg.dynamic, cfg.static
        )
        need = cfg.input_bytes() + cfg.output_bytes()
        if need > budget:
            return {"ran": False, "reason": f"the reference's inputs and outputs at {cfg.describe()} need "
                    f"{need >> 20} MiB, over the budget of {budget >> 20} MiB"}  # fmt: skip
        rng = np.random.default_rng([seed, index, 0, 11])
        task = task or {}
        domains = taskcode.input_domains(task, len(cfg.dynamic))
        if task.get("larger_config") is not None:  # a size the task's own generator makes: its values there
            hold = set(task.get("hold_inputs") or [])
            own = taskcode.reference_for(ref.source, cfg.knobs).raw_inputs(None)[0][0]
            arrays = [taskcode.random_like(taskcode.to_numpy(a), rng, i in hold, wide=True, domain=domains[i])
                      for i, a in enumerate(own)]  # fmt: skip
        else:
            stats = [
                {"min": float(a.min()), "max": float(a.max()), "mean": float(a.mean()), "std": float(a.std())}
                for a in (np.asarray(x, np.float64) for x in like)
            ]
            arrays = [taskcode.random_from_spec(s, rng, st, wide=True, domain=d)
                      for s, st, d in zip(cfg.dynamic, stats, domains, strict=True)]  # fmt: skip
        fn = reference_fn(ref, cfg)
        outs = run_reference(ref, cfg, arrays, fn)
        wide = sum(8 * math.prod(o.shape) for o in cfg.rounding_checked_outputs())
        # the float32 and step-wise runs only where they fit the budget too (else the tolerance alone decides)
        precise = (
            _precise_outputs(fn, arrays, outs, index, 0, reference_fn(ref, cfg, stepwise=True))
            if need + wide <= budget
            else {}
        )
    except Exception as exc:  # noqa: BLE001 - the reference was written for its own shapes; skip, say why
        return {"ran": False, "reason": f"the reference does not run at {cfg.describe()}: "
                f"{type(exc).__name__}: {first_lines(str(exc), 3)}"}  # fmt: skip
    return {
        "ran": True,
        "config": cfg.model_dump(mode="json"),
        "seconds": round(time.perf_counter() - t0, 4),
        "inputs": {input_name(index, 0, k): a for k, a in enumerate(arrays)},
        "outputs": {output_name(index, 0, k): a for k, a in enumerate(outs)},
        "precise": precise,
    }


def _warm_tpu_compiler(gens: list[str]) -> None:
    """Compile a trivial program for each generation's topology: the first TPU compile in a process pays
    ~0.7 s of compiler start-up, which this moves into the time the judge waits for the candidate's
    programs. Only a warm-up: a failure here is reported by `_inspect_and_compile`, which asks again."""
    import jax
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    from maxkernel.tools.tpu_specs import get_spec

    for gen in gens:
        try:
            device = topologies.get_topology_desc(get_spec(gen).topology, "tpu").devices[0]
            spec = jax.ShapeDtypeStruct((8, 128), np.float32, sharding=SingleDeviceSharding(device))
            jax.jit(lambda x: x + 1).trace(spec).lower().compile()
        except Exception:  # noqa: BLE001, S112 - see the docstring: the real compile reports it
            continue


def _inspect_and_compile(
    programs: list[bytes | None], own: list[InputConfig], gens: list[str], expected_kernels: int | None
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]], dict[str, Any]]:
    """Per program: the Pallas-does-the-work check of what ships; per generation: its compile; and the
    audit of the first (the task's own shapes, the one the candidate's estimate describes) that its claimed
    estimate is checked against (`mosaic_audit`)."""
    import jax
    from jax import export
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    from maxkernel.tools.mosaic_audit import ProgramAudit, audit_tpu_program, parallel_races
    from maxkernel.tools.stablehlo_check import TpuProgramCheck, check_tpu_program
    from maxkernel.tools.tpu_specs import get_spec

    checks: list[dict[str, Any]] = []
    exported: list[Any] = []
    audits: list[dict[str, Any]] = []
    for blob in programs:
        if blob is None:
            exported.append(None)
            checks.append(TpuProgramCheck(ok=False, reason="no TPU program").model_dump())
            audits.append(ProgramAudit(error="no TPU program").model_dump())
            continue
        try:
            exp = export.deserialize(bytearray(blob))
            if tuple(exp.platforms) != ("tpu",):
                raise ValueError(f"lowered for {exp.platforms}, not for the TPU")
            exported.append(exp)
            text = exp.mlir_module()
            checks.append(check_tpu_program(text, expected_kernels).model_dump())
            audits.append(audit_tpu_program(text).model_dump())
        except Exception as exc:  # noqa: BLE001 - a malformed artifact is the candidate's failure
            _raise_if_toolchain(exc)
            exported.append(None)
            audits.append(ProgramAudit(error=f"not a valid export: {str(exc)[:300]}").model_dump())
            checks.append(
                TpuProgramCheck(ok=False, reason=f"the TPU program is not a valid export: {exc}").model_dump()
            )
    compiles: dict[str, dict[str, Any]] = {}
    for gen in gens:
        t0 = time.perf_counter()
        try:
            device = topologies.get_topology_desc(get_spec(gen).topology, "tpu").devices[0]
        except Exception as exc:  # noqa: BLE001 - no candidate code is involved: this machine cannot compile
            raise ToolchainBroken(f"no TPU compiler available (libtpu): {type(exc).__name__}: {exc}") from exc
        sharding = SingleDeviceSharding(device)
        outcome = CompileOutcome(ok=True)
        for i, (cfg, exp) in enumerate(zip(own, exported, strict=False)):
            if exp is None:
                outcome = CompileOutcome(ok=False, error="no valid TPU program to compile")
                break
            specs = [jax.ShapeDtypeStruct(a.shape, np_dtype(a.dtype), sharding=sharding) for a in cfg.dynamic]
            try:
                compiled = jax.jit(exp.call).trace(*specs).lower().compile()
            except Exception as exc:  # noqa: BLE001 - the compiler's message, verbatim, is the verdict
                _raise_if_toolchain(exc)
                outcome = CompileOutcome(ok=False, error=f"{type(exc).__name__}: {exc}")
                break
            if i == 0:  # the task's own shapes: the program the estimate describes
                try:
                    outcome.relayout_bytes = parameter_relayout_bytes(compiled.as_text())
                except Exception:  # noqa: BLE001 - no text, no charge (the compile itself succeeded)
                    pass
        cores = get_spec(gen).tensorcores_per_device
        race = next(
            (r for a in audits if cores > 1 and (r := parallel_races(ProgramAudit.model_validate(a)))), None
        )
        if outcome.ok and race:  # compiles, but wrong on this device: its cores split the 'parallel' axes
            outcome = CompileOutcome(
                ok=False, error=f"{REFUSED_FOR_DEVICE} {gen} ({cores} TensorCores per device): {race}"
            )
        outcome.seconds = round(time.perf_counter() - t0, 3)
        compiles[gen] = outcome.model_dump()
    return checks, compiles, audits


_HLO_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\w+)\[([\d,]*)\](\{[^ ]*\})?\s+(\w[\w-]*)\(([^)]*)\)"
)
"""name = type[dims]{layout} opcode(operands)"""
_HLO_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4,
              "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}  # fmt: skip


def parameter_relayout_bytes(hlo_text: str) -> float:
    """HBM bytes of the `copy` instructions of the entry computation that read a parameter: the compiler's
    relayout of an input whose TPU default layout differs from the one the program needs (a
    [.., 4096, 4095] float32 input is laid out with its 4096-wide dim minor; a Pallas kernel reads it
    row-major, so the whole input is copied first). Each is read and written once. Only the entry
    computation, where the parameters are."""
    entry: list[str] = []
    inside = False
    for line in hlo_text.splitlines():
        if line.startswith("ENTRY "):
            inside = True
            continue
        if inside:
            if line.startswith("}"):
                break
            entry.append(line)
    instrs = [m for line in entry if (m := _HLO_INSTR.match(line))]
    params = {m.group(1): _minor_to_major(m.group(4)) for m in instrs if m.group(5) == "parameter"}
    total = 0.0
    for m in instrs:
        operand = m.group(6).strip().lstrip("%")
        if m.group(5) != "copy" or operand not in params:
            continue
        if _minor_to_major(m.group(4)) == params[operand]:
            continue  # the same order (a move to another memory space, not a relayout)
        dims = [int(d) for d in m.group(3).split(",") if d]
        total += 2.0 * math.prod(dims) * _HLO_BYTES.get(m.group(2), 4)
    return total


def _minor_to_major(layout: str | None) -> str:
    """`{1,0,2:T(8,128)S(1)}` -> `1,0,2` (the dim order; tiling and memory space dropped)."""
    return (layout or "{}")[1:-1].split(":", 1)[0]


def _inspect_checked(
    blobs: list[bytes | None], expected_kernels: int | None
) -> list[tuple[dict[str, Any], Any]]:
    """Per checked program (validation configs, then the larger check): whether it is what it must be — a
    module for ("cpu", "tpu") whose only platform-dependent sites are its kernels, whose TPU side passes
    the rules the shipped program passes — with the audit of its kernels, and the deserialized program
    (None when it must not run)."""
    from jax import export

    from maxkernel.tools.mosaic_audit import audit_tpu_program
    from maxkernel.tools.stablehlo_check import check_tpu_program, tpu_view

    out: list[tuple[dict[str, Any], Any]] = []
    for blob in blobs:
        if blob is None:
            out.append(({"ok": False, "reason": "no checked program"}, None))
            continue
        try:
            exp = export.deserialize(bytearray(blob))
            if tuple(exp.platforms) != ("cpu", "tpu"):
                raise ValueError(f"lowered for {exp.platforms}, not for ('cpu', 'tpu')")
            view = tpu_view(exp.mlir_module())
            if view.problem:
                out.append(({"ok": False, "reason": view.problem}, None))
                continue
            check = check_tpu_program(view.text, expected_kernels)
            info = {
                "ok": check.ok,
                "reason": check.reason,
                "audit": audit_tpu_program(view.text).model_dump(),
            }
            out.append((info, exp if check.ok else None))
        except Exception as exc:  # noqa: BLE001 - a malformed artifact is the candidate's failure
            _raise_if_toolchain(exc)
            out.append(({"ok": False, "reason": f"the checked program is not a valid export: {exc}"}, None))
    return out


def _shapes_consistency(
    checked: list[tuple[dict[str, Any], Any]], shipped: list[dict[str, Any]], n_val: int
) -> str | None:
    """Why the kernels that were checked (validation shapes, larger check) and the kernels that ship (the
    task's own shapes) are not one kernel at several shapes, read off the programs here; None if they are.
    Every audited program must also write every block of its outputs."""
    from maxkernel.tools.mosaic_audit import ProgramAudit, different_kernels, uncovered_outputs

    ships = [ProgramAudit.model_validate(a) for a in shipped]
    for i, audit in enumerate(ships):
        reason = uncovered_outputs(audit)
        if reason:
            return f"in the program that ships (config {i}): {reason}"
    for ci, (info, _exp) in enumerate(checked):
        if "audit" not in info:
            continue
        audit = ProgramAudit.model_validate(info["audit"])
        what = f"the validation shapes (config {ci})" if ci < n_val else "the larger check shape"
        reason = uncovered_outputs(audit)
        if reason:
            return f"at {what}: {reason}"
        target = ships[ci] if ci < min(n_val, len(ships)) else (ships[0] if ships else None)
        if target is not None:
            reason = different_kernels(audit, target, what)
            if reason:
                return reason
    return None


JUDGE_RUN_OPTIONS = {
    "xla_cpu_use_fusion_emitters": False,
    "xla_cpu_parallel_codegen_split_count": 1,
    # XLA:CPU folds a transpose into a bf16 x bf16 -> f32 dot it has no kernel for ("Unsupported element type
    # for DotThunk::Execute") when the transpose sits between two kernels: a fact of this CPU, not a kernel's
    "xla_disable_hlo_passes": "transpose-folding",
}
"""How the judge compiles a checked program's CPU side (Pallas's plain interpreter): fusion emitters off
is 2-5x faster to compile for these loop-shaped programs (`candidate.JUDGE_COMPILE`)."""


def _run_checked(
    checked: list[tuple[dict[str, Any], Any]],
    input_sets: list[list[tuple[list[np.ndarray], str]]],
    larger_inputs: list[np.ndarray] | None,
) -> tuple[dict[str, np.ndarray], dict[str, dict[str, Any]]]:
    """Run each checked program on the CPU on this judge's inputs: outputs under `output_name`, and per
    program index its first failure, `{"set": index or None (none ran), "message": ...}` (a program that
    does not run is the candidate's failure)."""
    import jax

    runs: list[tuple[int, list[list[np.ndarray]]]] = [
        (ci, [arrays for arrays, _origin in sets]) for ci, sets in enumerate(input_sets)
    ]
    if larger_inputs is not None:
        runs.append((len(input_sets), [larger_inputs]))
    judged: dict[str, np.ndarray] = {}
    errors: dict[str, dict[str, Any]] = {}
    for ci, sets in runs:
        info, exp = checked[ci] if ci < len(checked) else ({"reason": "no checked program"}, None)
        if exp is None:
            errors[str(ci)] = {"set": None, "message": "the judge has no program to run: "
                               + str(info.get("reason"))[:2000]}  # fmt: skip
            continue
        try:
            compiled = jax.jit(exp.call).trace(*sets[0]).lower().compile(compiler_options=JUDGE_RUN_OPTIONS)
        except Exception as exc:  # noqa: BLE001 - what the candidate handed over does not compile here
            _raise_if_toolchain(exc)
            errors[str(ci)] = {"set": None, "message": "the checked program does not compile for the CPU: "
                               f"{type(exc).__name__}: {first_lines(str(exc), 4)}"}  # fmt: skip
            continue
        for si, arrays in enumerate(sets):
            try:
                leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(compiled(*arrays))]
            except Exception as exc:  # noqa: BLE001 - the kernel failed on this input set
                errors[str(ci)] = {"set": si, "message": f"running input set {si}: {type(exc).__name__}: "
                                   + first_lines(str(exc), 4)}  # fmt: skip
                break
            for k, leaf in enumerate(leaves):
                judged[output_name(ci, si, k)] = leaf
    return judged, errors


class ToolchainBroken(Exception):
    """This machine's JAX / libtpu cannot inspect or compile any program (a module missing from the install,
    no TPU compiler): a fact about the environment, which the harness returns as an `infrastructure`
    failure and never stores as the candidate's verdict."""


def _raise_if_toolchain(exc: BaseException) -> None:
    """Only the judge's own imports fail this way: the programs it reads are data, never imported code."""
    if isinstance(exc, ImportError):
        raise ToolchainBroken(f"the TPU toolchain is incomplete: {type(exc).__name__}: {exc}") from exc


def _reference_estimate(
    ref: taskcode.Reference, cfg: InputConfig, gen: str, failed: dict[str, str] | None = None
) -> float | None:
    """The TPU compiler's estimate of the reference on `gen`; None when XLA cannot compile it there, with
    the reason in `failed[gen]` (a reference whose temporaries exceed the generation's HBM has no time)."""
    import jax

    from maxkernel.tools.estimate import estimate_xla

    specs = [jax.ShapeDtypeStruct(a.shape, np_dtype(a.dtype)) for a in cfg.dynamic]
    try:
        static = cfg.static
        return estimate_xla(lambda *d: ref.computation(*d, *static), specs, gen).estimated_seconds
    except Exception as exc:  # noqa: BLE001 - an estimate failing must not fail an accepted kernel
        if failed is not None:
            failed[gen] = reference_failure(exc)
        return None


def reference_failure(exc: BaseException) -> str:
    """Why XLA could not compile the reference for a generation, in a line: the HBM figures when it ran out
    of memory (the compiler names them), else the error's first line."""
    text = str(exc)
    oom = re.search(
        r"HLO temporaries \(([\d.]+\s*[KMGT]?i?B?)\) exceeds available HBM \(([\d.]+\s*[KMGT]?i?B?)\)", text
    )
    if "RESOURCE_EXHAUSTED" in text and oom:
        return (
            f"XLA's own program for the reference does not fit this generation's HBM ({oom.group(1)} of "
            f"temporaries, {oom.group(2)} available): the reference cannot run there, so there is no speedup "
            "to state"
        )
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return f"XLA could not compile the reference for this generation: {type(exc).__name__}: {first}"[:300]


def _measure(
    ref: taskcode.Reference, cfg: InputConfig, blob: bytes, payload: dict[str, Any], secret: bytes
) -> dict[str, Any] | None:
    """Median wall time of the candidate's *exported* TPU program and of the reference, on the device,
    at the task's own shapes, with the outputs compared there. None without a device."""
    import jax
    from jax import export

    from maxkernel.tools.evaluation import compare
    from maxkernel.tools.results import MeasuredTiming

    device = jax.devices()[0]
    if device.platform == "cpu":
        return None
    exp = export.deserialize(bytearray(blob))
    rng = np.random.default_rng(secret_seed(secret, b"maxkernel timing draws"))
    args = [
        jax.device_put(
            rng.standard_normal(a.shape).astype(np_dtype(a.dtype))
            if np.issubdtype(np_dtype(a.dtype), np.floating) or a.dtype == "bfloat16"
            else np.zeros(a.shape, np_dtype(a.dtype)),
            device,
        )
        for a in cfg.dynamic
    ]
    warmups, runs = int(payload.get("warmups", 3)), max(int(payload.get("runs", 20)), 20)
    cand = jax.jit(exp.call)
    static = cfg.static
    refn = jax.jit(lambda *d: ref.computation(*d, *static))

    def timed(fn: Any) -> tuple[list[float], Any]:
        out = None
        for _ in range(warmups):
            out = jax.block_until_ready(fn(*args))
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            out = jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - t0)
        return times, out

    ct, cout = timed(cand)
    rt, rout = timed(refn)
    leaves = lambda o: [np.asarray(x) for x in jax.tree_util.tree_leaves(o)]  # noqa: E731
    recheck = compare(leaves(cout), leaves(rout), cfg, 0, 0, "random")
    cq, rq = np.percentile(ct, [25, 50, 75]), np.percentile(rt, [25, 50, 75])
    return MeasuredTiming(
        device=str(device.device_kind),
        warmups=warmups,
        runs=runs,
        candidate_median_s=float(cq[1]),
        candidate_spread_s=float(cq[2] - cq[0]),
        reference_median_s=float(rq[1]),
        reference_spread_s=float(rq[2] - rq[0]),
        measured_speedup=float(rq[1] / cq[1]),
        rechecked_correct=recheck.ok,
    ).model_dump()
