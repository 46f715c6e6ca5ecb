"""`maxkernel bench`: run the agent (or a search) over a suite and report like a paper's results table.

A suite is a folder of MaxKernel problem dirs, a JAXBench `benchmark/` folder (or the checkout above it),
or a single task of any format. Where a JAXBench workload has a hand-written kernel (`optimized.py`), it is
evaluated by `maxkernel eval` in the same harness, at the same validation shapes (where it cannot run at
them, at `--scale tiles` shapes that keep its block multiples) and with the same estimator, and the report
sets ours, the hand-written kernel and XLA side by side.

Each task runs as its own `maxkernel optimize` / `maxkernel search` process with a thread id derived from
the output dir and the task, so re-running the same bench skips finished tasks and resumes interrupted
ones from their checkpoints. Results go to `results.db` (sqlite-utils), `results.csv` and `report.md`
with PNG plots. Measured and estimated speedups are separate columns and separate summary lines.
"""

from __future__ import annotations

import csv
import datetime as dt
import fnmatch
import hashlib
import json
import math
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import sqlite_utils
import yaml
from pydantic import BaseModel, Field

from maxkernel.context import OFFLINE_MODEL, AuthorKind, author_kind
from maxkernel.convert import kernelbench
from maxkernel.tools import jaxbench
from maxkernel.tools.readback import bounded_yaml
from maxkernel.tools.results import geomean, ranking_speedup
from maxkernel.tools.tasks import TILES_SCALE
from maxkernel.tools.tpu_specs import DEFAULT_GENERATIONS

TERMINAL = ("succeeded", "failed", "stopped", "error")
DEFAULT_SCALE = "cpu"
"""`--scale`'s default: the task's CPU-scale shapes, else the largest a per-set budget allows."""


class BenchSettings(BaseModel):
    suite: str
    out_dir: str
    model: str = OFFLINE_MODEL
    tasks: str | None = Field(None, description="glob over task ids")
    scale: str = DEFAULT_SCALE
    jobs: int = 1
    tpu: list[str] = Field(default_factory=lambda: list(DEFAULT_GENERATIONS))
    iterations: int = 1
    algorithm: str | None = Field(None, description="None: optimize; parallel/beam: a search per task")
    branches: int = 2
    tune_configs: int = Field(
        1,
        description="autotune configs per round. One: over the 61-task suite a second config beat the first on "
        "2 tasks, by under 1% (estimated), for a third more evaluations (benchmarks/suite_bench_search.md)",
    )
    order_from: str | None = Field(
        None,
        description="a bench output dir (or its results.db) whose per-task seconds order this run longest "
        "first, so the slowest task does not start last and run alone; tasks it lacks go after, in name order",
    )
    task_timeout_s: float = 1800.0
    search_tune_configs: int = Field(
        1,
        description="autotune configs per search-branch round: the branch's transform already picks a config, "
        "and evaluations shared with the single round are store hits, so one more config per branch suffices",
    )
    ray_address: str | None = Field(
        None, description="every task's process evaluates on this Ray cluster (tools/cluster.py)"
    )
    search_below: float = Field(
        1.25,
        description="with an algorithm: every task first gets a single round; the search runs only where that "
        "round is correct and its estimated speedup is below this (where the estimate leaves headroom)",
    )


FAMILIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("attention", "retention", "mla")),
    ("convolutions", ("conv", "patch_embed", "resnet")),
    ("matmul chains", ("matmul", "bmm", "gemm", "gemv", "mlp", "linear", "ragged_dot", "moe")),
    ("norms", ("norm", "softmax", "logsumexp", "cross_entropy")),
    ("elementwise", ("rotary", "elementwise", "gelu", "relu")),
)
"""Report families, matched in order on the task id (the first match wins, so a matmul + layernorm chain is
a matmul chain). Tasks matching none are 'other'."""


def family_of(task_id: str) -> str:
    name = task_id.lower()
    for family, needles in FAMILIES:
        if any(n in name for n in needles):
            return family
    return "other"


class TaskRow(BaseModel):
    task_id: str
    category: str = ""
    family: str = ""
    status: str = "pending"
    compiled: bool = False
    correct: bool = False
    uses_pallas: bool = False
    tpu_compile: dict[str, bool] = Field(default_factory=dict)
    estimated_speedup: float | None = Field(
        None, description="the first TPU generation's estimate (the headline)"
    )
    estimated_speedup_by_generation: dict[str, float | None] = Field(
        default_factory=dict,
        description="estimated speedup per requested TPU generation (estimates, not measured)",
    )
    measured_speedup: float | None = None
    seconds: float | None = None
    iterations: int | None = None
    error: str | None = None
    kernel_path: str | None = None
    thread_id: str = ""
    single_estimated_speedup: float | None = Field(
        None, description="estimated speedup after the single round (before any search)"
    )
    single_estimated_speedup_by_generation: dict[str, float | None] = Field(
        default_factory=dict, description="the single round's estimated speedup per TPU generation"
    )
    searched: bool = False
    search_estimated_speedup: float | None = None
    first_accepted_estimated_speedup: float | None = Field(
        None,
        description="estimated speedup of the task's first accepted kernel (the final one must not be slower)",
    )
    first_accepted_estimated_speedup_by_generation: dict[str, float | None] = Field(
        default_factory=dict, description="the first accepted kernel's estimated speedup per TPU generation"
    )
    verdict: str | None = None
    human_kernel_path: str | None = Field(None, description="the workload's hand-written kernel, if any")
    human_status: str | None = Field(None, description="accepted | rejected | error, from `maxkernel eval`")
    human_correct: bool = False
    human_estimated_speedup: float | None = None
    human_estimated_speedup_by_generation: dict[str, float | None] = Field(default_factory=dict)
    human_measured_speedup: float | None = None
    human_error: str | None = Field(None, description="the harness's message when it was not accepted")
    human_scale_note: str | None = Field(
        None, description="where the hand-written kernel was judged at other shapes than ours, and why"
    )
    human_generations: dict[str, str] = Field(
        default_factory=dict,
        description="per TPU generation, where the hand-written kernel compiles for some targets only: "
        "'accepted' (judged again with those targets alone) or why not",
    )
    converted: bool | None = Field(
        None, description="a PyTorch task: converted to JAX and verified against PyTorch (None: a JAX task)"
    )


def is_task(path: Path) -> bool:
    """A single task of any format: a problem dir, a JAXBench workload dir, or a module."""
    if path.is_dir():
        return (path / "reference.py").exists() or jaxbench.is_workload_dir(path)
    return path.suffix == ".py" and path.is_file()


def task_name(task: Path) -> str:
    """The id a task is reported under: its dir name, a workload's dir name, or a bare module's stem."""
    if task.is_dir():
        return task.name
    return jaxbench.task_id(task) if jaxbench.is_workload_module(task) else task.stem


def discover(suite: Path, pattern: str | None) -> list[Path]:
    if not suite.exists():
        raise FileNotFoundError(f"suite not found: {suite}")
    if is_task(suite):
        tasks = [suite]
    elif kernelbench.is_level_dir(suite):  # KernelBench's task files, read as they are
        tasks = kernelbench.level_tasks(suite)
    else:
        root = jaxbench.suite_root(suite)
        tasks = sorted(p for p in root.iterdir() if p.is_dir() and is_task(p))
        if not tasks:
            raise FileNotFoundError(
                f"no tasks in {suite}: expected problem dirs (reference.py) or JAXBench workload dirs "
                f"({jaxbench.BASELINE_FILE})"
            )
    if pattern:  # one glob, or several separated by commas
        globs = [g.strip() for g in pattern.split(",") if g.strip()]
        tasks = [p for p in tasks if any(fnmatch.fnmatch(task_name(p), g) for g in globs)]
    return tasks


def _category(task_dir: Path) -> str:
    if jaxbench.is_workload_dir(task_dir):
        return str(jaxbench.task_meta(task_dir / jaxbench.BASELINE_FILE)["category"])
    if task_dir.is_file() and kernelbench.is_kernelbench_file(task_dir):
        return f"kernelbench {task_dir.parent.name}"
    if task_dir.is_file():
        return str(jaxbench.task_meta(task_dir)["category"]) if jaxbench.is_workload_module(task_dir) else ""
    meta = task_dir / "kernel_task.yaml"
    if meta.exists():
        try:
            data = bounded_yaml(meta.read_text()) or {}
        except (yaml.YAMLError, ValueError):
            return ""  # the task itself is refused, with the reason, when it is loaded
        return str(data.get("category", "")) if isinstance(data, dict) else ""
    return ""


def thread_for(out_dir: Path, task_id: str) -> str:
    return (
        "bench-"
        + hashlib.sha256(f"{out_dir.resolve()}|{task_id}".encode()).hexdigest()[:10]
        + "-"
        + task_id[:40]
    )


class Bench:
    def __init__(self, settings: BenchSettings, on_progress: Callable[[str], None] = print) -> None:
        self.s = settings
        self.out = Path(settings.out_dir).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.db = sqlite_utils.Database(self.out / "results.db")
        self.say = on_progress
        self.children = Children()  # the task runs in flight, ended with the bench (see Children)

    def _done(self) -> dict[str, dict[str, Any]]:
        if "results" not in self.db.table_names():
            return {}
        return {r["task_id"]: r for r in self.db["results"].rows if r["status"] in TERMINAL}

    def _longest_first(self, todo: list[Path]) -> tuple[list[Path], str]:
        """`todo` ordered by the seconds each task took in `order_from`'s bench (longest first: with several
        jobs the run then ends on short tasks instead of one long one), with what the order came from."""
        if not self.s.order_from:
            return todo, ""
        src = Path(self.s.order_from)
        db_path = src / "results.db" if src.is_dir() else src
        if not db_path.is_file():
            raise FileNotFoundError(f"--order-from: no bench results at {db_path}")
        past = sqlite_utils.Database(db_path)
        known: dict[str, float] = {}
        for r in past["results"].rows if "results" in past.table_names() else ():
            try:
                secs = float(r.get("seconds"))
            except (TypeError, ValueError):  # no time recorded (a task that never finished)
                continue
            if math.isfinite(secs):
                known[str(r["task_id"])] = secs
        ordered = sorted(todo, key=lambda t: (task_name(t) not in known, -known.get(task_name(t), 0.0)))
        hits = sum(task_name(t) in known for t in todo)
        return ordered, f"longest first by the seconds in {db_path} ({hits} of {len(todo)} tasks timed there)"

    def run(self) -> list[TaskRow]:
        tasks = discover(Path(self.s.suite), self.s.tasks)
        done = self._done()
        todo = [t for t in tasks if task_name(t) not in done]
        todo, order = self._longest_first(todo)
        self.say(
            f"{len(tasks)} tasks, {len(tasks) - len(todo)} already finished, {len(todo)} to run, {self.s.jobs} at a time"
            + (f"; {order}" if order else "")
        )
        started = time.monotonic()
        with _stop_children_on_sigterm(self.children):
            self._run_pool(todo, started)
        rows = self.rows(tasks)
        self.write_outputs(rows, time.monotonic() - started)
        return rows

    def _run_pool(self, todo: list[Path], started: float) -> None:
        finished = 0
        for t in todo:  # only this thread writes results.db (sqlite connections are per thread)
            self.db["results"].upsert(
                _flat(
                    TaskRow(
                        task_id=task_name(t),
                        category=_category(t),
                        family=family_of(task_name(t)),
                        thread_id=thread_for(self.out, task_name(t)),
                        status="running",
                    )
                ),
                pk="task_id",
                alter=True,
            )
        with ThreadPoolExecutor(max_workers=max(1, self.s.jobs)) as pool:
            futures = {pool.submit(self._run_one, t): t for t in todo}
            for fut in as_completed(futures):
                row = fut.result()
                self.db["results"].upsert(_flat(row), pk="task_id", alter=True)
                finished += 1
                elapsed = time.monotonic() - started
                eta = elapsed / finished * (len(todo) - finished)
                perf = _perf_text(row)
                if row.human_status:
                    human_est = row.human_estimated_speedup
                    perf += f"; hand-written kernel {row.human_status}" + (
                        f", estimated {human_est:.2f}x" if human_est is not None else ""
                    )
                self.say(
                    f"[{finished}/{len(todo)}] {row.task_id}: {row.status}"
                    f"{' correct' if row.correct else ''}{perf} in {row.seconds or 0:.0f} s (eta {eta / 60:.1f} min)"
                )

    def rows(self, tasks: list[Path]) -> list[TaskRow]:
        ids = {task_name(t) for t in tasks}
        return [r for r in load_rows(self.out) if r.task_id in ids]

    def _optimize_command(self, task: Path, thread: str, out: Path) -> list[str]:
        """A plain optimize run (the single round of a search bench: one round, whatever --iterations)."""
        iterations = 1 if self.s.algorithm else self.s.iterations
        return [
            sys.executable,
            "-m",
            "maxkernel.cli",
            "optimize",
            str(task),
            *self._common(thread, out, iterations),
        ]

    def _common(self, thread: str, out: Path, iterations: int) -> list[str]:
        return [
            "--model", self.s.model, "--tpu", ",".join(self.s.tpu), "--scale", self.s.scale,
            "--out", str(out), "--thread-id", thread,
            "--checkpoint-db", str(out / "checkpoints.sqlite"),
            "--store", str(self.out / "store.db"), "--work-dir", str(self.out / "work"),
            "--iterations", str(iterations), "--tune-configs", str(self.s.tune_configs),
            *self._no_profile(), *self._ray(),
        ]  # fmt: skip

    def _no_profile(self) -> list[str]:
        """The offline author never reads the profile step's CPU trace (a model does, to reflect): for it
        the trace would only fill each task's report, at ~8% of a bench's time over the suite, so the bench
        skips it."""
        return ["--no-profile"] if author_kind(self.s.model) is AuthorKind.OFFLINE else []

    def _ray(self) -> list[str]:
        return ["--ray", self.s.ray_address] if self.s.ray_address else []

    def _command(self, task: Path, thread: str, out: Path) -> list[str]:
        common = self._common(thread, out, self.s.iterations)
        if self.s.algorithm:
            common[common.index("--tune-configs") + 1] = str(self.s.search_tune_configs)
            return [sys.executable, "-m", "maxkernel.cli", "search", str(task), "--algorithm", self.s.algorithm,
                    "--branches", str(self.s.branches), *common]  # fmt: skip
        return [sys.executable, "-m", "maxkernel.cli", "optimize", str(task), *common]

    def _run_one(self, task: Path) -> TaskRow:
        """Our kernel (see `_run_agent`), then the workload's hand-written kernel where it has one."""
        row = self._run_agent(task)
        human = jaxbench.hand_written_kernel(task)
        if human is not None:
            row = self.run_human(task, human, row, self.out / "tasks" / task_name(task))
        return row

    def _run_agent(self, task: Path) -> TaskRow:
        """Without an algorithm: one optimize run. With one: a single round first (its figure is the
        'single round' column), then the search only where that round left headroom; the task's result is
        the better of the two, so the final kernel is never slower (estimated) than the first accepted."""
        name = task_name(task)
        if not self.s.algorithm:
            return self._run_phase(task, self.out / "tasks" / name, name, search=False)  # its own round 1
        base = self.out / "tasks" / name
        single = self._run_phase(task, base / "single", name, search=False)
        single.single_estimated_speedup = single.estimated_speedup
        single.single_estimated_speedup_by_generation = dict(single.estimated_speedup_by_generation)
        if not single.correct or (single.estimated_speedup or 0.0) >= self.s.search_below:
            return single
        found = self._run_phase(task, base / "search", name + "#search", search=True)
        found.single_estimated_speedup = single.estimated_speedup
        found.single_estimated_speedup_by_generation = dict(single.estimated_speedup_by_generation)
        found.first_accepted_estimated_speedup = single.first_accepted_estimated_speedup
        found.searched = True
        found.search_estimated_speedup = found.estimated_speedup
        found.seconds = round((single.seconds or 0) + (found.seconds or 0), 1)
        if not found.correct or _rank(found) < _rank(single):
            keep = single.model_copy(
                update={"searched": True, "search_estimated_speedup": found.estimated_speedup,
                        "seconds": found.seconds}
            )  # fmt: skip
            return keep
        return found

    def _run_phase(self, task: Path, out: Path, key: str, *, search: bool) -> TaskRow:
        name = task_name(task)
        thread = thread_for(self.out, key)
        row = TaskRow(
            task_id=name, category=_category(task), family=family_of(name), thread_id=thread,
            status="running",
        )  # fmt: skip
        store = self.out / "store.db"
        resuming = False
        if store.exists():
            runs = sqlite_utils.Database(store)
            resuming = "runs" in runs.table_names() and bool(
                list(runs.query("select 1 from runs where thread_id = ?", [thread]))
            )
        if resuming:
            cmd = [
                sys.executable,
                "-m",
                "maxkernel.cli",
                "resume",
                thread,
                "--store",
                str(store),
                *self._ray(),
            ]
        elif search:
            cmd = self._command(task, thread, out)
        else:
            cmd = self._optimize_command(task, thread, out)
        t0 = time.monotonic()
        log = out / "bench.log"
        out.mkdir(parents=True, exist_ok=True)
        try:
            with open(log, "w") as fh:
                proc = self.children.run(
                    cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=self.s.task_timeout_s, env=_env()
                )
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = -1
        row.seconds = round(time.monotonic() - t0, 1)
        return _read_result(row, out, rc, log)

    def run_human(self, task: Path, kernel: Path, row: TaskRow, out: Path) -> TaskRow:
        """Evaluate a workload's hand-written kernel with `maxkernel eval`: the same harness, validation
        shapes, TPU targets and estimator as our own kernel. A rejection is recorded with its message.

        A hand-written kernel is often tuned for one generation (blocks that fit v6e's 32 MiB default scoped
        VMEM but not v5e's 16 MiB, no `vmem_limit_bytes`): where it is correct and compiles for some of the
        targets only, it stays rejected as a kernel for all of them, and is judged again with the targets it
        compiles for, so those generations get its figure (`human_generations` says which and why)."""
        row.human_kernel_path = str(kernel)
        scale = self.s.scale
        proc = self._eval_human(task, kernel, self.s.tpu, out, "", scale)
        if proc is None:
            row.human_status, row.human_error = (
                "error",
                f"maxkernel eval timed out after {self.s.task_timeout_s:.0f} s",
            )
            return row
        untiled = shape_refusal(proc.stdout) if scale == DEFAULT_SCALE else None
        if untiled is not None:
            wider = self._eval_human(task, kernel, self.s.tpu, out, "_tiled", HUMAN_TILE_BUDGET)
            if wider is not None:
                proc, scale = wider, HUMAN_TILE_BUDGET
                row.human_scale_note = (
                    f"judged at `--scale {HUMAN_TILE_BUDGET}` shapes (its block multiples kept): at ours it did "
                    f"not run ({untiled})"
                )
        row = read_human_result(row, proc.returncode, proc.stdout, proc.stderr)
        some = compiled_for_some(proc.stdout, self.s.tpu)
        if some is None:
            return row
        ok, failed = some
        again = self._eval_human(task, kernel, ok, out, "_" + "_".join(ok), scale)
        part = (
            read_human_result(TaskRow(task_id=row.task_id), again.returncode, again.stdout, again.stderr)
            if again
            else None
        )
        row.human_generations = {g: f"does not compile: {why}" for g, why in failed.items()}
        if part is not None and part.human_status == "accepted":
            row.human_generations.update({g: "accepted" for g in ok})
            row.human_estimated_speedup_by_generation.update(part.human_estimated_speedup_by_generation)
        else:
            why = (part.human_error if part is not None else None) or "timed out"
            row.human_generations.update({g: f"not accepted with this target alone: {why}" for g in ok})
        return row

    def _eval_human(
        self, task: Path, kernel: Path, tpu: list[str], out: Path, suffix: str, scale: str
    ) -> subprocess.CompletedProcess[str] | None:
        """One `maxkernel eval --json` of the hand-written kernel for these targets (None: timed out); its
        output lands in `hand_written{suffix}.log` / `hand_written{suffix}_result.json`."""
        cmd = [
            sys.executable, "-m", "maxkernel.cli", "eval", str(task), str(kernel), "--json",
            "--tpu", ",".join(tpu), "--scale", scale,
            "--store", str(self.out / "store.db"), "--work-dir", str(self.out / "work"), *self._ray(),
        ]  # fmt: skip
        try:
            proc = self.children.run(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                timeout=self.s.task_timeout_s,
                env=_env(),
            )
        except subprocess.TimeoutExpired:
            return None
        (out / f"hand_written{suffix}.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
        (out / f"hand_written{suffix}_result.json").write_text(proc.stdout)
        return proc

    def write_outputs(self, rows: list[TaskRow], wall_s: float) -> None:
        with open(self.out / "results.csv", "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(_flat(TaskRow(task_id="x")).keys()))
            writer.writeheader()
            for r in rows:
                writer.writerow(_flat(r))
        plots = make_plots(rows, self.out)
        (self.out / "report.md").write_text(render_report(rows, self.s, wall_s, plots))


def load_rows(out_dir: Path) -> list[TaskRow]:
    """Every task row of a bench output dir's results.db (empty when it has none)."""
    db = sqlite_utils.Database(Path(out_dir) / "results.db")
    if "results" not in db.table_names():
        return []
    return [
        TaskRow.model_validate({**r, **{k: json.loads(r.get(k) or "{}") for k in JSON_COLUMNS}})
        for r in db["results"].rows
    ]


class StoppedError(Exception):
    """The bench is stopping (SIGTERM): no new child run starts."""


class Children:
    """The bench's child runs in flight (one `maxkernel optimize`, `resume` or `eval` per task). Each is
    ended with SIGTERM, never SIGKILL first, so that it ends its own sandboxed jobs on the way out: a child
    killed outright leaves its sandbox's processes running with no parent. A timed-out child gets the same,
    and SIGKILL only after `GRACE_S`."""

    GRACE_S = 30.0

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.procs: set[subprocess.Popen[Any]] = set()
        self.stopping = False

    def run(self, cmd: list[str], *, timeout: float | None, **kw: Any) -> subprocess.CompletedProcess[Any]:
        """`subprocess.run` for one child, registered so that `stop` can end it."""
        with self.lock:
            if self.stopping:
                raise StoppedError("the bench is stopping")
            proc = subprocess.Popen(cmd, **kw)
            self.procs.add(proc)
        try:
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._end(proc)
                proc.communicate()
                raise
        finally:
            with self.lock:
                self.procs.discard(proc)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

    def _end(self, proc: subprocess.Popen[Any]) -> None:
        if proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=self.GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def stop(self) -> None:
        """End every child in flight (SIGTERM, then SIGKILL after the grace period); start no new one."""
        with self.lock:
            self.stopping = True
            procs = list(self.procs)
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + self.GRACE_S
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class _stop_children_on_sigterm:  # noqa: N801 - a context manager used like a function
    """While the bench runs (main thread only): SIGTERM (`kill PID`, a container stop) ends the child runs
    in flight, then exits with 143. Python's default would end the bench alone and leave every child running
    as an orphan. A stopped bench resumes where it was (finished tasks are kept in results.db)."""

    def __init__(self, children: Children) -> None:
        self.children = children
        self.previous: Any = None

    def __enter__(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, frame: Any) -> None:
            self.children.stop()
            raise SystemExit(128 + signum)

        self.previous = signal.signal(signal.SIGTERM, handler)

    def __exit__(self, *exc: object) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)


def _env() -> dict[str, str]:
    import os

    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _read_result(row: TaskRow, out: Path, rc: int, log: Path) -> TaskRow:
    result_path = out / "result.json"
    if not result_path.exists():
        tail = log.read_text(errors="replace").strip().splitlines()[-3:] if log.exists() else []
        row.status = "error"
        row.error = ("timed out" if rc == -1 else f"exit {rc}") + (": " + " | ".join(tail) if tail else "")
        return row
    res = json.loads(result_path.read_text())
    harness = res.get("harness") or {}
    row.status = res.get("status") or ("succeeded" if res.get("correct") else "failed")
    row.correct = bool(res.get("correct"))
    row.compiled = bool(harness.get("compiled"))
    row.uses_pallas = bool(harness.get("uses_pallas"))
    row.tpu_compile = {g: bool(o.get("ok")) for g, o in (harness.get("tpu_compile") or {}).items()}
    est = harness.get("estimate") or {}
    row.estimated_speedup = est.get("estimated_speedup")
    row.estimated_speedup_by_generation = {
        str(g): (e or {}).get("estimated_speedup") for g, e in (est.get("by_generation") or {}).items()
    }
    timing = harness.get("timing") or {}
    row.measured_speedup = timing.get("measured_speedup")
    row.iterations = res.get("iterations")
    row.kernel_path = res.get("kernel_path")
    row.verdict = (res.get("verdict") or {}).get("line")
    if "round_one_best" in res:  # the run's first round: the whole run when it had one round
        one = res.get("round_one_best") or {}
        row.single_estimated_speedup = one.get("estimated_speedup")
        row.single_estimated_speedup_by_generation = dict(one.get("estimated_speedup_by_generation") or {})
    elif (row.iterations or 0) <= 1 and row.correct:  # a result.json written before that field existed
        row.single_estimated_speedup = row.estimated_speedup
        row.single_estimated_speedup_by_generation = dict(row.estimated_speedup_by_generation)
    conversion = res.get("conversion")
    if isinstance(conversion, dict):
        row.converted = bool(conversion.get("verified")) and bool(conversion.get("task_dir"))
    first = res.get("first_accepted") or {}
    row.first_accepted_estimated_speedup = first.get("estimated_speedup")
    row.first_accepted_estimated_speedup_by_generation = dict(
        first.get("estimated_speedup_by_generation") or {}
    )
    if not row.correct:
        row.error = res.get("stop_reason") or (harness.get("error") or {}).get("message")
    return row


HUMAN_TILE_BUDGET = TILES_SCALE
"""The validation scale a hand-written kernel is judged again at when it does not run at the shapes ours
was judged at (`shape_refusal`): hand-written JAXBench kernels tile with blocks up to 2048 wide and raise,
or leave output blocks unwritten, on a sequence the default 4 s budget shrank to 1024. `--scale tiles`
keeps those multiples while batch, heads or other sizes can shrink, in a larger budget."""

SHAPE_STAGES = ("trace", "consistency")
"""Where a kernel whose blocks do not tile the validation shapes stops: its own shape checks raise while it
is traced, or its grid leaves output blocks unwritten."""


def shape_refusal(stdout: str) -> str | None:
    """The first line of an eval's error when it stopped where a kernel stops whose blocks do not tile the
    validation shapes (`SHAPE_STAGES`); None otherwise (accepted, wrong numbers, a compile failure)."""
    try:
        res = json.loads(stdout)
    except json.JSONDecodeError:
        return None
    err = res.get("error") if isinstance(res, dict) else None
    if not isinstance(err, dict) or err.get("stage") not in SHAPE_STAGES:
        return None
    return f"{err.get('stage')}: {_first_line(str(err.get('message') or ''))}"


def compiled_for_some(stdout: str, tpu: list[str]) -> tuple[list[str], dict[str, str]] | None:
    """(the targets it compiled for, {target: why not} for the others) when an eval's kernel was correct and
    failed only at the TPU compile of some of the targets; else None."""
    try:
        res = json.loads(stdout)
    except json.JSONDecodeError:
        return None
    if res.get("accepted") or not res.get("correct") or (res.get("error") or {}).get("stage") != "compile":
        return None
    outcomes = res.get("tpu_compile") or {}
    ok = [g for g in tpu if (outcomes.get(g) or {}).get("ok")]
    failed = {g: _first_line((outcomes.get(g) or {}).get("error") or "") for g in tpu if g not in ok}
    return (ok, failed) if ok and failed else None


def _first_line(text: str) -> str:
    return next((ln.strip() for ln in text.splitlines() if ln.strip()), "")[:200]


def read_human_result(row: TaskRow, rc: int, stdout: str, stderr: str) -> TaskRow:
    """Fill the hand-written columns from `maxkernel eval --json` output (exit 0 accepted, 1 rejected,
    2 task error)."""
    try:
        res = json.loads(stdout)
    except json.JSONDecodeError:
        lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
        row.human_status = "error"
        row.human_error = f"maxkernel eval exit {rc}" + (": " + " | ".join(lines[-3:]) if lines else "")
        return row
    row.human_correct = bool(res.get("correct"))
    row.human_status = "accepted" if res.get("accepted") else ("error" if rc == 2 else "rejected")
    est = res.get("estimate") or {}
    row.human_estimated_speedup = est.get("estimated_speedup")
    row.human_estimated_speedup_by_generation = {
        str(g): (e or {}).get("estimated_speedup") for g, e in (est.get("by_generation") or {}).items()
    }
    row.human_measured_speedup = (res.get("timing") or {}).get("measured_speedup")
    err = res.get("error")
    if err:
        row.human_error = f"{err.get('stage')}: {err.get('message')}"
    return row


JSON_COLUMNS = (
    "tpu_compile",
    "estimated_speedup_by_generation",
    "first_accepted_estimated_speedup_by_generation",
    "single_estimated_speedup_by_generation",
    "human_estimated_speedup_by_generation",
    "human_generations",
)
"""TaskRow fields kept as JSON text in results.db/csv; a results.db from before a column existed reads as {}."""


def _flat(row: TaskRow) -> dict[str, Any]:
    d = row.model_dump()
    for k in JSON_COLUMNS:
        d[k] = json.dumps(d[k], sort_keys=True)
    return d


def _perf_text(row: TaskRow) -> str:
    if row.measured_speedup is not None:
        return f", measured {row.measured_speedup:.2f}x"
    if row.estimated_speedup is not None:
        return f", estimated {row.estimated_speedup:.2f}x"
    return ""


CLEAR_SPEEDUP = 1.25
"""Estimated speedups above this are outside the block model's error band (benchmarks/calibration_*.md)."""


def family_table(rows: list[TaskRow]) -> list[dict[str, Any]]:
    """Per family: the single round and the final (after search) side by side - estimates only."""
    out = []
    for family in [f for f, _ in FAMILIES] + ["other"]:
        fam = [r for r in rows if (r.family or family_of(r.task_id)) == family]
        if not fam:
            continue
        single = [r.single_estimated_speedup for r in fam if r.correct and r.single_estimated_speedup]
        final = [r.estimated_speedup for r in fam if r.correct and r.estimated_speedup]
        gens = generation_summary(fam)
        out.append(
            {
                "by_generation": {g: v["geomean"] for g, v in gens.items()},
                "single_by_generation": {
                    g: v["geomean"]
                    for g, v in generation_summary(fam, "single_estimated_speedup_by_generation").items()
                },
                "family": family,
                "tasks": len(fam),
                "correct": sum(r.correct for r in fam),
                "searched": sum(r.searched for r in fam),
                "single_geomean": geomean(single),
                "final_geomean": geomean(final),
                "single_fast1": sum(1 for v in single if v > 1.0),
                "final_fast1": sum(1 for v in final if v > 1.0),
                "final_clear": sum(1 for v in final if v > CLEAR_SPEEDUP),
            }
        )
    return out


def _rank(r: TaskRow) -> float:
    """What a task's result is ranked by when the bench keeps the better of its single round and its search:
    the geomean over the targeted generations (`ranking_speedup`), as the agent ranks candidates; by the
    first generation alone, a search kernel 0.001% faster on v5e and 45% slower on v6e would be kept."""
    return ranking_speedup(r.estimated_speedup, r.estimated_speedup_by_generation) or 0.0


def kept_first(r: TaskRow) -> bool | None:
    """Is the final kernel at least as fast (estimated) as the task's first accepted one? None where there
    is nothing to compare (no accepted kernel, or an estimate missing on either side). Compared by what the
    agent ranks by (`ranking_speedup`: the geomean over the targeted generations) when both sides have
    every generation's estimate, else by the first generation's."""
    first, final = r.first_accepted_estimated_speedup, r.estimated_speedup
    fg, lg = r.first_accepted_estimated_speedup_by_generation, r.estimated_speedup_by_generation
    if fg and set(fg) == set(lg):
        first, final = ranking_speedup(first, fg), ranking_speedup(final, lg)
    if not r.correct or first is None or final is None:
        return None
    return final >= first * (1.0 - 1e-9)


def generation_summary(
    rows: list[TaskRow], field: str = "estimated_speedup_by_generation"
) -> dict[str, dict[str, Any]]:
    """Per TPU generation estimated: geomean, fast₁ and clearly faster over the correct tasks (estimates), of
    the final kernels or, with `field="single_estimated_speedup_by_generation"`, of the single rounds."""
    per_row = [(r, getattr(r, field)) for r in rows]
    gens = list(dict.fromkeys(g for _r, by_gen in per_row for g in by_gen))
    out = {}
    for g in gens:
        est = [v for r, by_gen in per_row if r.correct and (v := by_gen.get(g)) and v > 0]
        out[g] = {
            "geomean": geomean(est),
            "fast1": sum(1 for v in est if v > 1.0),
            "clear": sum(1 for v in est if v > CLEAR_SPEEDUP),
            "n": len(est),
        }
    return out


def summary(rows: list[TaskRow]) -> dict[str, Any]:
    correct = [r for r in rows if r.correct]
    est = [
        r.estimated_speedup for r in correct if r.estimated_speedup is not None and r.estimated_speedup > 0
    ]
    meas = [r.measured_speedup for r in correct if r.measured_speedup is not None and r.measured_speedup > 0]
    return {
        "tasks": len(rows),
        "correct": len(correct),
        "fast1_estimated": sum(1 for v in est if v > 1.0),
        "clear_estimated": sum(1 for v in est if v > CLEAR_SPEEDUP),
        "fast1_measured": sum(1 for v in meas if v > 1.0),
        "geomean_estimated_speedup": geomean(est),
        "geomean_measured_speedup": geomean(meas),
        "estimated_n": len(est),
        "measured_n": len(meas),
        "by_generation": generation_summary(rows),
        "kept_first": sum(1 for r in rows if kept_first(r)),
        "kept_first_n": sum(1 for r in rows if kept_first(r) is not None),
        "slower_than_first": sorted(r.task_id for r in rows if kept_first(r) is False),
    }


# In the side-by-side geomeans a kernel that is not accepted counts as XLA's own time (speedup 1.0): a user
# whose kernel fails keeps the XLA program, and both columns then average over the same workloads.
XLA_FALLBACK_SPEEDUP = 1.0


def _ours_or_xla(r: TaskRow, value: float | None) -> float:
    return value if (r.correct and value is not None and value > 0) else XLA_FALLBACK_SPEEDUP


def _human_accepted(r: TaskRow, generation: str | None = None) -> bool:
    """Accepted for all targets, or (on `generation`) judged again with that generation alone (`run_human`)."""
    return r.human_status == "accepted" or (
        generation is not None and r.human_generations.get(generation) == "accepted"
    )


def _human_or_xla(r: TaskRow, value: float | None, generation: str | None = None) -> float:
    """The hand-written kernel's speedup where it was accepted (see `_human_accepted`), else XLA's own 1.0."""
    ok = _human_accepted(r, generation) and value is not None and value > 0
    return value if ok else XLA_FALLBACK_SPEEDUP


def side_by_side(rows: list[TaskRow]) -> dict[str, Any]:
    """Ours vs hand-written vs XLA over the workloads that have a hand-written kernel, estimated and
    measured kept apart; measured geomeans only over workloads where both were measured on a device."""
    both = [r for r in rows if r.human_kernel_path]
    measured = [r for r in both if r.measured_speedup is not None and r.human_measured_speedup is not None]
    gens = sorted(
        {
            g
            for r in both
            for g in (*r.estimated_speedup_by_generation, *r.human_estimated_speedup_by_generation)
        }
    )
    return {
        "by_generation": {
            g: {
                "ours": geomean([_ours_or_xla(r, r.estimated_speedup_by_generation.get(g)) for r in both]),
                "human": geomean(
                    [_human_or_xla(r, r.human_estimated_speedup_by_generation.get(g), g) for r in both]
                ),
                "human_accepted": sum(1 for r in both if _human_accepted(r, g)),
                "ours_ahead": sum(
                    1
                    for r in both
                    if _ours_or_xla(r, r.estimated_speedup_by_generation.get(g))
                    >= _human_or_xla(r, r.human_estimated_speedup_by_generation.get(g), g)
                ),
            }
            for g in gens
        },
        "workloads": len(both),
        "ours_correct": sum(1 for r in both if r.correct),
        "human_accepted": sum(1 for r in both if _human_accepted(r)),
        "geomean_estimated_ours": geomean([_ours_or_xla(r, r.estimated_speedup) for r in both]),
        "geomean_estimated_human": geomean([_human_or_xla(r, r.human_estimated_speedup) for r in both]),
        "geomean_measured_ours": geomean([_ours_or_xla(r, r.measured_speedup) for r in measured]),
        "geomean_measured_human": geomean([_human_or_xla(r, r.human_measured_speedup) for r in measured]),
        "measured_n": len(measured),
    }


def render_side_by_side(rows: list[TaskRow]) -> list[str]:
    """The report section comparing our kernels with hand-written ones; empty when no workload has one."""
    both = sorted((r for r in rows if r.human_kernel_path), key=lambda r: r.task_id)
    if not both:
        return []
    m = side_by_side(rows)
    fmt = lambda v: f"{v:.2f}x" if v is not None else "—"  # noqa: E731
    cell = lambda s: (s or "").replace("|", "\\|").replace("\n", " ")[:200]  # noqa: E731
    lines = [
        "",
        "## Hand-written kernels side by side",
        "",
        "Speedups over XLA (XLA = 1.00x). Hand-written kernels ran in the same harness, at the same "
        "validation shapes (where theirs did not run at ours, at `--scale tiles` shapes that keep their block "
        "multiples: the note says so), with the same TPU targets and estimator as ours. In the geomeans a "
        "kernel that is not correct counts as 1.00x (its user keeps the XLA program).",
        "",
        "| metric | ours | hand-written | XLA |",
        "| --- | --- | --- | --- |",
        f"| passes our checks | {m['ours_correct']} / {m['workloads']} | {m['human_accepted']} / {m['workloads']} | — |",
        f"| geomean speedup, estimated (TPU model, not measured) | {fmt(m['geomean_estimated_ours'])} | "
        f"{fmt(m['geomean_estimated_human'])} | 1.00x |",
        *(
            f"| on {g}, estimated: geomean (ours ≥ hand-written on {v['ours_ahead']} / {m['workloads']}; "
            f"hand-written accepted on {g}: {v['human_accepted']}) | {fmt(v['ours'])} | {fmt(v['human'])} | 1.00x |"
            for g, v in m["by_generation"].items()
        ),
        f"| geomean speedup, measured on a device (over {m['measured_n']}) | {fmt(m['geomean_measured_ours'])} | "
        f"{fmt(m['geomean_measured_human'])} | {'1.00x' if m['measured_n'] else '—'} |",
        "",
        "| workload | ours correct | ours estimated | hand-written status | hand-written estimated | XLA | "
        "ours measured | hand-written measured | hand-written note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    yes = lambda b: "✓" if b else "✗"  # noqa: E731
    for r in both:
        status, estimated = r.human_status or "—", fmt(r.human_estimated_speedup)
        alone = [g for g, v in r.human_generations.items() if v == "accepted"]
        if alone:  # correct, compiles for some targets only: judged again with those alone
            status += f" (accepted on {', '.join(alone)} alone)"
            if r.human_estimated_speedup is None:
                estimated = ", ".join(
                    f"{g} {fmt(r.human_estimated_speedup_by_generation.get(g))}" for g in alone
                )
        lines.append(
            f"| {r.task_id} | {yes(r.correct)} | {fmt(r.estimated_speedup)} | {status} | "
            f"{estimated} | 1.00x | {fmt(r.measured_speedup)} | "
            f"{fmt(r.human_measured_speedup)} | {cell('; '.join(filter(None, [r.human_error, r.human_scale_note])))} |"
        )
    return lines


PUBLISHED_MAXKERNEL = {
    "tasks": 50,
    "correct": 50,
    "geomean": 1.58,
    "fast1": 34,
    "how": "measured on TPU; Gemini 3.1 Pro with parallel search (the MaxKernel paper)",
}
"""The published agent's figures on the 50 JAXBench workloads (facts from its paper, not our runs)."""

_JAXBENCH_ID = re.compile(r"^\d+[pk]_")
JAXBENCH_MIN_TASKS = 40
"""A bench whose tasks are mostly JAXBench workloads (`1p_Flash_Attention`, `18k_...`: the checkout itself
or MaxKernel's adapted set) is compared with the published agent."""


def published_comparison(rows: list[TaskRow]) -> dict[str, Any] | None:
    """Ours per generation as JAXBench counts (a failed workload is 1.00x: its user keeps XLA) and over the
    correct ones, beside the published figures; None when the suite is not JAXBench's."""
    jb = [r for r in rows if _JAXBENCH_ID.match(r.task_id)]
    if len(jb) < JAXBENCH_MIN_TASKS:
        return None
    gens = sorted({g for r in jb for g in r.estimated_speedup_by_generation})
    out: dict[str, Any] = {"tasks": len(jb), "correct": sum(1 for r in jb if r.correct), "by_generation": {}}
    for g in gens:
        counted = [_ours_or_xla(r, r.estimated_speedup_by_generation.get(g)) for r in jb]
        correct = [
            v
            for r in jb
            if r.correct and (v := r.estimated_speedup_by_generation.get(g)) is not None and v > 0
        ]
        out["by_generation"][g] = {
            "jaxbench_geomean": geomean(counted),
            "correct_geomean": geomean(correct),
            "fast1": sum(1 for v in correct if v > 1.0),
        }
    return out


def render_published(rows: list[TaskRow]) -> list[str]:
    m = published_comparison(rows)
    if m is None:
        return []
    p = PUBLISHED_MAXKERNEL
    fmt = lambda v: f"{v:.2f}x" if v is not None else "—"  # noqa: E731
    lines = [
        "",
        "## Against the published agent",
        "",
        f"Theirs: {p['how']}. Ours: this run, ESTIMATED (TPU time model against the TPU compiler's estimate of "
        "XLA; nothing measured), with the offline author (no LLM). Geomeans as JAXBench counts them (a "
        "workload without a correct kernel is 1.00x) and over the correct kernels only.",
        "",
        "| | correct | geomean (JAXBench counting) | geomean over correct | fast₁ | how |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| MaxKernel (published) | {p['correct']} / {p['tasks']} | {fmt(p['geomean'])} | {fmt(p['geomean'])} | "
        f"{p['fast1']} / {p['tasks']} | measured |",
    ]
    for g, v in m["by_generation"].items():
        lines.append(
            f"| maxkernel, {g} | {m['correct']} / {m['tasks']} | {fmt(v['jaxbench_geomean'])} | "
            f"{fmt(v['correct_geomean'])} | {v['fast1']} / {m['tasks']} | estimated |"
        )
    return lines


def fast_p_table(rows: list[TaskRow]) -> dict[str, dict[str, Any]]:
    """KernelBench's fast_p per level (category) and TPU generation, over ALL the level's tasks (failed
    conversions count as not correct); speedups are our estimates, never measurements."""
    out: dict[str, dict[str, Any]] = {}
    for level in sorted({r.category for r in rows if r.category.startswith("kernelbench")}):
        level_rows = [r for r in rows if r.category == level]
        gens = list(dict.fromkeys(g for r in level_rows for g in r.estimated_speedup_by_generation))
        per_gen = {
            g: {p: kernelbench.fast_p([(r.correct, r.estimated_speedup_by_generation.get(g)) for r in level_rows], p)
                for p in kernelbench.FAST_P}
            for g in gens
        }  # fmt: skip
        converted = sum(1 for r in level_rows if r.converted)
        out[level] = {"tasks": len(level_rows), "converted": converted, "fast_p": per_gen}
    return out


def render_fast_p(rows: list[TaskRow]) -> list[str]:
    """The report's KernelBench section (empty for other suites)."""
    table = fast_p_table(rows)
    if not table:
        return []
    ps = kernelbench.FAST_P
    lines = [
        "",
        "## KernelBench fast_p (estimated: TPU time model, not measured)",
        "",
        "KernelBench's metric over ALL the level's tasks: fast_p = correct and faster than the baseline by "
        "more than p (fast_0 = correct). Here the baseline is XLA compiling the converted JAX reference, and "
        "the speedup is the estimated one per TPU generation (nothing was measured on a TPU).",
        "",
        "| level | TPU | tasks | converted and verified | "
        + " | ".join(f"fast_{p:g} (est.)" for p in ps)
        + " |",
        "| --- | --- | --- | --- | " + " | ".join("---" for _ in ps) + " |",
    ]
    for level, v in table.items():
        for g, by_p in v["fast_p"].items():
            cells = " | ".join(
                f"{by_p[p][0]} / {by_p[p][1]} ({by_p[p][0] / max(1, by_p[p][1]):.0%})" for p in ps
            )
            lines.append(f"| {level} | {g} | {v['tasks']} | {v['converted']} | {cells} |")
    return lines


def render_report(rows: list[TaskRow], s: BenchSettings, wall_s: float, plots: list[Path]) -> str:
    m = summary(rows)
    fmt = lambda v: f"{v:.2f}x" if v is not None else "—"  # noqa: E731
    lines = [
        f"# maxkernel bench — {Path(s.suite).name}",
        "",
        f"- model `{s.model}`, {'search ' + s.algorithm if s.algorithm else 'optimize'}, {s.iterations} round(s) per task, "
        f"validation scale `{s.scale}`, TPU targets {', '.join(s.tpu)}",
        f"- generated {dt.datetime.now(dt.UTC).isoformat(timespec='seconds')}; this invocation ran {wall_s / 60:.1f} min",
        "",
        "## Summary",
        "",
        "| metric | value |",
        "| --- | --- |",
        f"| correct / total | {m['correct']} / {m['tasks']} |",
        f"| fast₁ (correct and faster), estimated | {m['fast1_estimated']} / {m['tasks']} (over {m['estimated_n']} with an estimate) |",
        f"| clearly faster (estimated > {CLEAR_SPEEDUP}x, outside the model's error band) | {m['clear_estimated']} / {m['tasks']} |",
        f"| fast₁ (correct and faster), measured | {m['fast1_measured']} / {m['tasks']} (over {m['measured_n']} measured) |",
        f"| geomean speedup, estimated (TPU model, not measured) | {fmt(m['geomean_estimated_speedup'])} |",
        f"| geomean speedup, measured on a device | {fmt(m['geomean_measured_speedup'])} |",
    ]
    for g, v in m["by_generation"].items():
        lines.append(
            f"| on {g}, estimated: geomean / fast₁ / > {CLEAR_SPEEDUP}x | {fmt(v['geomean'])} / {v['fast1']} / "
            f"{v['clear']} (over {v['n']} with a {g} estimate) |"
        )
    lines += [
        "",
    ]
    single = [r.single_estimated_speedup for r in rows if r.correct and r.single_estimated_speedup]
    per_gen = {
        g: v["geomean"] for g, v in generation_summary(rows, "single_estimated_speedup_by_generation").items()
    }
    single_line = (
        f"Single round (no search): geomean estimated {fmt(geomean(single))}, fast₁ "
        f"{sum(1 for v in single if v > 1.0)} / {m['tasks']}"
        + (
            " (" + ", ".join(f"{g} {fmt(v)}" for g, v in per_gen.items()) + ")."
            if len(per_gen) > 1 and all(per_gen.values())
            else "."
        )
    )
    if s.algorithm:
        single_line += (
            f" Search ({s.algorithm}, {s.branches} branches) ran on {sum(r.searched for r in rows)} task(s): "
            f"those correct after one round with an estimate below {s.search_below}x; each task keeps the "
            "better of the two."
        )
    elif s.iterations > 1:
        single_line += (
            f" The single round is round 1 of each run's {s.iterations} (its best accepted kernel)."
        )
    slower = m["slower_than_first"]
    lines += [
        single_line,
        "",
        f"Final kernel at least as fast (estimated) as the task's first accepted kernel: {m['kept_first']} / "
        f"{m['kept_first_n']} tasks with both estimates"
        + (f"; NOT on {', '.join(slower)}." if slower else "."),
        "",
    ]
    gens_est = list(m["by_generation"])
    lines += [
        "## By family (estimated speedups: TPU time model, not measured)",
        "",
        "Single round, final and fast₁ columns are the first generation's; the last columns are the single "
        "round's and the final geomean per generation.",
        "",
        "| family | tasks | correct | searched | single round geomean | final geomean | fast₁ single | "
        f"fast₁ final | final > {CLEAR_SPEEDUP}x |" + "".join(f" single {g} | final {g} |" for g in gens_est),
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |" + " --- | --- |" * len(gens_est),
    ]
    for f in family_table(rows):
        lines.append(
            f"| {f['family']} | {f['tasks']} | {f['correct']} | {f['searched']} | {fmt(f['single_geomean'])} | "
            f"{fmt(f['final_geomean'])} | {f['single_fast1']} | {f['final_fast1']} | {f['final_clear']} |"
            + "".join(
                f" {fmt(f['single_by_generation'].get(g))} | {fmt(f['by_generation'].get(g))} |"
                for g in gens_est
            )
        )
    lines.append("")
    for p in plots:
        lines.append(f"![{p.stem}]({p.name})")
    lines += render_published(rows)
    lines += render_fast_p(rows)
    lines += render_side_by_side(rows)
    gens = sorted({g for r in rows for g in r.tpu_compile})
    lines += [
        "",
        "## Tasks",
        "",
        "| task | category | status | compiled | correct | Pallas does the work | "
        + " | ".join(f"TPU {g}" for g in gens)
        + " | single round (est.) | estimated speedup"
        + "".join(f" | est. {g}" for g in gens_est)
        + " | ≥ first accepted (est.) | measured speedup | time | note |",
        "| --- | --- | --- | --- | --- | --- | "
        + " | ".join("---" for _ in gens)
        + " | --- | ---"
        + " | ---" * len(gens_est)
        + " | --- | --- | --- | --- |",
    ]
    yes = lambda b: "✓" if b else "✗"  # noqa: E731
    for r in sorted(rows, key=lambda r: (r.category, r.task_id)):
        comp = " | ".join(yes(r.tpu_compile.get(g, False)) if g in r.tpu_compile else "—" for g in gens)
        note = (r.error or r.verdict or "").replace("|", "\\|").replace("\n", " ")[:140]
        kept = kept_first(r)
        first = (
            "—" if kept is None else ("✓" if kept else f"✗ (first {fmt(r.first_accepted_estimated_speedup)})")
        )
        lines.append(
            f"| {r.task_id} | {r.category} | {r.status} | {yes(r.compiled)} | {yes(r.correct)} | {yes(r.uses_pallas)} | "
            f"{comp} | {fmt(r.single_estimated_speedup)} | {fmt(r.estimated_speedup)} | "
            + "".join(f"{fmt(r.estimated_speedup_by_generation.get(g))} | " for g in gens_est)
            + f"{first} | "
            f"{fmt(r.measured_speedup)} | "
            f"{r.seconds or 0:.0f} s | {note} |"
        )
    return "\n".join(lines) + "\n"


def make_plots(rows: list[TaskRow], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    cats = sorted({r.category or "uncategorised" for r in rows})
    statuses = ["correct", "incorrect", "error"]
    counts = {c: {s: 0 for s in statuses} for c in cats}
    for r in rows:
        key = "correct" if r.correct else ("error" if r.status == "error" else "incorrect")
        counts[r.category or "uncategorised"][key] += 1
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bottom = [0] * len(cats)
    colours = {"correct": "#4caf50", "incorrect": "#ff9800", "error": "#e53935"}
    for s in statuses:
        vals = [counts[c][s] for c in cats]
        ax.bar(cats, vals, bottom=bottom, label=s, color=colours[s])
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_ylabel("tasks")
    ax.set_title("status by category")
    ax.legend()
    fig.tight_layout()
    p = out / "status_by_category.png"
    fig.savefig(p, dpi=100)
    plt.close(fig)
    paths.append(p)

    est = [r.estimated_speedup for r in rows if r.correct and r.estimated_speedup and r.estimated_speedup > 0]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    if est:
        logs = [math.log2(v) for v in est]
        ax.hist(logs, bins=min(20, max(5, len(est) // 2)), color="#1e88e5")
        ax.axvline(0.0, color="black", linestyle="--", linewidth=1)
        ax.set_xlabel("log2(estimated speedup)  —  right of the line: estimated faster than XLA")
    else:
        ax.text(0.5, 0.5, "no estimates", ha="center", va="center")
    ax.set_ylabel("tasks")
    ax.set_title("estimated speedup distribution (TPU time model, not measured)")
    fig.tight_layout()
    p = out / "estimated_speedup.png"
    fig.savefig(p, dpi=100)
    plt.close(fig)
    paths.append(p)

    both = sorted((r for r in rows if r.human_kernel_path), key=lambda r: r.task_id)
    if both:
        fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(both) + 2), 3.8))
        xs = list(range(len(both)))
        width = 0.38
        ours = [_ours_or_xla(r, r.estimated_speedup) for r in both]
        human = [_human_or_xla(r, r.human_estimated_speedup) for r in both]
        ax.bar([x - width / 2 for x in xs], ours, width, label="ours", color="#1e88e5")
        bars = ax.bar([x + width / 2 for x in xs], human, width, label="hand-written", color="#8e24aa")
        for bar, r in zip(bars, both, strict=True):
            if r.human_status != "accepted":  # a failed hand-written kernel is shown, hatched, at XLA's 1.0
                bar.set_hatch("//")
                bar.set_facecolor("#e0e0e0")
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="XLA")
        ax.set_xticks(xs, [r.task_id for r in both], rotation=30, ha="right")
        ax.set_ylabel("estimated speedup over XLA")
        ax.set_title(
            "ours vs hand-written vs XLA\n(estimated, TPU time model; hatched: failed our checks)",
            fontsize=10,
        )
        ax.legend()
        fig.tight_layout()
        p = out / "hand_written_side_by_side.png"
        fig.savefig(p, dpi=100)
        plt.close(fig)
        paths.append(p)
    return paths
