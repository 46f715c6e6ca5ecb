"""A JAX reference written by a model (for a CUDA or Triton kernel) as a problem dir, and what checks it.

A CUDA kernel cannot run on this machine, and Triton's interpreter is not part of this install, so the
model's reference cannot be compared with the original here: it is checked for what can be checked (it
loads as a task in the sandbox: `get_inputs` at both scales, `computation` traces, shapes are sane) and
then shown to a human (the `conversion_review` point) before any kernel is written for it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import yaml

from maxkernel.tools.tasks import TaskError, load_task, safe_task_id

MODEL_TASK_TOLERANCE = 1e-3
UNVERIFIABLE = {
    "cuda": "a CUDA kernel cannot run on this machine (no GPU): the JAX reference was not compared with it",
    "triton": "Triton's interpreter is not installed here: the JAX reference was not compared with the kernel",
    "pytorch": "the model's JAX reference for a PyTorch file was not compared with it (use `maxkernel convert` "
    "without --to pallas, which traces the PyTorch code itself)",
}


def model_task_dir(source_path: Path, work_dir: Path, attempt: int) -> Path:
    digest = hashlib.sha256(source_path.read_bytes()).hexdigest()[:12]
    return work_dir / "converted" / f"{source_path.stem}-{digest}-model{attempt}"


def write_model_task(source_path: Path, module_source: str, framework: str, dest: Path, writer: str) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "reference.py").write_text(module_source)
    meta = {
        "task_id": safe_task_id(source_path.stem),
        "description": f"{source_path.name} ({framework}) rewritten in JAX by {writer}; not compared with the "
        "original on this machine (reviewed by a human in hitl mode)",
        "category": framework,
        "atol": MODEL_TASK_TOLERANCE,
        "rtol": MODEL_TASK_TOLERANCE,
        "source": str(source_path),
    }
    (dest / "kernel_task.yaml").write_text(yaml.safe_dump(meta, sort_keys=False, width=110))
    return dest


def check_loads(task_dir: Path, work_dir: Path) -> str | None:
    """None when the written reference loads as a task (sandboxed); else the loader's message."""
    try:
        load_task(task_dir, work_dir=work_dir)
    except TaskError as exc:
        return str(exc)
    return None
