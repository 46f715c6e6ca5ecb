"""Evaluations on Ray (tools/cluster.py): same verdict as locally, retried when a worker dies, cancelled
without leftovers, bad addresses refused quickly, bounded fan-out.

One embedded Ray instance (loopback, this machine) is shared by the tests of this module; the tests kill
only processes of that instance, found by PID under its own raylet. Tests that need Ray skip only when the
`ray` extra is absent (CI installs it: `.ci/run`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from maxkernel.tools import cluster
from maxkernel.tools.harness import EvalOptions, evaluate
from maxkernel.tools.store import ResultsStore
from maxkernel.tools.tasks import KernelTask, load_task

CANDIDATES = Path(__file__).parent / "data" / "candidates"
OPTS = EvalOptions(tpu=["v5e"], timeout_s=240)
REPO = Path(__file__).resolve().parents[1]

needs_ray = pytest.mark.skipif(not cluster.ray_available(), reason="the `ray` extra is not installed")


# --- no Ray needed ------------------------------------------------------------------------------------------


def test_bounded_map_keeps_at_most_limit_in_flight_and_the_order() -> None:
    lock, running, peak = threading.Lock(), [0], [0]

    def work(x: int) -> int:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1
        return x * x

    lines: list[str] = []
    assert cluster.bounded_map(work, list(range(9)), 3, say=lines.append) == [x * x for x in range(9)]
    assert peak[0] == 3
    assert len(lines) == 9 and lines[-1].startswith("evaluations: 9/9 done")


def test_bounded_map_stops_on_the_first_error() -> None:
    started: list[int] = []

    def work(x: int) -> int:
        started.append(x)
        time.sleep(0.05)
        if x == 0:
            raise ValueError("boom")
        return x

    with pytest.raises(ValueError, match="boom"):
        cluster.bounded_map(work, list(range(40)), 2, say=lambda _: None)
    time.sleep(0.3)
    assert len(started) < 40  # what had not started was dropped


def test_parse_address_and_placement() -> None:
    assert cluster.parse_address("10.0.0.5:6379") == ("10.0.0.5", 6379)
    assert cluster.parse_address("ray://head:10001") == ("head", 10001)
    for bad in ("localhost", ":80", "host:99999", "host:port"):
        with pytest.raises(cluster.ClusterError, match="HOST:PORT"):
            cluster.parse_address(bad)
    timed, untimed = EvalOptions(tpu=["v5e"]), EvalOptions(tpu=["v5e"], timing=False)
    assert cluster.placement(timed, {"CPU": 8, "TPU": 4}) == {"num_cpus": 1, "resources": {"TPU": 1}}
    assert cluster.placement(timed, {"CPU": 8, "GPU": 1}) == {"num_cpus": 1, "num_gpus": 1}
    assert cluster.placement(untimed, {"CPU": 8, "TPU": 4}) == {"num_cpus": 1}
    assert cluster.placement(timed, {"CPU": 8}) == {"num_cpus": 1}


def test_task_bundle_round_trips_to_the_same_task(data_dir: Path, tmp_path: Path) -> None:
    src = data_dir / "tasks" / "small_matmul"
    task = KernelTask.model_validate(
        {"task_id": "t", "format": "maxkernel", "path": str(src), "reference_path": str(src / "reference.py"),
         "fingerprint": "f" * 64, "configs": [], "validation_configs": [], "validation_mode": "task"}
    )  # fmt: skip
    bundle = cluster.task_bundle(task)
    assert bundle == cluster.task_bundle(task)  # deterministic: one content address per task
    digest = "ab" * 32
    folder = cluster.materialise(tmp_path, digest, bundle)
    assert cluster.materialise(tmp_path, digest, bundle) == folder  # unpacked once per digest
    moved = cluster.relocated(task, folder)
    assert Path(moved.reference_path).read_bytes() == (src / "reference.py").read_bytes()
    assert Path(moved.path) == folder and moved.fingerprint == task.fingerprint
    assert (folder / "kernel_task.yaml").read_bytes() == (src / "kernel_task.yaml").read_bytes()


def test_bench_hands_the_cluster_to_every_task_process(tmp_path: Path) -> None:
    from maxkernel.bench import Bench, BenchSettings

    bench = Bench(
        BenchSettings(suite=str(tmp_path), out_dir=str(tmp_path / "out"), ray_address="10.0.0.5:6379")
    )
    cmd = bench._command(tmp_path / "t", "th", tmp_path / "o")
    assert cmd[cmd.index("--ray") + 1] == "10.0.0.5:6379"
    plain = Bench(BenchSettings(suite=str(tmp_path), out_dir=str(tmp_path / "out2")))
    assert "--ray" not in plain._command(tmp_path / "t", "th", tmp_path / "o")


@needs_ray
def test_auto_refuses_to_start_from_a_worker_thread() -> None:
    if cluster.current() is not None:
        pytest.skip("this process is connected already")
    box: dict[str, BaseException] = {}

    def start() -> None:
        try:
            cluster.connect(cluster.LOCAL_ADDRESS)
        except cluster.ClusterError as exc:
            box["e"] = exc

    t = threading.Thread(target=start)
    t.start()
    t.join(30)
    assert "main thread" in str(box.get("e")) and cluster.current() is None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _maxkernel(
    *args: str, env: dict[str, str] | None = None, timeout: float = 240
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "maxkernel.cli", *args],
        capture_output=True, text=True, timeout=timeout, cwd=REPO, env={**os.environ, **(env or {})},
    )  # fmt: skip


@needs_ray
def test_unreachable_ray_address_is_exit_2_quickly(data_dir: Path, tmp_path: Path) -> None:
    task, kernel = data_dir / "tasks" / "small_matmul", CANDIDATES / "good_matmul.py"
    port = _free_port()  # nothing listens there
    t0 = time.monotonic()
    r = _maxkernel("eval", str(task), str(kernel), "--work-dir", str(tmp_path), "--ray", f"127.0.0.1:{port}")
    assert r.returncode == 2, r.stderr
    assert "no Ray cluster at 127.0.0.1" in r.stderr and "Traceback" not in r.stderr
    # The environment variable is the same setting; a port that answers but is not Ray is refused too,
    # within the connect timeout rather than Ray's own minutes of retries.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        r2 = _maxkernel("eval", str(task), str(kernel), "--work-dir", str(tmp_path),
                        env={cluster.RAY_ADDRESS_ENV: f"127.0.0.1:{listener.getsockname()[1]}"})  # fmt: skip
    assert r2.returncode == 2, r2.stderr
    assert "Ray at 127.0.0.1" in r2.stderr and "Traceback" not in r2.stderr
    assert time.monotonic() - t0 < 2 * 240  # bounded by the subprocess timeout: never a hang


# --- one embedded Ray instance for the rest -----------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster() -> cluster.Cluster:
    if not cluster.ray_available():
        pytest.skip("the `ray` extra is not installed")
    c = cluster.connect(cluster.LOCAL_ADDRESS, num_cpus=2)
    yield c
    cluster.disconnect()


@pytest.fixture(scope="module")
def matmul_task(data_dir: Path, session_work: Path) -> KernelTask:
    return load_task(data_dir / "tasks" / "small_matmul", work_dir=session_work)


def _raylet_pid() -> int:
    import ray

    node = ray._private.worker._global_node  # our own instance's raylet: we only touch its children
    return int(node.all_processes["raylet"][0].process.pid)


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for child in _children(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _busy_worker(timeout: float = 180) -> tuple[int, list[int]]:
    """Our raylet's worker running an evaluation, once its sandboxed children exist: (pid, descendants)."""
    deadline = time.monotonic() + timeout
    raylet = _raylet_pid()
    while time.monotonic() < deadline:
        for pid in _children(raylet):
            if "evaluate_on_worker" in _cmdline(pid):
                kids = _descendants(pid)
                if any("maxkernel.tools.worker" in _cmdline(k) for k in kids):
                    return pid, kids
        time.sleep(0.2)
    raise AssertionError("no worker started the evaluation")


def test_ray_gives_the_same_verdict_as_local(
    ray_cluster: cluster.Cluster, matmul_task: KernelTask, tmp_path: Path
) -> None:
    runner = cluster.runner_for(cluster.LOCAL_ADDRESS)
    assert runner is not None and runner.capacity == 2
    store = ResultsStore(tmp_path / "ray.db")
    for name, verdict in (("good_matmul.py", None), ("no_pallas.py", "pallas")):
        src = (CANDIDATES / name).read_text()
        local = evaluate(matmul_task, src, OPTS, work_dir=tmp_path / "local")
        remote = evaluate(matmul_task, src, OPTS, store=store, work_dir=tmp_path / "ray", runner=runner)
        assert (remote.error.stage if remote.error else None) == verdict, remote.error
        assert remote.isolation == local.isolation
        assert remote.accepted == local.accepted, (name, remote.error, local.error)
        assert (remote.error.stage if remote.error else None) == (local.error.stage if local.error else None)
        assert remote.correct == local.correct and remote.compiled == local.compiled
        assert remote.uses_pallas == local.uses_pallas and not remote.cached
        assert remote.source_hash == local.source_hash
    assert store.count_evaluations("small_matmul") == 2  # the driver stored what the workers returned
    # The task's folder went once as one content-addressed object; each source once.
    assert runner.objects.puts == 3
    again = evaluate(matmul_task, (CANDIDATES / "good_matmul.py").read_text(), OPTS, store=store,
                     work_dir=tmp_path / "ray", runner=runner)  # fmt: skip
    assert again.cached and again.accepted and runner.objects.puts == 3


def test_a_killed_worker_is_retried_once_and_stored_once(
    ray_cluster: cluster.Cluster, matmul_task: KernelTask, tmp_path: Path
) -> None:
    runner = cluster.runner_for(cluster.LOCAL_ADDRESS)
    store = ResultsStore(tmp_path / "retry.db")
    # A correct kernel that takes a few seconds to import: time to find and kill its worker mid-evaluation.
    src = "import time\ntime.sleep(4)\n" + (CANDIDATES / "good_matmul.py").read_text()
    box: dict[str, object] = {}
    t = threading.Thread(
        target=lambda: box.update(
            r=evaluate(matmul_task, src, OPTS, store=store, work_dir=tmp_path, runner=runner)
        )  # fmt: skip
    )
    t.start()
    victim, kids = _busy_worker()
    os.kill(victim, signal.SIGKILL)
    t.join(600)
    assert not t.is_alive()
    r = box["r"]
    assert r.accepted, r.error  # retried on another worker: not lost
    assert store.count_evaluations("small_matmul") == 1  # and not duplicated
    assert len(store.executions("small_matmul")) == 1
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in [victim, *kids]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in [victim, *kids] if _alive(p)]  # the dead worker's sandbox went with it


def test_cancellation_leaves_nothing_running(
    ray_cluster: cluster.Cluster, matmul_task: KernelTask, tmp_path: Path
) -> None:
    runner = cluster.runner_for(cluster.LOCAL_ADDRESS)
    store = ResultsStore(tmp_path / "cancel.db")
    src = (CANDIDATES / "hang.py").read_text()
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["r"] = evaluate(matmul_task, src, OPTS, store=store, work_dir=tmp_path, runner=runner)
        except cluster.EvaluationCancelled as exc:
            box["cancelled"] = exc

    t = threading.Thread(target=run)
    t.start()
    worker, kids = _busy_worker()
    assert cluster.in_flight() == 1
    assert cluster.cancel_all() == 1
    t.join(120)
    assert not t.is_alive() and "cancelled" in box, box
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in [worker, *kids]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in [worker, *kids] if _alive(p)]
    assert cluster.in_flight() == 0 and store.count_evaluations("small_matmul") == 0
    assert not any("evaluate_on_worker" in _cmdline(p) for p in _children(_raylet_pid()))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "kill-9"])
def test_a_stopped_driver_leaves_nothing_running_on_the_workers(
    ray_cluster: cluster.Cluster, data_dir: Path, tmp_path: Path, sig: signal.Signals
) -> None:
    """Another driver (`maxkernel eval --ray ADDRESS`) evaluates a hanging kernel on this cluster; Ctrl-C
    cancels its evaluation (exit 130), and a driver killed outright has its job's workers killed by Ray."""
    cmd = [sys.executable, "-m", "maxkernel.cli", "eval", str(data_dir / "tasks" / "small_matmul"),
           str(CANDIDATES / "hang.py"), "--tpu", "v5e", "--timeout", "300", "--work-dir", str(tmp_path),
           "--ray", ray_cluster.address]  # fmt: skip
    driver = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        worker, kids = _busy_worker(timeout=300)
        driver.send_signal(sig)
        _, err = driver.communicate(timeout=120)
    finally:
        if driver.poll() is None:
            driver.kill()
    if sig == signal.SIGINT:
        assert driver.returncode == 130, err
        assert "cancelled 1 evaluation" in err
    deadline = time.monotonic() + 60
    while any(_alive(p) for p in [worker, *kids]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [p for p in [worker, *kids] if _alive(p)], [_cmdline(p) for p in [worker, *kids] if _alive(p)]


@pytest.mark.slow  # a whole offline agent round (~100 s on a loaded 2-core machine)
def test_an_agent_round_evaluates_through_ray_and_autotunes_in_parallel(
    ray_cluster: cluster.Cluster, tmp_path: Path
) -> None:
    """One offline round with `ray_address` set: every evaluation (validate, autotune's configs) is a Ray
    task, the configs of the round run at once (2 CPUs), and the store holds one row per kernel."""
    from maxkernel.checkpointing import sqlite_checkpointer
    from maxkernel.context import Context
    from maxkernel.graph.agent import compile_graph

    runner = cluster.runner_for(ray_cluster.requested)
    assert runner is not None
    before = runner.submitted
    lock, active, peak = threading.Lock(), [0], [0]
    original = runner.run

    def watched(job):  # noqa: ANN001, ANN202 - records how many ran at once, then runs the real job
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        try:
            return original(job)
        finally:
            with lock:
                active[0] -= 1

    runner.run = watched  # type: ignore[method-assign]
    try:
        graph = compile_graph(sqlite_checkpointer(tmp_path / "checkpoints.sqlite"))
        ctx = Context(model="offline", tpu=["v5e"], store_path=str(tmp_path / "results.db"),
                      work_dir=str(tmp_path / "w"), ray_address=ray_cluster.requested)  # fmt: skip
        config = {"configurable": {"thread_id": "ray-round"}}
        inputs = {"task_path": str(Path(__file__).parent / "data" / "tasks" / "small_matmul"),
                  "max_iterations": 1, "tune_max_configs": 2, "out_dir": str(tmp_path / "out")}  # fmt: skip
        graph.invoke(inputs, config, context=ctx)
    finally:
        del runner.run
    state = graph.get_state(config).values
    tuned = [a for a in state["attempts"] if a.kind == "tune"]
    assert state["best"] is not None and state["best"].accepted
    assert len(tuned) == 2 and state["tuning"]["evaluated"] == 2
    evaluated = {a.source_hash for a in state["attempts"]}
    assert runner.submitted - before == len(evaluated)  # every evaluation went to Ray, none twice
    assert ResultsStore(tmp_path / "results.db").count_evaluations("small_matmul") == len(evaluated)
    assert peak[0] == 2  # the two configs were in flight together
