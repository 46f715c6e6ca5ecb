"""Hostile candidates of issue 27's classes (what is checked must be what ships; work outside Pallas seen;
no false speed; the trusted side runs the checked program; inputs wider than the sample; bounded parsers),
the honest kernels they must not catch, and the machine's limits never charged to a kernel.

Each hostile case is cheap (the small test tasks); the bubblewrap run is the default one, the fallback twin
of a case whose defence does not depend on the isolation is marked slow (the default run judges it in
bubblewrap)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from maxkernel.tools.harness import EvalOptions, evaluate
from maxkernel.tools.results import EvalResult
from maxkernel.tools.tasks import KernelTask, TaskError, load_task

HOSTILE = Path(__file__).parent / "data" / "hostile"
CANDIDATES = Path(__file__).parent / "data" / "candidates"
OPTS = EvalOptions(tpu=["v5e"], timeout_s=150, estimate=False)
ROOT = os.geteuid() == 0


@pytest.fixture(scope="module")
def matmul(data_dir: Path, session_work: Path) -> KernelTask:
    return load_task(data_dir / "tasks" / "small_matmul", work_dir=session_work)


@pytest.fixture(scope="module")
def abs_scale(data_dir: Path, session_work: Path) -> KernelTask:
    return load_task(data_dir / "tasks" / "small_abs_scale", work_dir=session_work)


def _isolate(mode: str, monkeypatch: pytest.MonkeyPatch) -> EvalOptions:
    from maxkernel.tools import sandbox

    if mode == "fallback":
        if not ROOT:
            pytest.skip("the fallback drops to nobody only for a root agent; see the README")
        problem = sandbox.fallback_unreadable()
        if problem:
            pytest.skip(problem)
        monkeypatch.setattr(sandbox, "bubblewrap_path", lambda: None)
        return OPTS.model_copy(update={"allow_unsandboxed": True})
    if not shutil.which("bwrap"):
        pytest.skip("bubblewrap is not installed")
    return OPTS


def run(task: KernelTask, path: Path, work: Path, opts: EvalOptions) -> EvalResult:
    r = evaluate(task, path.read_text(), opts, work_dir=work)
    assert not (work / "evals").exists() or not list((work / "evals").iterdir())  # run dirs cleaned
    return r


# (candidate, stages it may end in, words the message must hold)
REJECTED = [
    ("platform_branch_kernel.py", {"pallas"}, "platform-dependent"),
    ("patch_export.py", {"consistency"}, "what was checked is not what ships"),
    ("production_tiny_blocks.py", {"consistency"}, "what was checked is not what ships"),
    ("complex_reduce.py", {"pallas"}, "stablehlo.reduce"),
    ("busywork_times_zero.py", {"pallas"}, "work, not glue"),
    ("forge_outputs.py", {"correctness"}, "output 0"),
    ("deep_tree.py", {"sandbox"}, "nested deeper"),
    ("zip_bomb_outputs.py", {"correctness"}, "decompresses to"),
]
ISOLATION_MATTERS = {"forge_outputs.py", "deep_tree.py"}
"""Cases whose fallback run is part of the default suite: patching the candidate's own process and
hostile read-back are where the two isolation modes differ. The others are decided by the same checks in
both modes; their fallback twins are slow."""


@pytest.mark.parametrize(
    ("mode", "name", "stages", "words"),
    [pytest.param("bubblewrap", n, s, w, id=f"bubblewrap-{n}") for n, s, w in REJECTED]
    + [
        pytest.param(
            "fallback", n, s, w, id=f"fallback-{n}", marks=() if n in ISOLATION_MATTERS else pytest.mark.slow
        )  # fmt: skip
        for n, s, w in REJECTED
    ],
)
def test_hostile_candidates_are_rejected(
    matmul: KernelTask, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, name: str,
    stages: set[str], words: str,
) -> None:  # fmt: skip
    import resource

    opts = _isolate(mode, monkeypatch)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    r = run(matmul, HOSTILE / name, tmp_path, opts)
    assert r.isolation == mode
    assert not r.accepted
    assert r.error is not None and r.error.stage in stages, r.error
    assert words in r.error.message, r.error.message
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 300_000  # KiB: nothing inflated here


def test_an_export_that_sniffs_its_caller_ships_what_was_checked(
    matmul: KernelTask, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel that hands the export (its call stack, a second call) a zeros kernel: traced once per shape,
    it never sees the export, so what ships is the kernel that was checked, and it is right."""
    r = run(matmul, HOSTILE / "export_sniff.py", tmp_path, _isolate("bubblewrap", monkeypatch))
    assert r.accepted, r.error
    assert r.correctness.larger is not None and r.correctness.larger.ok


def test_wrong_only_outside_the_public_sample_is_caught(
    data_dir: Path, session_work: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = load_task(data_dir / "tasks" / "small_gelu", work_dir=session_work)
    r = run(task, HOSTILE / "wrong_outside_sample.py", tmp_path, _isolate("bubblewrap", monkeypatch))
    assert not r.accepted and r.error is not None and r.error.stage == "correctness", r.error
    assert r.correctness.sets[0].ok  # the task's own inputs: right there
    assert not all(s.ok for s in r.correctness.sets)


@pytest.mark.parametrize("mode", ["bubblewrap", pytest.param("fallback", marks=pytest.mark.slow)])
def test_floordiv_modulo_and_sign_kernels_are_accepted(
    abs_scale: KernelTask, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """`//` and `%` in index maps and `jnp.sign` in the body: on a CPU-only host their TPU lowering asks for
    the device's TPU kind, which a CPU does not have; lowered for the first target's kind, they pass."""
    r = run(abs_scale, CANDIDATES / "flat_grid_sign.py", tmp_path, _isolate(mode, monkeypatch))
    assert r.accepted, r.error
    assert r.tpu_compile["v5e"].ok
    assert r.correctness.interpret_modes == ["plain+tpu", "plain"]


def test_small_glue_after_a_kernel_is_judged_by_its_cost(
    data_dir: Path, session_work: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = load_task(data_dir / "tasks" / "small_rowmax_mean", work_dir=session_work)
    r = run(task, CANDIDATES / "row_max_mean.py", tmp_path, _isolate("bubblewrap", monkeypatch))
    assert r.accepted, r.error
    assert any("small glue outside Pallas" in w and "reduce_sum" in w for w in r.warnings), r.warnings


def test_manual_dma_in_a_data_dependent_loop_withholds_the_estimate(
    abs_scale: KernelTask, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opts = _isolate("bubblewrap", monkeypatch).model_copy(update={"estimate": True})
    r = run(abs_scale, CANDIDATES / "manual_dma_dynamic_loop.py", tmp_path, opts)
    assert r.accepted, r.error
    assert r.estimate is not None and r.estimate.estimated_seconds is None
    assert r.estimate.estimated_speedup is None
    assert any("manual DMA" in w and "depends on data" in w for w in r.warnings), r.warnings


def test_a_yaml_alias_bomb_is_refused_unexpanded(data_dir: Path, tmp_path: Path) -> None:
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(TaskError, match="alias"):
        load_task(data_dir / "tasks" / "yaml_bomb", work_dir=tmp_path)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000  # KiB
