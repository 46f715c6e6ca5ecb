"""PyTorch file -> verified JAX task (problem dir), from the agent's side.

The PyTorch file is task code: it is read here only as text (`torch_module.is_kernelbench_source`) and
runs in a sandboxed child (`torch_job.convert_job`, bubblewrap when available) that traces, writes and
verifies the JAX reference. This process writes what the child returned: `reference.py`,
`kernel_task.yaml` (the MaxKernel problem-dir format) and `conversion.json` (the checks, the scales, the
recipes, the versions). A conversion already done for the same file content and toolchain is reused, so a
resumed graph node or a re-run bench does not convert again.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field

from maxkernel.convert.refusals import Refusal
from maxkernel.tools.readback import remove_tree
from maxkernel.tools.sandbox import SandboxedChild, SandboxLimits, fresh_run_dir, task_read_paths

CONVERSION_FILE = "conversion.json"
CONVERT_VERSION = 1
"""Bumped when the written task changes for the same input (a cached conversion is then redone)."""
CHILD_PRELOAD = ("numpy", "jax", "torch")
"""Imported by the child before the sandbox's audit hook is on (PyTorch's import reads its own files)."""
CONVERT_TIMEOUT_S = 600.0
CONVERT_MEMORY_MB = 16_000


class ConversionResult(BaseModel):
    ok: bool
    source_path: str
    task_dir: str | None = Field(None, description="the written problem dir (also when verification failed)")
    task_id: str = ""
    refusal: Refusal | None = None
    kernelbench: bool = False
    tolerance: float | None = None
    checks: list[dict[str, Any]] = Field(default_factory=list)
    scale_note: str = ""
    seconds: float = 0.0
    stage_seconds: dict[str, float] = Field(default_factory=dict)
    versions: dict[str, str] = Field(default_factory=dict)
    source_sha256: str = ""
    cached: bool = False
    infrastructure: bool = Field(
        False, description="the sandbox or the toolchain failed: not the file's fault"
    )

    def message(self) -> str:
        if self.ok:
            n = len(self.checks)
            worst = max((c.get("max_abs_err") or 0.0 for c in self.checks), default=0.0)
            return (
                f"converted {Path(self.source_path).name} -> {self.task_dir} (verified against PyTorch on {n} "
                f"output comparisons, max abs err {worst:.2g}; {self.scale_note})"
            )
        if self.refusal is not None:
            return self.refusal.message()
        return "conversion failed"


def torch_available() -> bool:
    return importlib.util.find_spec("torch") is not None and importlib.util.find_spec("torchax") is not None


MISSING_TORCH = (
    "converting PyTorch needs torch and torchax: pip install -e '.[convert]' (it pins the CPU build of torch)"
)


def source_digest(path: Path, class_name: str | None, draws: int) -> str:
    h = hashlib.sha256(path.read_bytes())
    h.update(f"|{class_name}|{draws}|v{CONVERT_VERSION}".encode())
    return h.hexdigest()


def default_task_dir(path: Path, work_dir: Path) -> Path:
    return work_dir / "converted" / f"{path.stem}-{source_digest(path, None, 3)[:12]}"


def convert_torch_file(
    path: str | Path,
    out_dir: str | Path | None = None,
    *,
    class_name: str | None = None,
    draws: int = 3,
    work_dir: str | Path = ".maxkernel",
    timeout_s: float = CONVERT_TIMEOUT_S,
) -> ConversionResult:
    """Convert a PyTorch file (KernelBench format, or a named module plus `get_inputs`) to a problem dir."""
    path = Path(path).resolve()
    work = Path(work_dir).resolve()
    if not path.is_file():
        return ConversionResult(ok=False, source_path=str(path), refusal=Refusal(
            kind="framework", what=f"{path} (no such file)"))  # fmt: skip
    digest = source_digest(path, class_name, draws)
    dest = Path(out_dir).resolve() if out_dir else default_task_dir(path, work)
    cached = _cached(dest, digest)
    if cached is not None:
        return cached
    if not torch_available():
        return ConversionResult(ok=False, source_path=str(path), infrastructure=True,
                                refusal=Refusal(kind="task_code", what="PyTorch", detail=MISSING_TORCH))  # fmt: skip
    run_dir = fresh_run_dir(work / "convert", path.stem[:40])
    child = SandboxedChild(
        "maxkernel.convert.torch_job:convert_job",
        {"source_path": str(path), "class_name": class_name, "draws": draws},
        run_dir,
        SandboxLimits(timeout_s=timeout_s, memory_mb=CONVERT_MEMORY_MB),
        task_read_paths(path),
        preload=CHILD_PRELOAD,
    )
    child.start()
    outcome = child.wait()
    remove_tree(run_dir)
    if not outcome.ok or outcome.value is None:
        detail = outcome.error or "the conversion child failed"
        machine = outcome.timed_out or _out_of_memory(detail)
        return ConversionResult(
            ok=False, source_path=str(path), infrastructure=outcome.infrastructure or machine,
            refusal=Refusal(kind="machine" if machine else "task_code", what="the conversion", detail=detail[:600]),
        )  # fmt: skip
    return write_task(path, dest, outcome.value, digest)


def _out_of_memory(error: str) -> bool:
    """The child stopped for want of memory (a MemoryError, or killed at the address-space limit)."""
    low = error.lower()
    return "memoryerror" in low or "out of memory" in low or "memory limit" in low or "bad_alloc" in low


def _cached(dest: Path, digest: str) -> ConversionResult | None:
    record = dest / CONVERSION_FILE
    if not record.is_file():
        return None
    try:
        data = json.loads(record.read_text())
        result = ConversionResult.model_validate(data["result"])
    except (json.JSONDecodeError, KeyError, ValueError):
        return None
    if result.source_sha256 != digest or not (dest / "reference.py").is_file():
        return None
    return result.model_copy(update={"cached": True})


def task_id_for(path: Path) -> str:
    from maxkernel.tools.tasks import safe_task_id

    return safe_task_id(path.stem)


def write_task(path: Path, dest: Path, value: dict[str, Any], digest: str) -> ConversionResult:
    """Write the problem dir from the child's (untrusted-size, plain-data) answer."""
    refusal = Refusal.model_validate(value["refusal"]) if value.get("refusal") else None
    result = ConversionResult(
        ok=bool(value.get("ok")),
        source_path=str(path),
        task_id=task_id_for(path),
        refusal=refusal,
        kernelbench=bool(value.get("kernelbench")),
        tolerance=value.get("tolerance"),
        checks=list(value.get("checks") or [])[:200],
        scale_note=str(value.get("scale_note") or ""),
        seconds=float(value.get("seconds") or 0.0),
        stage_seconds=dict(value.get("stage_seconds") or {}),
        versions=dict(value.get("versions") or {}),
        source_sha256=digest,
    )
    source = value.get("reference_source")
    if not isinstance(source, str):
        return result  # refused before a reference was written
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "reference.py").write_text(source)
    result.task_dir = str(dest)
    tol = float(value.get("tolerance") or 1e-3)
    meta = {
        "task_id": result.task_id,
        "description": _description(path, value),
        "category": "kernelbench" if result.kernelbench else "pytorch",
        "atol": tol,
        "rtol": tol,
        "source": str(path),
    }
    (dest / "kernel_task.yaml").write_text(yaml.safe_dump(meta, sort_keys=False, width=110))
    record = {
        "result": result.model_dump(mode="json"),
        "scales": value.get("scales"),
        "recipes": value.get("recipes"),
        "input_names": value.get("input_names"),
        "state_names": value.get("state_names"),
        "state_keys": value.get("state_keys"),
        "static_args": value.get("static_args"),
        "own_bytes": value.get("own_bytes"),
        "cpu_bytes": value.get("cpu_bytes"),
    }
    (dest / CONVERSION_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return result


def _description(path: Path, value: dict[str, Any]) -> str:
    kind = "KernelBench task" if value.get("kernelbench") else "PyTorch module"
    names = ", ".join(value.get("input_names") or [])
    weights = len(value.get("state_names") or [])
    return (
        f"{path.name} ({kind}) converted to JAX: inputs {names or 'none'} and {weights} weight(s) as arguments; "
        f"{value.get('scale_note', '')}."
    )
