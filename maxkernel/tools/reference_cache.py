"""Reference work done once per task instead of once per candidate, and why each piece is safe.

An evaluation's judge repeats, for every candidate of a task, work that does not depend on the candidate
nor on the evaluation's secret. What is cached, where, and what is deliberately not:

* **The task's own input sets** (input set 0 of each validation config, origin "task": what the task's
  `get_inputs` returns). On the bundled task this is the judge's largest cost (~2 s of eager `jax.random`
  op-by-op compiles in a fresh process, against ~0.15 s for the reference itself). They are a
  deterministic function of the task's files and the toolchain, and they are *not secret*: any candidate
  that knows the task can compute them, which is why every evaluation also runs fresh draws from the
  per-evaluation secret. Caching them gives a candidate nothing it could not already compute. They are
  kept by `TaskInputCache`, in the agent's memory only, keyed by the task's fingerprint (a hash of its
  files and validation scale) and the toolchain versions; the judge receives them as a file the agent
  writes into the judge's own run dir (mode 0700, hidden from the candidate's sandbox) before the judge
  starts. Nothing is on disk between evaluations, so no candidate can poison them for the next one (that
  matters: the secret draws follow the statistics of these sets; a poisoned set 0 of zeros would make
  every draw zeros). A changed task has another fingerprint, hence another key.
* **The compiler's estimate of the reference** (`estimate_xla`, the TPU cost model, ~2.5 s): one number
  per (task fingerprint, generation, toolchain), kept in the results store (`ResultsStore.
  get_reference_estimate`) and, for evaluations without a store (which recomputed it every time), in
  `REFERENCE_ESTIMATES` in the agent's memory; written only by the agent from the judge's signed result.
  It does not depend on any input, secret or not.
* **Not cached: the reference's outputs.** Expected outputs on the secret draws are different for every
  evaluation by construction; caching them across candidates would need fixed draws, which a candidate
  could then learn and persist (through its outputs, its timing, a store it can influence) and replay.
  The outputs on set 0 could be cached like the set itself, but cost one reference run (milliseconds
  once the reference is compiled, which the secret sets need anyway): not worth a second cache.
* **Not cached: anything of the candidate's** (traces, executables, exports): untrusted, per candidate.
"""

from __future__ import annotations

import io
import json
import threading
from collections import OrderedDict

import numpy as np

from maxkernel.tools import taskcode
from maxkernel.tools.candidate import input_name
from maxkernel.tools.results import np_dtype
from maxkernel.tools.store import sha256_text, toolchain_versions
from maxkernel.tools.tasks import KernelTask

TASK_INPUTS_FILE = "task_inputs.npz"
"""In the judge's run dir: the cached task inputs, written by the agent before the judge starts."""
MAX_CACHED_BYTES = 512 << 20
"""The cache's memory bound in the agent, all tasks together; least recently used entries go first."""


def task_inputs_key(task: KernelTask) -> str:
    """Everything the task's own inputs depend on: the task's content (fingerprint) and the toolchain
    (`jax.random`'s bits are versioned with jax)."""
    return sha256_text(json.dumps(["task inputs", task.fingerprint, toolchain_versions()]))


class TaskInputCache:
    """The task's own input sets (set 0 of each validation config) as .npz bytes, in this process only."""

    def __init__(self, max_bytes: int = MAX_CACHED_BYTES) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()  # the agent may evaluate in threads (cluster runner, parallel nodes)

    def get(self, task: KernelTask) -> bytes | None:
        key = task_inputs_key(task)
        with self._lock:
            blob = self._entries.get(key)
            if blob is not None:
                self._entries.move_to_end(key)
            return blob

    def learn(self, task: KernelTask, inputs_npz: bytes, origins: object) -> bool:
        """Keep the task's own sets out of a finished evaluation's inputs (the judge's `inputs.npz`, read by
        the agent before the candidate saw it; `origins` from the judge's signed result). Only sets the
        judge labelled "task", with exactly the validation configs' shapes and dtypes, are kept. Returns
        whether anything was kept."""
        if task.validation_mode not in taskcode.OWN_INPUT_MODES or not isinstance(origins, list):
            return False  # shrunk shapes: set 0 is a secret draw like the others
        if len(origins) != len(task.validation_configs):
            return False
        if not all(isinstance(o, list) and o[:1] == ["task"] for o in origins):
            return False
        keep: dict[str, np.ndarray] = {}
        try:
            with np.load(io.BytesIO(inputs_npz), allow_pickle=False) as z:
                for ci, cfg in enumerate(task.validation_configs):
                    for k, spec in enumerate(cfg.dynamic):
                        name = input_name(ci, 0, k)
                        arr = z[name]
                        raw = np.dtype(np.uint16) if spec.dtype == "bfloat16" else np_dtype(spec.dtype)
                        if arr.dtype != raw or tuple(arr.shape) != tuple(spec.shape):
                            return False
                        keep[name] = arr
        except (KeyError, ValueError, OSError):
            return False
        buf = io.BytesIO()
        np.savez(buf, **keep)
        blob = buf.getvalue()
        if len(blob) > self.max_bytes:
            return False
        key = task_inputs_key(task)
        with self._lock:
            self._entries[key] = blob
            self._entries.move_to_end(key)
            while sum(len(b) for b in self._entries.values()) > self.max_bytes:
                self._entries.popitem(last=False)
        return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


TASK_INPUTS = TaskInputCache()
"""The agent process's cache (one per process: a Ray worker has its own)."""


class ReferenceEstimates:
    """The compiler's estimate of each task's reference, per generation, in this process only: what the
    results store keeps across processes, for the evaluations that run without one."""

    def __init__(self) -> None:
        self._values: dict[str, float] = {}
        self._lock = threading.Lock()

    @staticmethod
    def key(task: KernelTask, gen: str) -> str:
        return sha256_text(json.dumps(["reference estimate", task.fingerprint, gen, toolchain_versions()]))

    def get(self, task: KernelTask, gen: str) -> float | None:
        with self._lock:
            return self._values.get(self.key(task, gen))

    def put(self, task: KernelTask, gen: str, seconds: float) -> None:
        with self._lock:
            self._values[self.key(task, gen)] = float(seconds)


REFERENCE_ESTIMATES = ReferenceEstimates()
