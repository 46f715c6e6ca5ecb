"""JAXBench workloads as they are: format detection, CONFIG tolerances, divisibility-keeping shrink, `eval` on a
workload dir with its hand-written kernel, and the bench's side-by-side report.

The workloads under tests/data/jaxbench/benchmark/ are written for these tests in JAXBench's documented
format (no JAXBench code): tiny_gemm (no tolerances, a correct hand-written Pallas kernel exporting
`workload`), scaled_softmax (CONFIG tolerances, no hand-written kernel) and row_scale (a hand-written kernel
that bakes the real shape in, so it fails at the shrunk validation shapes).
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from maxkernel import bench
from maxkernel.tools import jaxbench, taskcode
from maxkernel.tools.results import ArraySpec
from maxkernel.tools.tasks import load_task

CHECKOUT = Path(__file__).parent / "data" / "jaxbench"
SUITE = CHECKOUT / "benchmark"
GEMM = SUITE / "tiny_gemm"
SOFTMAX = SUITE / "scaled_softmax"
ROW_SCALE = SUITE / "row_scale"


@pytest.fixture()
def work(tmp_path: Path) -> Path:
    return tmp_path / "work"


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "maxkernel", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=cwd)


# --- reading the format without running it -----------------------------------------------------------


def test_config_tolerances_are_read_statically_with_jaxbench_default() -> None:
    assert jaxbench.tolerances(jaxbench.read_config(SOFTMAX / "baseline.py")) == {"atol": 5e-3, "rtol": 2e-3}
    gemm = jaxbench.read_config(GEMM / "baseline.py")
    assert gemm["M"] == 1536 and "dtype" not in gemm  # jnp.float32 is not a literal
    assert jaxbench.tolerances(gemm) == {"atol": 1e-2, "rtol": 1e-2}
    row = jaxbench.tolerances(jaxbench.read_config(ROW_SCALE / "baseline.py"))
    assert row == {"atol": 1e-3, "rtol": 1e-2}  # only atol set: rtol falls back to JAXBench's default


def test_the_hand_written_kernels_own_tolerance_is_not_the_workloads(tmp_path: Path) -> None:
    """JAXBench's harness compares every kernel at 1e-2 (or the workload's CONFIG): an `optimized.py`'s own
    CONFIG tolerance is its self-test's, and must not make our kernels meet a stricter one."""
    workload = tmp_path / "w"
    workload.mkdir()
    (workload / "baseline.py").write_text(
        "CONFIG = {'M': 256, 'rtol': 0.05}\ndef create_inputs(dtype=None):\n    return ()\n"
        "def workload():\n    return 0\n"
    )
    (workload / "optimized.py").write_text(
        "CONFIG = {'atol': 1e-3, 'rtol': 1e-4}\ndef workload():\n    return 0\n"
    )
    meta = jaxbench.task_meta(workload / "baseline.py")
    assert (meta["atol"], meta["rtol"]) == (jaxbench.DEFAULT_TOLERANCE, 0.05)


def test_reading_config_never_executes_the_module(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    module = tmp_path / "evil.py"
    module.write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('x')\n"
        f"CONFIG = {{'atol': 0.5, 'rtol': pathlib.Path({str(marker)!r}).write_text('y')}}\n"
        "def create_inputs(dtype=None):\n    return ()\n"
        "def workload():\n    return 0\n"
    )
    meta = jaxbench.task_meta(module)
    assert not marker.exists()
    assert meta["atol"] == 0.5 and meta["rtol"] == jaxbench.DEFAULT_TOLERANCE
    assert meta["task_id"] == "evil"  # a bare module is named after its file


def test_format_detection_and_task_ids(tmp_path: Path) -> None:
    assert jaxbench.is_workload_dir(GEMM) and not jaxbench.is_workload_dir(SUITE)
    assert jaxbench.task_id(GEMM / "baseline.py") == "tiny_gemm"  # the dir's name, not "baseline"
    assert jaxbench.hand_written_kernel(GEMM) == GEMM / "optimized.py"
    assert jaxbench.hand_written_kernel(GEMM / "baseline.py") == GEMM / "optimized.py"
    assert jaxbench.hand_written_kernel(SOFTMAX) is None
    # `workload` bound by assignment (e.g. a jitted function) counts as defined.
    assigned = tmp_path / "assigned.py"
    assigned.write_text(
        "import jax\ndef create_inputs(dtype=None):\n    return ()\nworkload = jax.jit(abs)\n"
    )
    assert jaxbench.is_workload_module(assigned)


def test_candidate_may_export_workload_or_computation() -> None:
    import types

    both = types.ModuleType("both")
    both.computation, both.workload = (lambda: "c"), (lambda: "w")
    only = types.ModuleType("only")
    only.workload = lambda: "w"
    assert taskcode.candidate_entry(both)() == "c"
    assert taskcode.candidate_entry(only)() == "w"
    assert taskcode.candidate_entry(types.ModuleType("none")) is None
    # a hand-written kernel may declare only the leading arguments (its own create_inputs leaves the rest out)
    short = types.ModuleType("short")
    short.workload = lambda q, k: (q, k)
    assert taskcode.candidate_entry(short)(1, 2, 3) == (1, 2)
    named = types.ModuleType("named")
    named.computation = lambda q, k: (q, k)
    with pytest.raises(TypeError):  # our own entry point gets exactly the task's arguments
        taskcode.candidate_entry(named)(1, 2, 3)


# --- shapes for CPU validation ------------------------------------------------------------------------


def test_jaxbench_shrink_keeps_power_of_two_block_multiples() -> None:
    keep = taskcode.SHRINK_KEEP_MULTIPLE["jaxbench"]
    dims = [1536, 768, 8192, 6144, 4096 + 128, 32768, 384, 200]
    configs = [([ArraySpec(shape=(d,), dtype="float32") for d in dims], [])]
    mapping = taskcode.shrink_map(configs, 0.25, keep)
    assert mapping[1536] == 512 and mapping[768] == 256 and mapping[8192] == 2048 and mapping[32768] == 8192
    assert 200 not in mapping  # under 256: left alone
    for d in dims:
        new = mapping.get(d, d)
        assert new <= d
        block = 128
        while d % block == 0 and block <= keep:
            assert new % block == 0, (d, new, block)  # every block <= 2048 that divided d still divides
            block *= 2
    # A smaller explicit factor asks for smaller dims: the kept multiple shrinks with it, never under 128.
    assert [taskcode.keep_multiple_for("jaxbench", f) for f in (0.25, 0.125, 0.0625, 0.001)] == [
        2048,
        1024,
        512,
        128,
    ]
    assert taskcode.keep_multiple_for("maxkernel", 0.25) == taskcode.TILE_MULTIPLE
    # Other formats keep the plain tile rule: 1536 x0.25 -> 384, which a 512-row block no longer divides.
    assert taskcode.shrink_map(configs, 0.25)[1536] == 384


def test_load_task_reads_workload_dir_baseline_and_bare_module(tmp_path: Path, work: Path) -> None:
    by_dir = load_task(GEMM, scale="0.25", work_dir=work)
    by_file = load_task(GEMM / "baseline.py", scale="0.25", work_dir=work)
    for task in (by_dir, by_file):
        assert task.task_id == "tiny_gemm" and task.format == "jaxbench"
        assert task.tolerances == {"atol": 1e-2, "rtol": 1e-2}
        assert [a.shape for a in task.configs[0].dynamic] == [(1536, 256), (256, 768)]
        assert [a.shape for a in task.validation_configs[0].dynamic] == [(512, 256), (256, 256)]
        assert "2048" in task.validation_note  # the result says which rule made the shapes
    # at the default, a task this small fits the validation budget at its own shapes
    default = load_task(GEMM, scale="cpu", work_dir=work)
    assert default.validation_mode == "task" and "within the budget" in default.validation_note
    assert default.validation_configs[0].dynamic == default.configs[0].dynamic
    soft = load_task(SOFTMAX, scale="cpu", work_dir=work)
    assert (soft.validation_configs[0].atol, soft.validation_configs[0].rtol) == (5e-3, 2e-3)
    bare = tmp_path / "softmax_module.py"
    shutil.copy(SOFTMAX / "baseline.py", bare)
    assert load_task(bare, scale="tpu", work_dir=work).task_id == "softmax_module"


# --- eval on a workload dir with its hand-written kernel ---------------------------------------------


def test_eval_workload_dir_with_its_hand_written_kernel(tmp_path: Path) -> None:
    proc = _cli(
        "eval", str(GEMM), str(GEMM / "optimized.py"), "--json", "--tpu", "v5e", "--scale", "0.25",
        "--store", str(tmp_path / "r.db"), "--work-dir", str(tmp_path / "w"),
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(proc.stdout)
    assert res["task_id"] == "tiny_gemm" and res["accepted"] and res["uses_pallas"]
    assert res["correctness"]["shapes_used"] == ["bfloat16[512,256], bfloat16[256,256]"]  # as JAXBench: bf16
    assert res["tpu_compile"]["v5e"]["ok"]
    assert res["estimate"]["estimated_speedup"] > 0


def test_bench_reports_a_failing_hand_written_kernel_with_the_harness_message(tmp_path: Path) -> None:
    settings = bench.BenchSettings(suite=str(SUITE), out_dir=str(tmp_path / "b"), tpu=["v5e"], scale="0.25")
    b = bench.Bench(settings, on_progress=lambda _: None)
    out = tmp_path / "b" / "tasks" / "row_scale"
    out.mkdir(parents=True)
    row = b.run_human(ROW_SCALE, ROW_SCALE / "optimized.py", bench.TaskRow(task_id="row_scale"), out)
    assert row.human_status == "rejected" and not row.human_correct
    assert row.human_error.startswith("trace: output shapes/dtypes differ")
    assert "bfloat16[512,256]" in row.human_error  # the shrunk shape the kernel ignored
    assert json.loads((out / "hand_written_result.json").read_text())["task_id"] == "row_scale"


# --- the bench over a JAXBench checkout ----------------------------------------------------------------


def test_bench_discovers_jaxbench_checkout_suite_and_single_tasks(tmp_path: Path) -> None:
    names = ["row_scale", "scaled_softmax", "tiny_gemm"]
    assert [bench.task_name(p) for p in bench.discover(CHECKOUT, None)] == names  # checkout root
    assert [bench.task_name(p) for p in bench.discover(SUITE, None)] == names
    assert [bench.task_name(p) for p in bench.discover(SUITE, "*_s*")] == ["row_scale", "scaled_softmax"]
    assert [bench.task_name(p) for p in bench.discover(GEMM, None)] == ["tiny_gemm"]
    assert [bench.task_name(p) for p in bench.discover(GEMM / "baseline.py", None)] == ["tiny_gemm"]
    mixed = tmp_path / "mixed"
    shutil.copytree(GEMM, mixed / "tiny_gemm")
    shutil.copytree(Path(__file__).parent / "data" / "tasks" / "small_matmul", mixed / "small_matmul")
    assert [bench.task_name(p) for p in bench.discover(mixed, None)] == ["small_matmul", "tiny_gemm"]
    assert bench._category(GEMM) == "jaxbench"
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no tasks"):
        bench.discover(tmp_path / "empty", None)


def _row(task_id: str, **kw: object) -> bench.TaskRow:
    return bench.TaskRow(task_id=task_id, status="succeeded", category="jaxbench", **kw)


def test_side_by_side_report_and_csv(tmp_path: Path) -> None:
    rows = [
        _row("a", correct=True, estimated_speedup=2.0, human_kernel_path="a/optimized.py",
             human_status="accepted", human_correct=True, human_estimated_speedup=1.5),
        _row("b", correct=False, error="unsupported", human_kernel_path="b/optimized.py",
             human_status="rejected", human_error="trace: output shapes/dtypes differ | expected x"),
        _row("c", correct=True, estimated_speedup=3.0),  # no hand-written kernel: not in the comparison
    ]  # fmt: skip
    m = bench.side_by_side(rows)
    assert m["workloads"] == 2 and m["ours_correct"] == 1 and m["human_accepted"] == 1
    assert m["geomean_estimated_ours"] == pytest.approx(2.0**0.5)  # b falls back to XLA (1.0)
    assert m["geomean_estimated_human"] == pytest.approx(1.5**0.5)
    assert m["geomean_measured_ours"] is None and m["measured_n"] == 0
    settings = bench.BenchSettings(suite=str(SUITE), out_dir=str(tmp_path))
    report = bench.render_report(rows, settings, 1.0, [])
    assert "## Hand-written kernels side by side" in report
    assert "| geomean speedup, estimated (TPU model, not measured) | 1.41x | 1.22x | 1.00x |" in report
    assert "| geomean speedup, measured on a device (over 0) | — | — | — |" in report
    assert "| passes our checks | 1 / 2 | 1 / 2 | — |" in report
    assert (
        "| b | ✗ | — | rejected | — | 1.00x | — | — | trace: output shapes/dtypes differ \\| expected x |"
        in report
    )
    assert "| c |" not in report.split("## Tasks")[0]
    b = bench.Bench(settings, on_progress=lambda _: None)
    b.write_outputs(rows, 1.0)
    assert (tmp_path / "hand_written_side_by_side.png").read_bytes()[:4] == b"\x89PNG"
    assert (
        "![hand_written_side_by_side](hand_written_side_by_side.png)" in (tmp_path / "report.md").read_text()
    )
    csv_rows = {r["task_id"]: r for r in csv.DictReader(open(tmp_path / "results.csv"))}
    assert csv_rows["a"]["human_estimated_speedup"] == "1.5" and csv_rows["b"]["human_status"] == "rejected"
    no_human = bench.render_report([rows[2]], settings, 1.0, [])
    assert "side by side" not in no_human


def test_a_jaxbench_suite_is_compared_with_the_published_agent_per_generation(tmp_path: Path) -> None:
    """50 workloads named as JAXBench names them: the report sets ours (estimated, per generation, as
    JAXBench counts a failure: 1.00x) beside the published figures (measured), labelled as such."""
    rows = []
    for i in range(50):
        ok = i % 10 != 0  # 5 failures
        rows.append(
            _row(
                f"{i + 1}{'p' if i < 17 else 'k'}_Workload",
                correct=ok,
                estimated_speedup=2.0 if ok else None,
                estimated_speedup_by_generation={"v5e": 2.0, "v6e": 1.0} if ok else {},
                human_kernel_path="h.py" if i < 8 else None,
                human_status="accepted" if i < 8 else None,
                human_estimated_speedup=1.5 if i < 8 else None,
                human_estimated_speedup_by_generation={"v5e": 1.5, "v6e": 1.5} if i < 8 else {},
            )
        )
    m = bench.published_comparison(rows)
    assert m is not None and m["correct"] == 45
    assert m["by_generation"]["v5e"]["jaxbench_geomean"] == pytest.approx(2.0 ** (45 / 50))
    assert m["by_generation"]["v5e"]["correct_geomean"] == pytest.approx(2.0)
    assert m["by_generation"]["v6e"]["fast1"] == 0
    report = bench.render_report(rows, bench.BenchSettings(suite=str(SUITE), out_dir=str(tmp_path)), 1.0, [])
    section = report.split("## Against the published agent")[1].split("##")[0]
    assert "| MaxKernel (published) | 50 / 50 | 1.58x |" in section and "measured |" in section
    assert "| maxkernel, v5e | 45 / 50 | 1.87x | 2.00x | 45 / 50 | estimated |" in section
    assert "no LLM" in section
    side = bench.side_by_side(rows)["by_generation"]
    assert (
        side["v6e"]["ours_ahead"] == 0 and side["v5e"]["ours_ahead"] == 7
    )  # workload 1 failed: 1.00x < 1.5x
    assert (
        "| on v6e, estimated: geomean (ours ≥ hand-written on 0 / 8; hand-written accepted on v6e: 8) |"
        in report
    )
    # a suite that is not JAXBench gets no such section
    assert bench.published_comparison(rows[:10]) is None


@pytest.mark.slow
def test_bench_over_jaxbench_suite_end_to_end(tmp_path: Path) -> None:
    """The whole flow a user runs on a checkout: agent (offline author) + hand-written kernels, resumable."""
    out = tmp_path / "bench"
    args = (
        "bench",
        str(CHECKOUT),
        "--model",
        "offline",
        "--tpu",
        "v5e",
        "--scale",
        "0.25",
        "--out",
        str(out),
    )
    first = _cli(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert "3 to run" in first.stderr
    assert "hand-written kernels on 2 workloads: 1 pass our checks" in first.stderr
    rows = {r["task_id"]: r for r in csv.DictReader(open(out / "results.csv"))}
    assert set(rows) == {"tiny_gemm", "scaled_softmax", "row_scale"}
    assert rows["tiny_gemm"]["human_status"] == "accepted"
    assert float(rows["tiny_gemm"]["human_estimated_speedup"]) > 0
    assert rows["row_scale"]["human_status"] == "rejected" and rows["row_scale"]["human_error"]
    assert rows["scaled_softmax"]["human_kernel_path"] == ""
    report = (out / "report.md").read_text()
    assert "## Hand-written kernels side by side" in report and "| row_scale |" in report
    again = _cli(*args, cwd=tmp_path)
    assert again.returncode == 0 and "3 already finished, 0 to run" in again.stderr


def test_config_sizes_follow_the_shrunk_shapes(tmp_path: Path, work: Path) -> None:
    """A workload that reshapes with CONFIG's sizes still traces at the shrunk validation shapes."""
    workload = tmp_path / "benchmark" / "config_reshape"
    workload.mkdir(parents=True)
    (workload / "baseline.py").write_text(
        "import jax\nimport jax.numpy as jnp\n"
        "CONFIG = {'name': 'config_reshape', 'S': 1536, 'H': 4, 'D': 128, 'flag': True}\n"
        "def create_inputs(dtype=jnp.float32):\n"
        "    return (jax.random.normal(jax.random.PRNGKey(0), (CONFIG['S'], CONFIG['H'] * CONFIG['D']), dtype),)\n"
        "def workload(x):\n"
        "    assert CONFIG['flag'] is True\n"
        "    return jnp.sum(x.reshape(CONFIG['S'], CONFIG['H'], CONFIG['D']), axis=-1)\n"
    )
    task = load_task(workload, scale="0.25", work_dir=work)
    assert [a.shape for a in task.validation_configs[0].dynamic] == [(512, 512)]
    assert [o.shape for o in task.validation_configs[0].outputs] == [(512, 4)]
    assert [o.shape for o in task.configs[0].outputs] == [(1536, 4)]  # own shapes: CONFIG untouched


# --- a hand-written kernel's own CONFIG, and kernels tuned for one generation ---------------------------

_CONFIG_KERNEL = """
import jax
import jax.numpy as jnp

CONFIG = {"batch": 4, "seq_len": 2048, "heads": 8, "name": "x"}


def create_inputs(dtype=jnp.float32):
    return (jnp.zeros((CONFIG["batch"], CONFIG["seq_len"], CONFIG["heads"] * 16), dtype),)


def workload(x):
    # sizes from the module's own CONFIG, as JAXBench's hand-written kernels do
    y = x.reshape(CONFIG["batch"], CONFIG["seq_len"], CONFIG["heads"], 16)
    return y.sum(axis=-1)
"""


def test_a_hand_written_kernel_reading_its_own_config_follows_the_validation_shapes(tmp_path: Path) -> None:
    path = tmp_path / "optimized.py"
    path.write_text(_CONFIG_KERNEL)
    module = taskcode.load_module(path, "config_kernel_under_test")
    entry = taskcode.candidate_entry(module)
    import numpy as np

    x = np.arange(2 * 512 * 128, dtype=np.float32).reshape(2, 512, 128)  # batch and seq_len shrunk
    out = np.asarray(entry(x))
    assert out.shape == (2, 512, 8)
    np.testing.assert_allclose(out, x.reshape(2, 512, 8, 16).sum(-1))
    assert module.CONFIG == {"batch": 4, "seq_len": 2048, "heads": 8, "name": "x"}  # restored after the call
    # at its own shapes nothing changes; without a create_inputs of its own, nothing follows
    assert np.asarray(entry(np.zeros((4, 2048, 128), np.float32))).shape == (4, 2048, 8)
    del module.create_inputs
    with pytest.raises((TypeError, ValueError), match="reshape"):
        taskcode.candidate_entry(module)(x)


def _eval_json(**kw: object) -> str:
    base = {"task_id": "t", "accepted": False, "correct": True, "estimate": None, "timing": None}
    return json.dumps({**base, **kw})


def test_a_hand_written_kernel_that_compiles_for_one_generation_is_judged_there_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    both = _eval_json(
        error={"stage": "compile", "message": "Mosaic compile failed for v5e: CompileTimeScopedVmemOom"},
        tpu_compile={"v5e": {"ok": False, "error": "RESOURCE_EXHAUSTED: CompileTimeScopedVmemOom\nmore"},
                     "v6e": {"ok": True}},
    )  # fmt: skip
    alone = _eval_json(
        accepted=True,
        estimate={"estimated_speedup": 1.3, "by_generation": {"v6e": {"estimated_speedup": 1.3}}},
    )
    assert bench.compiled_for_some(both, ["v5e", "v6e"]) == (
        ["v6e"],
        {"v5e": "RESOURCE_EXHAUSTED: CompileTimeScopedVmemOom"},
    )
    assert bench.compiled_for_some(alone, ["v6e"]) is None  # accepted: nothing to retry
    wrong = json.loads(both)
    wrong["correct"] = False
    assert bench.compiled_for_some(json.dumps(wrong), ["v5e", "v6e"]) is None  # wrong kernels are not retried

    calls: list[list[str]] = []

    def fake_eval(self, task, kernel, tpu, out, suffix, scale):  # noqa: ANN001, ANN202 - stands in for the subprocess
        calls.append(list(tpu))
        text = both if len(tpu) == 2 else alone
        return subprocess.CompletedProcess([], 0 if len(tpu) == 1 else 1, stdout=text, stderr="")

    monkeypatch.setattr(bench.Bench, "_eval_human", fake_eval)
    settings = bench.BenchSettings(suite=str(SUITE), out_dir=str(tmp_path), tpu=["v5e", "v6e"])
    b = bench.Bench(settings, on_progress=lambda _: None)
    row = b.run_human(GEMM, GEMM / "optimized.py", _row("t", correct=True, estimated_speedup=1.1,
                      estimated_speedup_by_generation={"v5e": 1.2, "v6e": 1.0}), tmp_path)  # fmt: skip
    assert calls == [["v5e", "v6e"], ["v6e"]]
    assert row.human_status == "rejected" and row.human_estimated_speedup is None  # not a kernel for both
    assert row.human_generations == {
        "v5e": "does not compile: RESOURCE_EXHAUSTED: CompileTimeScopedVmemOom",
        "v6e": "accepted",
    }
    assert row.human_estimated_speedup_by_generation == {"v6e": 1.3}
    m = bench.side_by_side([row])
    assert m["human_accepted"] == 0
    assert m["by_generation"]["v6e"]["human"] == pytest.approx(1.3)
    assert m["by_generation"]["v6e"]["human_accepted"] == 1 and m["by_generation"]["v6e"]["ours_ahead"] == 0
    assert m["by_generation"]["v5e"]["human"] == pytest.approx(1.0)  # XLA's program stays on v5e
    report = "\n".join(bench.render_side_by_side([row]))
    assert "| t | ✓ | 1.10x | rejected (accepted on v6e alone) | v6e 1.30x |" in report
    b.db["results"].upsert(bench._flat(row), pk="task_id", alter=True)  # as the bench loop keeps a row
    assert bench.load_rows(tmp_path)[0].human_generations == row.human_generations


def test_a_hand_written_kernel_whose_blocks_do_not_tile_our_shapes_is_judged_at_larger_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel tuned with 2048-wide blocks raises on a sequence the default budget shrank to 1024: it is
    judged once more at the shapes a larger budget keeps, and the report says so. A kernel that ran and was
    wrong is not retried."""
    untiled = _eval_json(error={"stage": "trace", "message": "ValueError: block_q=2048 should be smaller or "
                                "equal to q_seq_len=1024\ntraceback"})  # fmt: skip
    accepted = _eval_json(
        accepted=True, correct=True, estimate={"estimated_speedup": 1.4, "by_generation": {}}
    )
    wrong = _eval_json(error={"stage": "correctness", "message": "output 0: 3 of 64 elements outside"})
    assert (
        bench.shape_refusal(untiled)
        == "trace: ValueError: block_q=2048 should be smaller or equal to q_seq_len=1024"
    )
    assert bench.shape_refusal(wrong) is None and bench.shape_refusal(accepted) is None

    calls: list[str] = []
    first = {"text": untiled}

    def fake_eval(self, task, kernel, tpu, out, suffix, scale):  # noqa: ANN001, ANN202 - stands in for the subprocess
        calls.append(scale)
        text = first["text"] if scale == bench.DEFAULT_SCALE else accepted
        return subprocess.CompletedProcess([], 0 if text == accepted else 1, stdout=text, stderr="")

    monkeypatch.setattr(bench.Bench, "_eval_human", fake_eval)
    b = bench.Bench(
        bench.BenchSettings(suite=str(SUITE), out_dir=str(tmp_path), tpu=["v5e"]), on_progress=lambda _: None
    )
    row = b.run_human(GEMM, GEMM / "optimized.py", _row("t", correct=True, estimated_speedup=1.1), tmp_path)
    assert calls == [bench.DEFAULT_SCALE, bench.HUMAN_TILE_BUDGET]
    assert row.human_status == "accepted" and row.human_estimated_speedup == pytest.approx(1.4)
    assert bench.HUMAN_TILE_BUDGET in row.human_scale_note and "block_q=2048" in row.human_scale_note
    assert "block_q=2048" in "\n".join(bench.render_side_by_side([row]))

    calls.clear()
    first["text"] = wrong
    row = b.run_human(GEMM, GEMM / "optimized.py", _row("t", correct=True, estimated_speedup=1.1), tmp_path)
    assert calls == [bench.DEFAULT_SCALE] and row.human_status == "rejected" and row.human_scale_note is None
