"""Kernel tasks: find the files, read the metadata, and learn the shapes in a sandboxed child.

The reference is task code, which this process never executes: shapes, dtypes, static arguments and
output specs come back from `describe_job` run in the sandbox, which uses `jax.eval_shape` (no
allocation). A task whose validation inputs would not fit this machine is refused here, with the sizes.
"""

from __future__ import annotations

import ast
import dataclasses
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
from maxkernel.tools.sandbox import (
    SandboxLimits,
    fresh_run_dir,
    machine_load_factor,
    run_sandboxed,
    task_read_paths,
)
from maxkernel.tools.taskcode import task_source
from maxkernel.tools.validation_sizing import DEFAULT_RATES, Budget, Rates, within_band

TaskFormat = Literal["maxkernel", "reference", "jaxbench"]
ValidationMode = Literal["task", "cpu", "knobs", "shrink"]
"""How the validation shapes were made: the task's own, its CPU scale (`get_inputs(scale="cpu")`), its own
generator with size literals changed (`generator_knobs`), or its arrays' dimensions scaled (random values)."""


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
    validation_mode: ValidationMode
    validation_factor: float = 1.0
    validation_note: str = ""
    reference_seconds: float = Field(
        0.0, description="one jitted reference run per validation config, compile included (measured at load)"
    )
    predicted_set_seconds: float = Field(
        0.0,
        description="the candidate's predicted TPU-interpret time for one input set at the validation shapes "
        "(`validation_sizing`); evaluation timeouts follow it",
    )
    larger_config: InputConfig | None = Field(
        None,
        description="the larger-shape check's configuration when the sizing chose it (a size the task's own "
        "generator makes, one the budget search passed through); None: the harness grows the shapes itself",
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


DESCRIBE_VERSION = 4
"""Bumped when describe_job's output gains a field (2: the own configs' small integer input values; 3: those
up to 65536 elements, page tables included; 4: budget-sized validation, generator knobs, the larger
config), so a cached description from before is not taken for a complete one."""


def _fingerprint(files: list[Path], scale: str) -> str:
    h = hashlib.sha256(scale.encode())
    for f in files:
        if f.exists():
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()


MEMORY_BUDGET_CAP = 4 << 30
"""The most one validation input set may hold (the reference's predicted peak): larger sets buy little
more confidence and cost minutes per evaluation."""


def memory_budget_bytes() -> int:
    """What validation may use: a quarter of available memory (inputs, outputs, reference and candidate
    copies and interpret-mode buffers all coexist in the child), rounded down to 256 MiB so the figure
    (which is part of the task's fingerprint) does not move with every page, and at most
    `MEMORY_BUDGET_CAP`."""
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        avail = 8 << 30
    quarter = (avail // 4) >> 28 << 28
    return max(256 << 20, min(MEMORY_BUDGET_CAP, quarter))


RATES_VERSION = 2


def machine_rates(work_dir: Path, timeout_s: float = 120.0) -> Rates:
    """This machine's interpret-mode and XLA:CPU rates (`validation_sizing.measure_rates`), measured once
    in a sandboxed child and kept in `~/.cache/maxkernel` (else under `work_dir`) keyed by the machine and
    the toolchain; the defaults when they cannot be measured."""
    import platform

    from maxkernel.tools.store import package_versions

    # The machine and the JAX toolchain decide the rates (not maxkernel's own code: a new commit does not
    # make this machine faster); RATES_VERSION changes when what is measured changes.
    key = hashlib.sha256(
        json.dumps(
            [platform.node(), platform.machine(), os.cpu_count(), package_versions(), RATES_VERSION]
        ).encode()
    ).hexdigest()[:16]
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "maxkernel"
    for folder in (home, work_dir / "cache"):
        path = folder / f"rates-{key}.json"
        try:
            return within_band(Rates(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue
    run_dir = fresh_run_dir(work_dir / "describe", "rates")
    outcome = run_sandboxed(
        "maxkernel.tools.validation_sizing:measure_rates_job", {}, run_dir, SandboxLimits(timeout_s=timeout_s)
    )
    remove_tree(run_dir)
    if not outcome.ok or not isinstance(outcome.value, dict):
        return DEFAULT_RATES
    try:
        rates = within_band(Rates(**outcome.value))
    except TypeError:
        return DEFAULT_RATES
    for folder in (home, work_dir / "cache"):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            tmp = folder / f"rates-{key}.{os.getpid()}.part"
            tmp.write_text(json.dumps(dataclasses.asdict(rates)))
            tmp.replace(folder / f"rates-{key}.json")
            break
        except OSError:
            continue
    return rates


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


TILES_SCALE = "tiles"
"""`--scale tiles`: the budget search with `TILES_SECONDS_PER_SET` per input set, keeping the format's tile
multiples while anything else can shrink (`Budget.tiles_first`). For kernels tuned with blocks wider than
the default shapes keep (a hand-written JAXBench kernel's 2048-wide blocks)."""
TILES_SECONDS_PER_SET = 12.0
"""Three times the default budget: flash attention keeps a 2048 sequence at `[4, 4, 2048, 128]`, the GEMM
2048 x 2048 x 14336 (8-9 s predicted per set on 2 cores)."""


def parse_budget(scale: str) -> float | None:
    """`2s` / `0.5s` -> seconds per validation input set for the budget search; None for other scales."""
    if not scale.endswith("s") or scale in ("tpu",):
        return None
    try:
        seconds = float(scale[:-1])
    except ValueError:
        return None
    if not 0 < seconds < 1e6:
        raise TaskError(f"--scale {scale}: a validation budget must be a positive number of seconds")
    return seconds


def _declares_cpu_scale(fmt: str, ref_path: Path, meta: dict[str, Any]) -> bool:
    """Whether the task's generator takes `scale` (its own CPU-scale shapes), read with `ast`."""
    if fmt == "jaxbench":
        return False
    texts = [meta.get("input_gen_code") or ""]
    try:
        texts.append(ref_path.read_text(errors="replace"))
    except OSError:
        pass
    for text in texts:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == "get_inputs":
                params = [*node.args.args, *node.args.kwonlyargs]
                return any(a.arg == "scale" for a in params) or node.args.kwarg is not None
    return False


DESCRIBE_RETRIES = 2
"""A describe child that dies while running the reference at its planned size (killed for memory, a
`bad_alloc` abort) is asked again with a quarter of the budget, this many times."""


def _describe(
    payload: dict[str, Any],
    work_dir: Path,
    fingerprint: str,
    ref_path: Path,
    timeout_s: float,
    *,
    retry: bool,
) -> dict[str, Any]:
    """Run `describe_job` in the sandbox; a crash while the reference runs at the planned validation size
    is the size's fault, not the task's: ask again smaller (budget-sized tasks only)."""
    crashes: list[str] = []
    for attempt in range(DESCRIBE_RETRIES + 1):
        run_dir = fresh_run_dir(work_dir / "describe", fingerprint[:16])
        outcome = run_sandboxed(
            "maxkernel.tools.evaluation:describe_job",
            payload,
            run_dir,
            # a busy machine stretches the search's traces and the reference's run alike: a describe that
            # takes a minute idle must not time out at a load of 8 per core and be called a bad task
            # the task's own code, as the judge runs it: without bubblewrap it keeps the agent's user (a
            # reference in a private folder stays readable); a candidate is never run here
            SandboxLimits(timeout_s=timeout_s * machine_load_factor(), fallback_as_nobody=False),
            read_paths=task_read_paths(ref_path),
        )
        remove_tree(run_dir)
        if outcome.violations:
            raise TaskError(
                "the task's code did something the sandbox forbids when loaded: "
                + "; ".join(outcome.violations)
            )
        if outcome.ok:
            value = outcome.value or {}
            if crashes and value.get("ok"):
                value["validation_note"] = (
                    f"{value.get('validation_note', '')}; planned again smaller after: " + "; ".join(crashes)
                )
            return value
        if not retry or outcome.stage != "reference" or attempt == DESCRIBE_RETRIES:
            break
        crashes.append(f"{outcome.error}"[:300])
        payload = {
            **payload,
            "seconds_per_set": float(payload["seconds_per_set"]) / 4,
            "memory_budget": int(payload["memory_budget"]) // 4,
        }
    raise TaskError(f"loading the task failed ({outcome.stage}): {outcome.error}")


def load_task(
    path: str | Path,
    *,
    scale: str | None = None,
    work_dir: Path | None = None,
    timeout_s: float = 300.0,
    memory_budget: int | None = None,
    seconds_per_set: float = Budget.seconds_per_set,
    rates: Rates | None = None,
) -> KernelTask:
    """Load a task in any supported format. Raises `TaskError` with a message for a person.

    `timeout_s` bounds the sandboxed describe (the CLI passes its --timeout). A reference whose loading
    trips the sandbox (writes outside its run dir, opens a socket, ...) is refused here: the task is bad.
    """
    path = Path(path).resolve()
    fmt, ref_path, meta = _locate(path)
    scale = scale or "auto"
    budget_seconds = parse_budget(scale)
    tiles_first = scale == TILES_SCALE
    if tiles_first:
        scale, seconds_per_set = "cpu", TILES_SECONDS_PER_SET
    if budget_seconds is not None:  # `--scale 2s`: the budget search with that many seconds per input set
        scale, seconds_per_set = "cpu", budget_seconds
    task_id = safe_task_id(str(meta.get("task_id") or (path.name if path.is_dir() else path.stem)))
    files = [ref_path] + ([path / "kernel_task.yaml"] if path.is_dir() else [])
    work_dir = Path(work_dir or Path.cwd() / ".maxkernel").resolve()
    tolerances = {k: meta[k] for k in ("atol", "rtol") if k in meta}
    budget = memory_budget if memory_budget is not None else memory_budget_bytes()
    payload = {
        "source": task_source({**meta, "format": fmt, "reference_path": str(ref_path)}),
        "scale": scale,
        "tolerances": tolerances,
        "memory_budget": budget,
        "seconds_per_set": seconds_per_set,
        "tiles_first": tiles_first,
    }
    sized = scale in ("auto", "cpu") and not _declares_cpu_scale(fmt, ref_path, meta)
    if sized:  # the budget search will run: it needs this machine's rates
        payload["rates"] = dataclasses.asdict(rates if rates is not None else machine_rates(work_dir))
    # What decides the validation shapes is part of the fingerprint (it keys the describe cache and every
    # stored evaluation): the files, the scale, and for the budget search the budget and the rates.
    sizing_key = json.dumps(
        [scale, budget, seconds_per_set, payload.get("rates"), *(["tiles"] if tiles_first else [])],
        sort_keys=True,
    )
    fingerprint = _fingerprint(files, sizing_key if sized else scale)
    # The description depends only on the task's files and the scale: cache it next to the run dirs.
    cache = work_dir / "describe" / f"{fingerprint}.v{DESCRIBE_VERSION}.json"
    value: dict[str, Any] | None = None
    if cache.exists():
        try:
            value = json.loads(cache.read_text())
        except json.JSONDecodeError:
            value = None
    if value is None:
        value = _describe(payload, work_dir, fingerprint, ref_path, timeout_s, retry=sized)
        if value.get("ok"):
            tmp = cache.with_suffix(f".{os.getpid()}.part")
            tmp.write_text(json.dumps(value))
            tmp.replace(cache)
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
        predicted_set_seconds=float(value.get("predicted_set_seconds") or 0.0),
        larger_config=value.get("larger_config"),
    )
    need = 4 * task.validation_bytes()
    if need > budget:
        shapes = "; ".join(c.describe() for c in task.validation_configs)
        raise TaskError(
            f"task {task_id} is too large to validate on this machine: inputs+outputs are "
            f"{_gib(task.validation_bytes())} ({shapes}); validation needs about {_gib(need)}, "
            f"the budget is {_gib(budget)}. Use a smaller --scale (a factor such as 0.25, or a budget such as "
            "1s) to validate at smaller shapes; the TPU compile still uses the real shapes."
        )
    return task
