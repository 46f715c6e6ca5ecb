"""Evaluations on a Ray cluster: the harness's evaluation job as a Ray task, and bounded fan-out over it.

```
driver (this process: the store, the graph, the CLI)            Ray worker (any machine of the cluster)
  evaluate() ─ store miss ─► RayRunner.run(job) ──── task ────►  evaluate_on_worker(job, task bundle, source)
     ▲                         task bundle, source:                 materialise the task folder (by sha256)
     │                         ray.put(bytes) keyed by sha256       harness.run_job: both sandboxed children,
     └── store.put_evaluation ◄───────── EvalResult (JSON) ◄──────   the verdict decided by the harness there
```

Why this shape:
- **The same job as locally.** A worker runs `harness.run_job`, the function this process runs without a
  cluster: the sandbox, the judge and the candidate child are exactly as on one machine, and the verdict is
  decided by the harness's trusted code in the worker process, never by a candidate. Workers return results;
  only the driver writes the results store, under the evaluation's content key, so a retried task can
  never add a second row (the key is the same, the write is an upsert).
- **Content-addressed objects.** A candidate's source and a task's folder (the reference and its siblings,
  as a tar) are put into Ray's object store once per driver, keyed by their sha256; a worker unpacks a
  task folder once per digest. Remote machines need no shared file system, only the same maxkernel, jax
  and libtpu (checked: a worker with other versions returns an infrastructure failure, never stored).
- **Devices.** Evaluations that may time on a device ask for `{"TPU": 1}` (or one GPU) when the cluster
  has such a resource, so Ray runs one at a time per device; everything else asks for one CPU.
- **Failures.** A worker that dies mid-evaluation is retried by Ray (`EVAL_RETRIES`); a retry that dies
  too is an `infrastructure` result (returned, never stored). Ctrl-C or SIGTERM (the CLI's handlers call
  `cancel_all`) cancels every evaluation in flight with `ray.cancel(force=True)`, which kills the worker
  process; its sandboxed children die with it (the reaper's parent-death signal, bubblewrap's
  --die-with-parent). A driver killed with SIGKILL leaves its tasks to Ray, which kills the workers of a
  job whose driver is gone (both tested in tests/test_cluster.py).
- **Bad addresses.** An address that does not answer is a `ClusterError` after a bounded wait (a TCP probe,
  then `ray.init` under a deadline): the CLI turns it into exit 2, never a hang.

`ray` is an optional extra (`pip install "maxkernel[ray]"`); nothing here imports it until a cluster is
asked for. This module imports neither langgraph nor langchain (tools/ rule).
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import shutil
import socket
import tarfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar

from maxkernel.tools.harness import EvalJob, EvalOptions, run_job
from maxkernel.tools.results import EvalResult, StageError
from maxkernel.tools.sandbox import task_read_paths
from maxkernel.tools.store import toolchain_versions
from maxkernel.tools.tasks import KernelTask

log = logging.getLogger("maxkernel.cluster")

RAY_ADDRESS_ENV = "MAXKERNEL_RAY_ADDRESS"
"""Read by the CLI only (tools take the address as an argument)."""
LOCAL_ADDRESS = "auto"
"""`--ray auto`: start an embedded Ray instance on this machine (its workers are local processes)."""
CONNECT_TIMEOUT_S = 15.0
"""How long an address may take to answer (TCP probe, then `ray.init`) before it is a usage error."""
EVAL_RETRIES = 1
"""Ray re-runs an evaluation whose worker died this many times (an exception inside it is a result)."""
MAX_TASK_BUNDLE_BYTES = 64 << 20
"""A task folder larger than this is not shipped whole: only the reference file and its yaml go."""
OBJECT_CACHE_ENTRIES = 256
"""Content-addressed objects a driver keeps referenced (LRU): enough for a search's candidates."""
BUNDLE_SKIP = ("__pycache__", ".git", ".venv", ".maxkernel", "out", "checkpoints")
"""Folder names never shipped with a task (caches, outputs, environments)."""

DEVICE_PLACEMENTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("TPU", {"resources": {"TPU": 1}}),
    ("GPU", {"num_gpus": 1}),
)
"""Which cluster resource a timed evaluation asks for, first present wins: one evaluation per device at a
time (a TPU is held by one process). Add an accelerator kind here."""
CPU_PLACEMENT: dict[str, Any] = {"num_cpus": 1}


class ClusterError(Exception):
    """No usable Ray cluster at the address (unreachable, not Ray, Ray not installed). CLI exit 2."""


class EvaluationCancelled(Exception):
    """The evaluation was cancelled (Ctrl-C, SIGTERM, driver exit): its remote work was killed."""


# --- connecting -------------------------------------------------------------------------------------------


@dataclass
class Cluster:
    """The Ray cluster this process is connected to (one per process: `ray.init` is process-wide)."""

    requested: str
    address: str = field(metadata={"description": "the GCS address other drivers connect to"})
    embedded: bool

    def resources(self) -> dict[str, float]:
        import ray

        return {k: float(v) for k, v in ray.cluster_resources().items()}

    def capacity(self) -> int:
        """Evaluations that can run at once: one per CPU of the cluster."""
        return max(1, int(self.resources().get("CPU", 1)))


_LOCK = threading.Lock()
_CURRENT: list[Cluster] = []


def ray_available() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


def parse_address(address: str) -> tuple[str, int]:
    """host and port of `HOST:PORT` or `ray://HOST:PORT`; anything else is a ClusterError."""
    rest = address.removeprefix("ray://")
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ClusterError(
            f"--ray takes 'auto' or a Ray address HOST:PORT (e.g. 10.0.0.5:6379, what `ray start --head` "
            f"prints), not {address!r}"
        )
    return host.strip("[]"), int(port)


def probe(host: str, port: int, timeout_s: float) -> None:
    """A TCP connect to the head: a closed port or a dead host fails here in seconds, not in Ray's minutes."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as exc:
        raise ClusterError(
            f"no Ray cluster at {host}:{port}: {exc.strerror or exc} (is `ray start --head` running there, "
            f"and is the port open from here?)"
        ) from exc


def connect(address: str, *, timeout_s: float = CONNECT_TIMEOUT_S, num_cpus: int | None = None) -> Cluster:
    """Connect this process to a Ray cluster once (`auto`: start an embedded one with `num_cpus` workers'
    worth of CPUs, default all). Raises ClusterError, after at most about `timeout_s`, when it cannot."""
    with _LOCK:
        if _CURRENT:
            current = _CURRENT[0]
            if address in (current.requested, current.address):
                return current
            raise ClusterError(f"already connected to Ray at {current.address}; one cluster per process")
        try:
            import ray
        except ImportError as exc:
            raise ClusterError(
                'Ray is not installed: pip install "maxkernel[ray]" (or "ray[default]")'
            ) from exc
        if ray.is_initialized():  # a caller (a test, a notebook) connected already: use that cluster
            cluster = Cluster(requested=address, address=_gcs_address(), embedded=False)
        elif address == LOCAL_ADDRESS:
            if threading.current_thread() is not threading.main_thread():
                raise ClusterError(
                    "an embedded Ray instance ('auto') starts from a process's main thread (a server's "
                    "worker thread would take it down when it ends): start one with `ray start --head` "
                    "and give its HOST:PORT"
                )
            # In the calling thread: the processes Ray starts here die with the thread that forked them
            # (parent-death signal), so a helper thread would take the instance down when it ends.
            try:
                ray.init(namespace="maxkernel", configure_logging=False, num_cpus=num_cpus,
                         include_dashboard=False, log_to_driver=False)  # fmt: skip
            except Exception as exc:
                raise ClusterError(
                    f"cannot start an embedded Ray instance: {type(exc).__name__}: {exc}"
                ) from exc
            cluster = Cluster(requested=address, address=_gcs_address(), embedded=True)
        else:
            host, port = parse_address(address)
            probe(host, port, timeout_s)
            _init_bounded({"address": address, "log_to_driver": False}, timeout_s, f"Ray at {address}")
            cluster = Cluster(requested=address, address=_gcs_address(), embedded=False)
        _CURRENT.append(cluster)
        log.info("ray: connected to %s (%s)", cluster.address, "embedded" if cluster.embedded else "cluster")
        return cluster


def current() -> Cluster | None:
    return _CURRENT[0] if _CURRENT else None


def disconnect() -> None:
    """Cancel what runs and leave the cluster (an embedded instance stops)."""
    with _LOCK:
        if not _CURRENT:
            return
        cancel_all()
        import ray

        ray.shutdown()
        _CURRENT.clear()
        _RUNNERS.clear()


def _gcs_address() -> str:
    import ray

    return str(ray.get_runtime_context().gcs_address)


def _init_bounded(kwargs: dict[str, Any], timeout_s: float, what: str) -> None:
    """`ray.init` of an existing cluster under a deadline: Ray itself retries an unanswering GCS for
    minutes. (It starts no local process in this mode, so a helper thread is safe.)"""
    import ray

    outcome: list[BaseException | None] = []

    def init() -> None:
        try:
            ray.init(namespace="maxkernel", configure_logging=False, **kwargs)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            outcome.append(exc)

    thread = threading.Thread(target=init, name="maxkernel-ray-init", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        raise ClusterError(f"{what} did not answer within {timeout_s:.0f} s (is it a Ray head's GCS port?)")
    if outcome[0] is not None:
        exc = outcome[0]
        raise ClusterError(f"cannot connect to {what}: {type(exc).__name__}: {str(exc)[:400]}") from exc


# --- content-addressed objects ------------------------------------------------------------------------------


class ObjectCache:
    """sha256 → ObjectRef of those bytes, put once per driver (LRU-bounded so the object store can free)."""

    def __init__(self, entries: int = OBJECT_CACHE_ENTRIES) -> None:
        self._refs: dict[str, Any] = {}
        self._entries = entries
        self._lock = threading.Lock()
        self.puts = 0

    def put(self, data: bytes) -> tuple[str, Any]:
        import ray

        digest = hashlib.sha256(data).hexdigest()
        with self._lock:
            ref = self._refs.pop(digest, None)
            if ref is None:
                ref = ray.put(data)
                self.puts += 1
            self._refs[digest] = ref  # most recent last
            while len(self._refs) > self._entries:
                self._refs.pop(next(iter(self._refs)))
        return digest, ref


def task_bundle(task: KernelTask) -> bytes:
    """The task's files as a deterministic tar: what a sandboxed judge reads of it (`task_read_paths`)."""
    return _bundle(task.reference_path, task.fingerprint)


@lru_cache(maxsize=64)
def _bundle(reference_path: str, fingerprint: str) -> bytes:
    ref = Path(reference_path)
    root = task_read_paths(ref)[0]
    files = [ref] if root == ref else _folder_files(root)
    if sum(f.stat().st_size for f in files) > MAX_TASK_BUNDLE_BYTES:
        log.warning("ray: %s is over %d MiB: shipping only the reference and its yaml",
                    root, MAX_TASK_BUNDLE_BYTES >> 20)  # fmt: skip
        files = [f for f in (ref, ref.parent / "kernel_task.yaml") if f.is_file()]
    base = ref.parent
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for f in sorted(files):
            info = tarfile.TarInfo(str(f.relative_to(base)))
            info.size, info.mode, info.mtime = f.stat().st_size, 0o644, 0
            with open(f, "rb") as fh:
                tar.addfile(info, fh)
    return buf.getvalue()


def _folder_files(root: Path) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in BUNDLE_SKIP and not d.startswith("."))
        out.extend(Path(dirpath) / n for n in filenames if not n.startswith(".") and not n.endswith(".pyc"))
    return [p for p in out if p.is_file() and not p.is_symlink()]


def materialise(root: Path, digest: str, bundle: bytes) -> Path:
    """Unpack a task bundle once per digest under `root/tasks` (atomically: concurrent evaluations of one
    task on one machine race to the same folder); returns the folder the reference sits in."""
    dest = root / "tasks" / digest[:32]
    if dest.is_dir():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(dest.parent, 0o755)
    tmp = dest.parent / f".{digest[:32]}.{uuid.uuid4().hex[:8]}"
    tmp.mkdir(mode=0o755)
    with tarfile.open(fileobj=io.BytesIO(bundle), mode="r") as tar:
        tar.extractall(tmp, filter="data")
    for dirpath, dirnames, _ in os.walk(tmp):
        for d in dirnames:
            os.chmod(Path(dirpath) / d, 0o755)
    try:
        os.rename(tmp, dest)
    except OSError:  # another evaluation unpacked it first: same bytes, keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def relocated(task: KernelTask, folder: Path) -> KernelTask:
    """The same task (same fingerprint) read from the unpacked folder on this worker."""
    ref = Path(task.reference_path)
    path = Path(task.path)
    new_path = folder / path.relative_to(ref.parent) if path.is_relative_to(ref.parent) else folder
    return task.model_copy(update={"reference_path": str(folder / ref.name), "path": str(new_path)})


# --- the remote job -----------------------------------------------------------------------------------------


def worker_root(work_dir: str) -> Path:
    """Where a worker keeps run dirs and unpacked tasks: the driver's work dir when this machine can use it
    (a local cluster, a shared file system), else the worker user's cache."""
    for candidate in (Path(work_dir), Path.home() / ".cache" / "maxkernel-ray"):
        try:
            candidate.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(candidate, os.W_OK | os.X_OK):
            return candidate
    raise RuntimeError(f"no writable work dir on {socket.gethostname()} (tried {work_dir})")


def evaluate_on_worker(job_json: str, task_digest: str, bundle: bytes, source: bytes) -> dict[str, Any]:
    """What a Ray worker runs: one evaluation, exactly as `harness.run_job` runs it without a cluster.

    Object refs passed as top-level arguments arrive here as their bytes. Returns the result as JSON data
    and where it ran; the driver stores it."""
    job = EvalJob.model_validate_json(job_json)
    root = worker_root(job.work_dir)
    task = relocated(job.task, materialise(root, task_digest, bundle))
    job = job.model_copy(update={"task": task, "source": source.decode(), "work_dir": str(root)})
    t0 = time.monotonic()
    result = run_job(job)
    return {
        "result": result.model_dump(mode="json"),
        "versions": toolchain_versions(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "seconds": round(time.monotonic() - t0, 3),
    }


_REMOTE: list[Any] = []


def _remote_evaluate() -> Any:
    if not _REMOTE:
        import ray

        _REMOTE.append(ray.remote(max_retries=EVAL_RETRIES, retry_exceptions=False)(evaluate_on_worker))
    return _REMOTE[0]


def placement(options: EvalOptions, resources: dict[str, float]) -> dict[str, Any]:
    """Ray task options for one evaluation: a device slot when it may time on one, else one CPU."""
    if options.timing:
        for name, opts in DEVICE_PLACEMENTS:
            if resources.get(name, 0) >= 1:
                return {**CPU_PLACEMENT, **opts}
    return dict(CPU_PLACEMENT)


_IN_FLIGHT: dict[Any, str] = {}
_CANCELLED: set[str] = set()
_IN_FLIGHT_LOCK = threading.Lock()


def in_flight() -> int:
    with _IN_FLIGHT_LOCK:
        return len(_IN_FLIGHT)


def cancel_all() -> int:
    """Force-cancel every evaluation this process has in flight (kills the worker processes, hence their
    sandboxed children). Returns how many were cancelled. Safe to call from any thread, or at exit."""
    with _IN_FLIGHT_LOCK:
        refs = list(_IN_FLIGHT)
        _CANCELLED.update(_IN_FLIGHT.values())
    if not refs:
        return 0
    import ray

    for ref in refs:
        try:
            ray.cancel(ref, force=True)
        except Exception as exc:  # noqa: BLE001 - a finished task cannot be cancelled; nothing to do
            log.debug("ray: cancel %s: %s", ref, exc)
    log.warning("ray: cancelled %d evaluation(s) in flight", len(refs))
    return len(refs)


class RayRunner:
    """`harness.EvalRunner` on a Ray cluster: one Ray task per evaluation (see the module docstring)."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.objects = ObjectCache()
        self.submitted = 0
        self.finished = 0

    @property
    def capacity(self) -> int:
        return self.cluster.capacity()

    def run(self, job: EvalJob) -> EvalResult:
        import ray

        task_digest, task_ref = self.objects.put(task_bundle(job.task))
        _, source_ref = self.objects.put(job.source.encode())
        meta = job.model_copy(update={"source": ""}).model_dump_json()
        opts = placement(job.options, self.cluster.resources())
        ref = _remote_evaluate().options(**opts).remote(meta, task_digest, task_ref, source_ref)
        with _IN_FLIGHT_LOCK:
            _IN_FLIGHT[ref] = job.key
            self.submitted += 1
            running = len(_IN_FLIGHT)
        log.info("ray: %s [%s] submitted (%d in flight)", job.task.task_id, job.key[:10], running)
        try:
            data = ray.get(ref)
        except ray.exceptions.RayError as exc:
            with _IN_FLIGHT_LOCK:
                cancelled = job.key in _CANCELLED
                _CANCELLED.discard(job.key)
            if cancelled or isinstance(exc, ray.exceptions.TaskCancelledError):
                raise EvaluationCancelled(f"evaluation {job.key[:10]} was cancelled") from exc
            return _infrastructure(job, f"the Ray task failed after {EVAL_RETRIES} retry: "
                                        f"{type(exc).__name__}: {str(exc)[:800]}")  # fmt: skip
        finally:
            with _IN_FLIGHT_LOCK:
                _IN_FLIGHT.pop(ref, None)
                self.finished += 1
        if data.get("versions") != toolchain_versions():
            return _infrastructure(job, f"worker {data.get('host')} runs {data.get('versions')}, this driver "
                                        f"{toolchain_versions()}: install the same jax/jaxlib/libtpu and maxkernel there")  # fmt: skip
        result = EvalResult.model_validate(data["result"])
        log.info("ray: %s [%s] done on %s pid %s in %.1f s: %s", job.task.task_id, job.key[:10],
                 data.get("host"), data.get("pid"), data.get("seconds", 0.0),
                 "accepted" if result.accepted else (result.error.stage if result.error else "rejected"))  # fmt: skip
        return result


def _infrastructure(job: EvalJob, message: str) -> EvalResult:
    """Not the candidate's fault: returned to the caller, never stored (STAGE_INFO says so)."""
    result = EvalResult(task_id=job.task.task_id, source_hash=hashlib.sha256(job.source.encode()).hexdigest())
    result.error = StageError(stage="infrastructure", message=message)
    result.accepted = False
    return result


_RUNNERS: dict[str, RayRunner] = {}


def runner_for(address: str | None) -> RayRunner | None:
    """The runner for a configured address (connecting once per process), or None: run locally."""
    if not address:
        return None
    cluster = connect(address)
    with _LOCK:
        if cluster.address not in _RUNNERS:
            _RUNNERS[cluster.address] = RayRunner(cluster)
        return _RUNNERS[cluster.address]


# --- bounded fan-out ----------------------------------------------------------------------------------------

T = TypeVar("T")
R = TypeVar("R")


def bounded_map(
    fn: Callable[[T], R],
    items: Sequence[T],
    limit: int,
    *,
    label: str = "evaluations",
    say: Callable[[str], None] | None = None,
) -> list[R]:
    """`fn` over `items`, at most `limit` at once (back-pressure: the next item starts only when one
    finishes), results in input order, one progress line per finished item. With `limit` 1 it is a plain
    loop in this thread (exactly today's local path). On Ctrl-C or any error, what has not started is
    dropped and what runs remotely is force-cancelled."""
    say = say or log.info
    if limit <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    results: list[Any] = [None] * len(items)
    pool = ThreadPoolExecutor(max_workers=min(limit, len(items)), thread_name_prefix="maxkernel-fanout")
    futures = {pool.submit(fn, x): i for i, x in enumerate(items)}
    try:
        for n, fut in enumerate(as_completed(futures), 1):
            results[futures[fut]] = fut.result()
            say(f"{label}: {n}/{len(items)} done, at most {limit} at once")
    except BaseException:
        for fut in futures:
            fut.cancel()
        cancel_all()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    return results
