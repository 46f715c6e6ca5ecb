"""Tuning results are read back: a recorded winner seeds the next run's autotuner; the table exports and
imports as JSON; a measured row is never overwritten by an estimate."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from maxkernel.authors.base import TileConfig
from maxkernel.checkpointing import sqlite_checkpointer
from maxkernel.context import Context
from maxkernel.graph.agent import compile_graph
from maxkernel.nodes.autotune import _order
from maxkernel.tools.results import ArraySpec, InputConfig
from maxkernel.tools.store import ResultsStore
from maxkernel.tools.tuning_table import TunedConfig, TuningKey, TuningTable, arg_spec, bucket, device_kind

TASK = Path(__file__).parent / "data" / "tasks" / "small_matmul"
KEY = TuningKey(family="matmul", device_kind="TPU v5 lite", arg_spec="bfloat16[256,512]")


def _row(kind: str, score: float, bm: int) -> TunedConfig:
    return TunedConfig(**KEY.model_dump(), config={"bm": bm}, score_kind=kind, score=score, task_id="t")


def test_keys_bucket_shapes_and_name_the_device_kind() -> None:
    assert [bucket(n) for n in (0, 1, 2, 3, 1000, 1024, 1025)] == [1, 1, 2, 4, 1024, 1024, 2048]
    cfg = InputConfig(
        dynamic=[ArraySpec(shape=(1000, 96), dtype="bfloat16"), ArraySpec(shape=(96,), dtype="float32")],
        atol=1e-2,
        rtol=1e-2,
    )
    assert arg_spec([cfg, cfg]) == "bfloat16[1024,128],float32[128];bfloat16[1024,128],float32[128]"
    assert device_kind(["trillium"]) == device_kind(["v6e", "v5e"]) != device_kind(["v5e"])


def test_put_get_and_measured_rows_outrank_estimates(tmp_path: Path) -> None:
    table = TuningTable(ResultsStore(tmp_path / "r.db"))
    assert table.get(KEY) is None
    assert table.put(_row("estimated", 1.5, 128))
    assert table.get(KEY).config == {"bm": 128}
    assert table.put(_row("measured", 1.1, 256))
    assert not table.put(_row("estimated", 9.0, 512))  # an estimate never replaces a measurement
    assert table.get(KEY).config == {"bm": 256} and table.get(KEY).score_kind == "measured"


def test_export_and_import_through_the_cli(tmp_path: Path) -> None:
    src, dst, file = tmp_path / "a.db", tmp_path / "b.db", tmp_path / "tuning.json"
    TuningTable(ResultsStore(src)).put(_row("estimated", 2.0, 64))

    def cli(*args: str) -> str:
        cmd = [sys.executable, "-m", "maxkernel", "tuning", *args]
        return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300).stdout

    assert "1 tuned configs" in cli("export", str(file), "--store", str(src))
    assert json.loads(file.read_text())[0]["config"] == {"bm": 64}
    assert "1 of 1 tuned configs imported" in cli("import", str(file), "--store", str(dst))
    assert TuningTable(ResultsStore(dst)).get(KEY).config == {"bm": 64}


def test_a_recorded_config_is_tried_first_when_it_is_in_the_space() -> None:
    space = [TileConfig.of(bm=b) for b in (64, 128, 256, 512)]
    assert _order(space, None, 2, seed=TileConfig.of(bm=128))[0] == TileConfig.of(bm=128)
    assert TileConfig.of(bm=1024) not in _order(space, None, 2, seed=TileConfig.of(bm=1024))


def test_a_run_starts_from_the_config_recorded_for_its_family_and_shapes(tmp_path: Path) -> None:
    """What a previous run recorded (here: written directly, as `maxkernel tuning import` would) is the
    first config the autotuner evaluates, even one its own ordering would try last."""
    from maxkernel.authors.base import AuthorContext
    from maxkernel.authors.offline import OfflineAuthor
    from maxkernel.tools.tasks import load_task

    work = tmp_path / "w"
    task = load_task(str(TASK), work_dir=work)
    author = OfflineAuthor()
    actx = AuthorContext(task=task, tpu=["v5e"], work_dir=work)
    plan = author.plan(actx)
    space = [c for c in author.tuning_space(actx, plan) if c != plan.default_config]
    seed = next(c for c in reversed(space) if c not in _order(space, None, 2))
    key = TuningKey(family=plan.family, device_kind=device_kind(["v5e"]), arg_spec=arg_spec(task.configs))
    store = ResultsStore(tmp_path / "results.db")
    TuningTable(store).put(
        TunedConfig(**key.model_dump(), config=seed.as_dict(), score_kind="measured", score=1.0)
    )

    graph = compile_graph(sqlite_checkpointer(tmp_path / "checkpoints.sqlite"))
    ctx = Context(model="offline", tpu=["v5e"], store_path=str(store.path), work_dir=str(work))
    config = {"configurable": {"thread_id": "seeded"}}
    inputs = {"task_path": str(TASK), "max_iterations": 1, "tune_max_configs": 1, "out_dir": str(tmp_path)}
    graph.invoke(inputs, config, context=ctx)
    state = graph.get_state(config).values
    tuned = [a for a in state["attempts"] if a.kind == "tune"]
    assert state["tuning"]["seeded_from"] == seed.as_dict()
    assert [a.config for a in tuned] == [seed.as_dict()]
