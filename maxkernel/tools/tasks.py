"""Kernel tasks: find the files, read the metadata, and learn the shapes in a sandboxed child.

The reference is task code, which this process never executes: shapes, dtypes, static arguments and
output specs come back from `describe_job` run in the sandbox, which uses `jax.eval_shape` (no
allocation). A task whose validation inputs would not fit this machine is refused here, with the sizes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field

from maxkernel.tools import jaxbench
from maxkernel.tools.readback import bounded_yaml, remove_tree
from maxkernel.tools.results import InputConfig
from maxkernel.tools.sandbox import SandboxLimits, fresh_run_dir, run_sandboxed, task_read_paths
from maxkernel.tools.taskcode import task_source

TaskFormat = Literal["maxkernel", "reference", "jaxbench"]


class TaskError(Exception):
    """The task (not a candidate) is unusable. CLI exit code 2."""


class KernelTask(BaseModel):
    task_id: str
    description: str = ""
    category: str = ""
    format: TaskFormat
    path: str = Field(description="the task dir, or the module file for bare references and JAXBench")
    reference_path: str
    input_gen_code: str | None = None
    tolerances: dict[str, Any] = Field(default_factory=dict, description="atol/rtol: float or one per config")
    hold_inputs: list[int] = Field(
        default_factory=list, description="dynamic inputs kept as the task's own in random input sets"
    )
    input_domain: list[float] | dict[int, list[float]] | None = Field(
        None, description="where the reference is defined (`input_domain` in kernel_task.yaml): one [lo, hi] "
        "for every floating input or {input index: [lo, hi]}; secret draws stay inside it",
    )  # fmt: skip
    fingerprint: str = Field(description="sha256 of the task's files and the validation scale")
    configs: list[InputConfig] = Field(description="the task's own (TPU-scale) input configurations")
    validation_configs: list[InputConfig] = Field(description="shapes used for interpret-mode correctness")
    validation_mode: Literal["task", "cpu", "shrink"]
    validation_factor: float = 1.0
    validation_note: str = ""
    reference_seconds: float = Field(
        0.0, description="one jitted reference run per validation config, compile included (measured at load)"
    )

    def source_payload(self) -> dict[str, Any]:
        return task_source(self.model_dump(mode="json"))

    def validation_bytes(self) -> int:
        return sum(c.input_bytes() + c.output_bytes() for c in self.validation_configs)


def _locate(path: Path) -> tuple[TaskFormat, Path, dict[str, Any]]:
    if not path.exists():
        raise TaskError(f"task not found: {path}")
    if path.is_dir():
        ref = path / "reference.py"
        meta_path = path / "kernel_task.yaml"
        meta: dict[str, Any] = {}
        if meta_path.exists():
            try:
                meta = bounded_yaml(meta_path.read_text()) or {}
            except yaml.YAMLError as exc:
                raise TaskError(f"{meta_path} is not valid YAML: {exc}") from exc
            except ValueError as exc:
                raise TaskError(f"{meta_path} refused: {exc}") from exc
            if not isinstance(meta, dict):
                raise TaskError(f"{meta_path} must be a mapping")
        if not ref.exists():
            if jaxbench.is_workload_dir(path):
                baseline = path / jaxbench.BASELINE_FILE
                return "jaxbench", baseline, jaxbench.task_meta(baseline)
            raise TaskError(
                f"{path} has no reference.py (a MaxKernel problem dir) and no {jaxbench.BASELINE_FILE} "
                "defining create_inputs and workload (a JAXBench workload dir)"
            )
        return ("maxkernel" if meta else "reference"), ref, meta
    if path.suffix != ".py":
        raise TaskError(f"a task is a problem dir, a JAXBench workload dir or a .py module; got {path}")
    if jaxbench.is_workload_module(path):
        return "jaxbench", path, jaxbench.task_meta(path)
    return "reference", path, {}


def _input_domain(raw: Any) -> list[float] | dict[int, list[float]] | None:
    """`input_domain` from kernel_task.yaml, checked: `[lo, hi]` or `{index: [lo, hi]}` with lo <= hi."""
    if raw is None:
        return None

    def pair(v: Any) -> list[float]:
        if not (isinstance(v, list | tuple) and len(v) == 2 and all(isinstance(x, int | float) for x in v)):
            raise TaskError(f"input_domain must be [lo, hi] or {{input index: [lo, hi]}}; got {v!r}")
        if not float(v[0]) <= float(v[1]):
            raise TaskError(f"input_domain {v!r}: lo must not exceed hi")
        return [float(v[0]), float(v[1])]

    if isinstance(raw, dict):
        try:
            return {int(k): pair(v) for k, v in raw.items()}
        except (TypeError, ValueError) as exc:
            raise TaskError(f"input_domain keys must be input indices: {exc}") from exc
    return pair(raw)


_SAFE_ID = re.compile(r"[^A-Za-z0-9._-]+")


def safe_task_id(raw: str) -> str:
    """A task id usable as one path component: `../../x` must not put outputs outside the output dir.
    Anything but letters, digits, `.`, `_` and `-` becomes `_`; leading dots go; never empty."""
    cleaned = _SAFE_ID.sub("_", raw).lstrip(".")[:120]
    return cleaned or "task"


DESCRIBE_VERSION = 3
"""Bumped when describe_job's output gains a field (2: the own configs' small integer input values; 3: those
up to 65536 elements, page tables included), so a cached description from before is not taken for a
complete one."""


def _fingerprint(files: list[Path], scale: str) -> str:
    h = hashlib.sha256(scale.encode())
    for f in files:
        if f.exists():
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def memory_budget_bytes() -> int:
    """What validation may use: a quarter of available memory (inputs, outputs, reference and candidate
    copies and interpret-mode buffers all coexist in the child)."""
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        avail = 8 << 30
    return avail // 4


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def load_task(
    path: str | Path,
    *,
    scale: str | None = None,
    work_dir: Path | None = None,
    timeout_s: float = 300.0,
    memory_budget: int | None = None,
) -> KernelTask:
    """Load a task in any supported format. Raises `TaskError` with a message for a person.

    `timeout_s` bounds the sandboxed describe (the CLI passes its --timeout). A reference whose loading
    trips the sandbox (writes outside its run dir, opens a socket, ...) is refused here: the task is bad.
    """
    path = Path(path).resolve()
    fmt, ref_path, meta = _locate(path)
    scale = scale or "auto"
    task_id = safe_task_id(str(meta.get("task_id") or (path.name if path.is_dir() else path.stem)))
    files = [ref_path] + ([path / "kernel_task.yaml"] if path.is_dir() else [])
    if fmt == "jaxbench":
        files.append(ref_path.parent / jaxbench.OPTIMIZED_FILE)  # its CONFIG may carry the tolerances
    fingerprint = _fingerprint(files, scale)
    work_dir = Path(work_dir or Path.cwd() / ".maxkernel").resolve()
    tolerances = {k: meta[k] for k in ("atol", "rtol") if k in meta}
    payload = {
        "source": task_source({**meta, "format": fmt, "reference_path": str(ref_path)}),
        "scale": scale,
        "tolerances": tolerances,
        "memory_budget": memory_budget if memory_budget is not None else memory_budget_bytes(),
    }
    # The description depends only on the task's files and the scale: cache it next to the run dirs.
    cache = work_dir / "describe" / f"{fingerprint}.v{DESCRIBE_VERSION}.json"
    value: dict[str, Any] | None = None
    if cache.exists():
        try:
            value = json.loads(cache.read_text())
        except json.JSONDecodeError:
            value = None
    if value is None:
        run_dir = fresh_run_dir(work_dir / "describe", fingerprint[:16])
        outcome = run_sandboxed(
            "maxkernel.tools.evaluation:describe_job",
            payload,
            run_dir,
            # the task's own code, as the judge runs it: without bubblewrap it keeps the agent's user (a
            # reference in a private folder stays readable); a candidate is never run here
            SandboxLimits(timeout_s=timeout_s, fallback_as_nobody=False),
            read_paths=task_read_paths(ref_path),
        )
        if outcome.violations:
            remove_tree(run_dir)
            raise TaskError(
                "the task's code did something the sandbox forbids when loaded: "
                + "; ".join(outcome.violations)
            )
        if not outcome.ok:
            remove_tree(run_dir)
            raise TaskError(f"loading the task failed ({outcome.stage}): {outcome.error}")
        value = outcome.value or {}
        if value.get("ok"):
            tmp = cache.with_suffix(f".{run_dir.name}.part")
            tmp.write_text(json.dumps(value))
            tmp.replace(cache)
        remove_tree(run_dir)
    if not value.get("ok"):
        raise TaskError(str(value.get("error")))
    task = KernelTask(
        task_id=task_id,
        description=str(meta.get("description", "")).strip(),
        category=str(meta.get("category", "")),
        format=fmt,
        path=str(path),
        reference_path=str(ref_path),
        input_gen_code=meta.get("input_gen_code"),
        tolerances=tolerances,
        hold_inputs=list(meta.get("hold_inputs") or []),
        input_domain=_input_domain(meta.get("input_domain")),
        fingerprint=fingerprint,
        configs=value["configs"],
        validation_configs=value["validation_configs"],
        validation_mode=value["validation_mode"],
        validation_factor=value["validation_factor"],
        validation_note=value["validation_note"],
        reference_seconds=float(value.get("reference_seconds") or 0.0),
    )
    budget = memory_budget if memory_budget is not None else memory_budget_bytes()
    need = 4 * task.validation_bytes()
    if need > budget:
        shapes = "; ".join(c.describe() for c in task.validation_configs)
        raise TaskError(
            f"task {task_id} is too large to validate on this machine: inputs+outputs are "
            f"{_gib(task.validation_bytes())} ({shapes}); validation needs about {_gib(need)}, "
            f"the budget is {_gib(budget)}. Use --scale 0.25 (or smaller) to shrink the shapes for CPU "
            "validation; the TPU compile still uses the real shapes."
        )
    return task
