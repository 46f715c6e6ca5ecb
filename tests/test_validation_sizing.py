"""Validation shapes chosen by a budget: the task's own generator run with its size literals changed.

The workloads under tests/data/sizing/ are written for these tests (JAXBench's and MaxKernel's formats,
no code from either): a paged decode whose page table must index the smaller pool, a paged pool whose
page size must stay whole, a conv whose batch and output channels are both 128, a group norm whose workload hard-codes its width, a generator that
returns a Python int, a reference that fails at run time above a size, a `get_inputs` that needs `jnp`
to compute a static value. Rates are fixed (`DEFAULT_RATES`) so the chosen shapes do not depend on the
machine; the budgets are tiny so these small tasks must shrink.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from maxkernel.tools import generator_knobs, taskcode
from maxkernel.tools import validation_sizing as sizing
from maxkernel.tools.harness import EvalOptions, default_timeout
from maxkernel.tools.tasks import TaskError, load_task

DATA = Path(__file__).parent / "data" / "sizing"


def _load(name: str, work: Path, seconds: float, **kw: object):
    return load_task(
        DATA / name, scale="cpu", work_dir=work, seconds_per_set=seconds, rates=sizing.DEFAULT_RATES, **kw
    )


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory):
    """Each (task, budget) loaded once for the module: a load is a sandboxed describe."""
    work = tmp_path_factory.mktemp("sizing")
    cache: dict[tuple[str, float], object] = {}

    def get(name: str, seconds: float):
        if (name, seconds) not in cache:
            cache[(name, seconds)] = _load(name, work, seconds)
        return cache[(name, seconds)]

    return get


def _shapes(cfg) -> list[tuple[int, ...]]:
    return [tuple(a.shape) for a in cfg.dynamic]


# --- the knobs ----------------------------------------------------------------------------------------


def test_knobs_are_the_generators_and_the_modules_int_literals_with_names() -> None:
    text = (DATA / "conv_batch_channels" / "baseline.py").read_text()
    knobs = generator_knobs.find_knobs(text, "module", "create_inputs")
    labels = {k.label: k.value for k in knobs}
    assert labels["batch"] == 128 and labels["cout"] == 128 and labels["cin"] == 8
    assert labels["height = width"] == 16
    # the workload's own literals are never knobs (changing them would change the problem)
    hard = (DATA / "hardcoded_groups" / "baseline.py").read_text()
    hard_knobs = generator_knobs.find_knobs(hard, "module", "create_inputs")
    assert all(k.line < hard.splitlines().index("def workload(x, w):") + 1 for k in hard_knobs)
    paged = generator_knobs.find_knobs(
        (DATA / "paged_decode" / "baseline.py").read_text(), "module", "create_inputs"
    )
    assert {k.label for k in paged} >= {"CONFIG['num_seqs']", "CONFIG['pages_per_seq']", "CONFIG['head_dim']"}


def test_applying_knobs_changes_only_those_literals() -> None:
    text = (DATA / "conv_batch_channels" / "baseline.py").read_text()
    knobs = generator_knobs.find_knobs(text, "module", "create_inputs")
    batch = next(k for k in knobs if k.label == "batch")
    changed = generator_knobs.apply(text, knobs, {batch.key: 4})
    assert "batch, cin, cout = 4, 8, 128" in changed
    assert len(changed.splitlines()) == len(text.splitlines())
    assert [a for a, b in zip(text.splitlines(), changed.splitlines(), strict=True) if a != b] == [
        "    batch, cin, cout = 128, 8, 128"
    ]
    with pytest.raises(ValueError, match="changed since"):
        generator_knobs.apply(text.replace("128, 8, 128", "999, 8, 128"), knobs, {batch.key: 4})
    assert generator_knobs.describe(knobs, {batch.key: 4}) == "batch 128->4"


def test_axis_floors_keep_tile_multiples() -> None:
    keep = sizing.Keep(2048, 2048, 2048)
    assert sizing.axis_floor(4096, "lane", keep) == 2048
    assert sizing.axis_floor(4096, "lane", sizing.Keep()) == 128
    assert sizing.axis_floor(1000, "lane", sizing.Keep()) is None  # an unaligned lane keeps its ragged edge
    assert sizing.axis_floor(24, "sublane", sizing.Keep()) == 8
    assert sizing.axis_floor(64, "leading", sizing.Keep()) == 2
    assert sizing.axis_floor(4096, "leading", keep) == 2048  # a sequence axis in [B, S, H, D] tiles too


def test_measured_rates_stay_within_a_band_of_the_defaults() -> None:
    """A timing taken on a busy machine can make a term of a difference vanish (flops "free"): such a rate
    would size validation for a machine that does not exist."""
    d = sizing.DEFAULT_RATES
    wild = sizing.Rates(
        xla_flop_s=d.xla_flop_s,
        xla_elem_s=d.xla_elem_s * 2,
        interp_flop_s=1e-18,
        interp_elem_s=d.interp_elem_s * 100,
        interp_step_s=d.interp_step_s,
        measured=True,
    )
    r = sizing.within_band(wild)
    assert r.interp_flop_s == pytest.approx(d.interp_flop_s / sizing.BAND)
    assert r.interp_elem_s == pytest.approx(d.interp_elem_s * sizing.BAND)
    assert r.xla_elem_s == pytest.approx(d.xla_elem_s * 2) and r.measured


# --- sizes the task's own generator makes ----------------------------------------------------------------


def test_a_page_table_is_made_for_the_smaller_pool(loaded) -> None:
    task = loaded("paged_decode", 0.05)
    assert task.validation_mode == "knobs"
    val = task.validation_configs[0]
    (s, h, d), (pages, t, d2), (s2, per_seq), (s3,) = _shapes(val)
    own = _shapes(task.configs[0])
    assert pages < own[1][0] and s == s2 == s3 and d == d2 == 128
    assert pages == s * per_seq  # the task's own arithmetic, at the smaller size
    # the page's tokens (a small structural knob) are kept while the counts can shrink: the kernel fetches
    # whole pages, and a validated page of 2 tokens would make a different program from the one that ships
    assert t == own[1][1] == 16
    assert "CONFIG[" in task.validation_note and "predicted" in task.validation_note
    assert task.predicted_set_seconds <= 0.05
    inputs = taskcode.own_validation_inputs(taskcode.task_source(task.model_dump()), task.model_dump())[0]
    table, lengths = inputs[2], inputs[3]
    assert table.max() < pages and sorted(table.reshape(-1).tolist()) == list(range(pages))  # a permutation
    assert lengths.max() <= per_seq * t
    # the larger check is a size the generator made too: on the search's path, or the task's own
    larger = task.larger_config
    assert larger is not None and larger.dynamic[1].shape[0] > pages


def test_the_page_size_is_kept_while_the_counts_can_shrink(loaded) -> None:
    """A page's token count is a leading axis of a [pages, tokens, heads, dim] pool, small beside the counts:
    it is shrunk last (`SMALL_KNOB`), so the validated program fetches the same whole pages as the one that
    ships (at 2 tokens a page the offline author could not read the pool page by page)."""
    task = loaded("paged_heads", 0.05)
    (_s, _h, _d), (pages, t, hkv, _d2), _, (_s2, per_seq) = _shapes(task.validation_configs[0])
    own = _shapes(task.configs[0])
    assert t == own[1][1] == 16 and hkv == own[1][2]
    assert pages < own[1][0] and per_seq < own[3][1]
    assert "CONFIG['page_size']" not in task.validation_note.split("(predicted")[0]


def test_a_length_literal_halves_with_the_pages_it_measures(loaded) -> None:
    """`max_len` sets no shape, so alone it is no knob; `pages_per_seq` alone would leave lengths past the
    smaller pages (refused). Halved together, the pool shrinks and the lengths still fit."""
    task = loaded("paged_lengths", 0.02)
    assert task.validation_mode == "knobs"
    (s, _h, _d), (pages, t, _d2), (_s2, per_seq), _ = _shapes(task.validation_configs[0])
    assert pages < 8 * 32 and pages == s * per_seq
    assert "CONFIG['max_len'] 512->" in task.validation_note
    lengths = taskcode.own_validation_inputs(taskcode.task_source(task.model_dump()), task.model_dump())[0][3]
    assert 0 < lengths.max() <= per_seq * t


def test_only_the_batch_shrinks_when_the_output_channels_are_a_lane(loaded) -> None:
    task = loaded("conv_batch_channels", 0.05)
    x, w, b = _shapes(task.validation_configs[0])
    assert x[0] < 128 and w[0] == 128 and b == (128,)  # batch 128 shrank, cout 128 did not
    assert "batch 128->" in task.validation_note and "cout" not in task.validation_note


def test_a_literal_the_workload_hard_codes_is_kept_and_said_so(loaded) -> None:
    task = loaded("hardcoded_groups", 0.003)
    x, w = _shapes(task.validation_configs[0])
    assert x[0] < 1024 and x[1] < 512  # batch_size and in_features shrank
    assert w[1] == 512  # out_features: the workload reshapes with its own 512
    assert "out_features kept at 512" in task.validation_note


def test_a_task_that_fits_is_validated_at_its_own_shapes(loaded) -> None:
    task = loaded("conv_batch_channels", 1000.0)
    assert task.validation_mode == "task"
    assert _shapes(task.validation_configs[0]) == _shapes(task.configs[0])
    assert "within the budget" in task.validation_note


def test_a_reference_that_fails_at_the_planned_size_is_retried_smaller(loaded) -> None:
    task = loaded("runtime_limit", 1000.0)
    assert task.validation_configs[0].dynamic[0].shape[0] <= 256
    assert "smaller than planned" in task.validation_note and "MemoryError" in task.validation_note
    # no larger check at the size where the reference failed
    assert task.larger_config is None or task.larger_config.dynamic[0].shape[0] < 2048


def test_timeouts_follow_the_predicted_interpret_cost(loaded) -> None:
    task = loaded("paged_decode", 0.05)
    options = EvalOptions(tpu=["v5e"])
    cheap = default_timeout(task, options, load_factor=1.0)
    slow = default_timeout(task.model_copy(update={"predicted_set_seconds": 400.0}), options, load_factor=1.0)
    assert slow > 600 > cheap  # over the usual ceiling when the validation size was predicted to need it


# --- loading as the task's own harness does -----------------------------------------------------------


def test_a_python_int_from_create_inputs_is_a_static_argument_and_inputs_are_bf16(tmp_path: Path) -> None:
    task = load_task(DATA / "static_rows", scale="tpu", work_dir=tmp_path)
    own = task.configs[0]
    assert _shapes(own) == [(512, 256)] and own.static == [256]
    assert [o.shape for o in own.outputs] == [(256, 256)]
    # JAXBench's runner calls create_inputs(dtype=jnp.bfloat16): its default here is float32
    assert own.dynamic[0].dtype == "bfloat16"


def test_a_static_computed_with_jnp_is_computed_concretely(tmp_path: Path) -> None:
    task = load_task(DATA / "jnp_static", scale="cpu", work_dir=tmp_path)
    assert task.configs[0].static == [pytest.approx(1 / np.sqrt(128))]


def test_a_non_array_before_an_array_is_refused_with_the_rule(tmp_path: Path) -> None:
    bad = tmp_path / "bad_order"
    bad.mkdir()
    (bad / "baseline.py").write_text(
        "import jax.numpy as jnp\n"
        "def create_inputs(dtype=jnp.float32):\n    return 4, jnp.ones((8, 128), dtype)\n"
        "def workload(n, x):\n    return x * n\n"
    )
    with pytest.raises(TaskError, match="return them last"):
        load_task(bad, scale="tpu", work_dir=tmp_path / "w")


def test_the_hand_written_kernel_gets_the_static_too(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    task = DATA / "static_rows"
    proc = subprocess.run(
        [sys.executable, "-m", "maxkernel", "eval", str(task), str(task / "optimized.py"), "--json", "--tpu", "v5e",
         "--store", str(tmp_path / "r.db"), "--work-dir", str(tmp_path / "w")],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(proc.stdout)
    assert res["accepted"] and res["correctness"]["ok"]


def test_scale_tiles_keeps_2048_wide_blocks_while_the_batch_can_shrink(tmp_path: Path) -> None:
    """A hand-written kernel tuned with 2048-wide blocks raises on a sequence of 512. The default search
    halves the sequence before a batch of 4 (a small count, kept as structure); `--scale tiles` halves the
    batch and the heads first, in a larger budget, and keeps the sequence a multiple of 2048."""
    default = _load("wide_blocks", tmp_path, 4.0)
    (b, h, s, d), *_ = _shapes(default.validation_configs[0])
    assert s < 2048 and b == 4
    tiles = load_task(DATA / "wide_blocks", scale="tiles", work_dir=tmp_path, rates=sizing.DEFAULT_RATES)
    (b, h, s, d), *_ = _shapes(tiles.validation_configs[0])
    assert s == 2048 and b < 4 and d == 128
    assert "CONFIG['batch'] 4->" in tiles.validation_note and "budget of 12 s" in tiles.validation_note
    assert tiles.fingerprint != default.fingerprint  # the scale decides the shapes: a different task
