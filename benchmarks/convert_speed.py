"""How long `maxkernel convert` takes on small PyTorch model files (the issue's goal: under a minute on 2 cores).

    python benchmarks/convert_speed.py [FILE[:CLASS] ...]

Default files: tests/data/pytorch/mlp_block.py (a transformer MLP block) and attention.py:SelfAttention (a
causal self-attention layer). Each is converted from scratch (a fresh work dir: no cached conversion) through
the same sandboxed path as the CLI; prints the wall time, the child's own stage times and the machine's load
average (this machine is shared: a load above the core count stretches every figure).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from maxkernel.convert import convert_torch_file

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = [f"{ROOT}/tests/data/pytorch/mlp_block.py", f"{ROOT}/tests/data/pytorch/attention.py:SelfAttention"]


def main() -> None:
    for spec in sys.argv[1:] or DEFAULT:
        path, _, cls = spec.partition(":")
        with tempfile.TemporaryDirectory() as tmp:
            load = os.getloadavg()[0]
            t0 = time.monotonic()
            r = convert_torch_file(
                path, Path(tmp) / "task", class_name=cls or None, work_dir=Path(tmp) / "work"
            )
            wall = time.monotonic() - t0
        stages = ", ".join(f"{k} {v:.1f}s" for k, v in r.stage_seconds.items())
        print(f"{Path(path).name}{':' + cls if cls else ''}: {'verified' if r.ok else 'FAILED ' + r.message()[:200]} "
              f"in {wall:.1f} s wall (child {r.seconds:.1f} s: {stages}); load average at start {load:.1f} "
              f"on {os.cpu_count()} cores")  # fmt: skip


if __name__ == "__main__":
    main()
