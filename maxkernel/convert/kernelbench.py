"""KernelBench read as it is: its task files, its levels, and its metric.

A KernelBench task is a `.py` defining `class Model(nn.Module)`, `get_inputs()` and `get_init_inputs()`;
a level is a folder of them (`KernelBench/level1`). Files are recognised by reading them as text, never
by running them. The metric is KernelBench's own `fast_p`: the fraction of ALL the level's tasks that are
correct and faster than the baseline by more than p (fast_0 = correct). Here "faster" is our estimated TPU
speedup over XLA (no TPU on this machine), so every fast_p this module computes is labelled estimated.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from maxkernel.convert.torch_module import is_kernelbench_source

FAST_P = (0.0, 1.0, 1.5, 2.0)
"""The p values KernelBench reports."""


def is_kernelbench_file(path: Path) -> bool:
    if path.suffix != ".py" or not path.is_file():
        return False
    try:
        return is_kernelbench_source(path.read_text(errors="replace"))
    except OSError:
        return False


def _order(path: Path) -> tuple[int, str]:
    m = re.match(r"(\d+)_", path.name)
    return (int(m.group(1)) if m else 1 << 30, path.name)


def level_tasks(folder: Path) -> list[Path]:
    """The KernelBench task files in a folder, in KernelBench's numbering order."""
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.iterdir() if is_kernelbench_file(p)), key=_order)


def is_level_dir(folder: Path) -> bool:
    return bool(level_tasks(folder))


def fast_p(results: Iterable[tuple[bool, float | None]], p: float) -> tuple[int, int]:
    """(count, total) of tasks that are correct and, for p > 0, have a speedup above p. `results` holds one
    (correct, speedup) per task of the level, failed conversions included (they count as not correct)."""
    rows = list(results)
    if p == 0.0:
        hits = sum(1 for ok, _ in rows if ok)
    else:
        hits = sum(1 for ok, s in rows if ok and s is not None and s > p)
    return hits, len(rows)
