"""What a file given as a task is, read as text (never run): a JAX task, PyTorch, Triton, CUDA."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from maxkernel.convert.torch_module import defines

SourceKind = Literal["task", "pytorch", "triton", "cuda", "unknown"]

CUDA_SUFFIXES = (".cu", ".cuh")
_TRITON = re.compile(r"^\s*(import triton|from triton\b)|@triton\.jit", re.M)
_TORCH = re.compile(r"^\s*(import torch|from torch\b)", re.M)
_CUDA = re.compile(r"__global__|<<<|cudaMalloc|load_inline\(", re.M)


def source_kind(path: str | Path) -> SourceKind:
    p = Path(path)
    if p.is_dir():
        return "task"  # a problem dir or a JAXBench workload: the task loader says more
    if p.suffix in CUDA_SUFFIXES:
        return "cuda"
    if p.suffix != ".py" or not p.is_file():
        return "unknown"
    try:
        text = p.read_text(errors="replace")
    except OSError:
        return "unknown"
    if _TRITON.search(text):
        return "triton"
    try:
        names = defines(text)
    except SyntaxError:
        return "unknown"
    if "computation" in names or {"create_inputs", "workload"} <= names:
        return "task"
    if _TORCH.search(text):
        return "cuda" if _CUDA.search(text) else "pytorch"
    return "task"
