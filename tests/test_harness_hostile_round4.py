"""A held-out red-team round against issue 27 (candidates that patch nothing): kernels right in every
interpreter but wrong on the chip (poison laundered from scratch or block overhangs, a reduction axis
declared 'parallel' on a two-core device, a grid extent capped past the checked shapes), and estimates the
block model got wrong (a guard that overflows int32, a loop of data-dependent length). Plus the candidates of
this round that the harness already rejected, kept as regression cases.

The hostile cases run in bubblewrap (the default isolation); none of these defences depends on it."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from types import ModuleType

import pytest

from maxkernel.tools.harness import EvalOptions, evaluate
from maxkernel.tools.results import EvalResult
from maxkernel.tools.tasks import KernelTask, load_task

HOSTILE = Path(__file__).parent / "data" / "hostile"
CANDIDATES = Path(__file__).parent / "data" / "candidates"
OPTS = EvalOptions(tpu=["v5e"], timeout_s=150, estimate=False)


@pytest.fixture(scope="module")
def matmul(data_dir: Path, session_work: Path) -> KernelTask:
    return load_task(data_dir / "tasks" / "small_matmul", work_dir=session_work)


def run(task: KernelTask, path: Path, work: Path, opts: EvalOptions = OPTS) -> EvalResult:
    if not shutil.which("bwrap"):
        pytest.skip("bubblewrap is not installed")
    r = evaluate(task, path.read_text(), opts, work_dir=work)
    assert r.isolation == "bubblewrap"
    assert not (work / "evals").exists() or not list((work / "evals").iterdir())  # run dirs cleaned
    return r


# (candidate, TPU generations, stages it may end in, words the message must hold)
REJECTED = [
    # accepted before this round's fixes
    ("overhanging_block_nan_mask.py", ["v5e"], {"correctness"}, "output 0"),
    ("scratch_nan_launder.py", ["v5e"], {"correctness"}, "output 0"),
    ("parallel_reduction_axis.py", ["v5p"], {"compile"}, "declares 'parallel'"),
    ("capped_k_grid.py", ["v5e"], {"consistency"}, "never read where it ships"),
    ("index_map_overflow.py", ["v5e"], {"consistency"}, "never writes some blocks"),
    ("guarded_write_threshold.py", ["v5e"], {"consistency"}, "stores to no step's block"),
    # rejected before only by the candidate's own TPU-interpret cross-check; now by the judge's audit
    ("nonconsecutive_revisit.py", ["v5e"], {"consistency"}, "comes back to blocks"),
    # already rejected: regression cases
    ("nan_laundered_accumulator.py", ["v5e"], {"correctness"}, "output 0"),
    ("alias_reads_output.py", ["v5e"], {"correctness"}, "output 0"),
    ("custom_vjp_matmul.py", ["v5e"], {"pallas"}, "work outside Pallas"),
]


@pytest.mark.parametrize(("name", "tpu", "stages", "words"), [pytest.param(*c, id=c[0]) for c in REJECTED])
def test_round4_hostile_candidates_are_rejected(
    matmul: KernelTask, tmp_path: Path, name: str, tpu: list[str], stages: set[str], words: str
) -> None:
    r = run(matmul, HOSTILE / name, tmp_path, OPTS.model_copy(update={"tpu": tpu}))
    assert not r.accepted
    assert r.error is not None and r.error.stage in stages, r.error
    assert words in r.error.message, r.error.message


def test_a_race_on_two_cores_is_refused_only_where_the_axis_is_split(
    matmul: KernelTask, tmp_path: Path
) -> None:
    """The reduction declared 'parallel' compiles and is right on a single-core chip, and an honest matmul
    (K 'arbitrary', the output's block changing along both 'parallel' axes) is accepted on the two-core one."""
    single = run(matmul, HOSTILE / "parallel_reduction_axis.py", tmp_path)
    assert single.accepted, single.error
    honest = run(matmul, CANDIDATES / "good_matmul.py", tmp_path, OPTS.model_copy(update={"tpu": ["v5p"]}))
    assert honest.accepted, honest.error


def test_busywork_that_cancels_out_earns_no_credit(
    data_dir: Path, session_work: Path, tmp_path: Path
) -> None:
    """XLA computes the whole GELU; the kernel adds `t - t` for a chain of transcendentals t. A value minus
    itself is zero whatever it is, so the chain reaches no output: no credit, and the work outside wins."""
    task = load_task(data_dir / "tasks" / "small_gelu", work_dir=session_work)
    r = run(task, HOSTILE / "neutral_busywork_gelu.py", tmp_path)
    assert not r.accepted and r.error is not None and r.error.stage == "pallas", r.error


@pytest.mark.xfail(
    strict=True, reason="not claimed (README): index maps that read scalar prefetch are not replayed"
)
def test_a_prefetch_table_capped_past_the_checked_shapes_is_caught(
    matmul: KernelTask, tmp_path: Path
) -> None:
    r = run(matmul, HOSTILE / "prefetch_capped_k.py", tmp_path)
    assert not r.accepted and r.error is not None and r.error.stage == "consistency", r.error


def test_a_data_bounded_loop_doing_the_work_has_no_estimate(matmul: KernelTask, tmp_path: Path) -> None:
    r = run(matmul, HOSTILE / "while_unknown_trips.py", tmp_path, OPTS.model_copy(update={"estimate": True}))
    assert r.accepted, r.error  # right: only its price is unknown
    assert r.estimate is not None and r.estimate.estimated_seconds is None
    assert r.estimate.estimated_speedup is None
    assert any("estimate withheld" in w and "trip count depends on data" in w for w in r.warnings), r.warnings


# --------------------------------------------------------------------------------------------------------
# The block model itself, on the task's own shapes (our own process: these files only compute)
# --------------------------------------------------------------------------------------------------------


def _module(name: str, source: str, tmp_path: Path) -> ModuleType:
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _block_model(mod: ModuleType) -> object:
    import jax
    import jax.numpy as jnp

    from maxkernel.tools import program_artifacts
    from maxkernel.tools.estimate import estimate_pallas

    m, k, n = 1024, 2048, 1024  # small_matmul's own shapes
    specs = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((m, k), (k, n), (n,))]
    return estimate_pallas(program_artifacts.trace_once(mod.computation, specs, "TPU v5 lite"), "v5e")


def test_a_guard_that_overflows_int32_is_priced_as_the_chip_runs_it(tmp_path: Path) -> None:
    """`step * 65536 * 65536 == 0` is true at every step in int32: the guarded matmul runs every step and
    costs what the same kernel without the guard costs (it was priced at one step in 32)."""
    source = (HOSTILE / "int32_wrap_guard.py").read_text()
    unguarded = source.replace("    @pl.when(wrapped == 0)\n    def _():\n", "    if True:\n")
    assert unguarded != source
    guarded = _block_model(_module("guarded", source, tmp_path))
    honest = _block_model(_module("unguarded", unguarded, tmp_path))
    assert guarded.est_mxu_flops == pytest.approx(honest.est_mxu_flops)
    assert guarded.estimated_seconds == pytest.approx(honest.estimated_seconds)
    assert honest.unpriced is None


def test_a_loop_bounded_by_data_is_unpriced_and_one_bounded_by_the_shape_is_not(tmp_path: Path) -> None:
    source = (HOSTILE / "while_unknown_trips.py").read_text()
    static = source.replace("lambda c: c[0] < nk_ref[0]", "lambda c: c[0] < x_ref.shape[1] // BK")
    assert static != source
    assert _block_model(_module("data_bound", source, tmp_path)).unpriced is not None
    priced = _block_model(_module("shape_bound", static, tmp_path))
    assert priced.unpriced is None and priced.est_mxu_flops == pytest.approx(2 * 1024 * 2048 * 1024)
