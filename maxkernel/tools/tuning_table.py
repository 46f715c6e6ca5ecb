"""Tuned configs, written by the autotuner and read back by the next run (a tokamax-style tuning table).

A row says: for this kernel family on this device kind, at argument shapes in this bucket, this config won
(ranked by a measured or an estimated figure, as `score_kind` says). The autotune node looks the key up
before it tunes and tries the recorded config first, so a second run of the same (or a same-shaped) task
starts from what the last one found. The table lives in the results store and is exported to / imported
from a JSON file (`maxkernel tuning export|import`) so tuning done on one machine seeds runs on another.

Shapes are bucketed (each dimension rounded up to a power of two) as tokamax buckets its keys: a config
tuned for 1000x1000 is a good first guess at 1024x1024, and a guess is all it is: the autotuner still
evaluates it, and only a config that is in the current tuning space is tried at all.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from maxkernel.tools.results import SCORE_RANKS, InputConfig
from maxkernel.tools.store import ResultsStore
from maxkernel.tools.tpu_specs import first_generation, get_spec

TABLE = "tuned_configs"
KEY_FIELDS = ("family", "device_kind", "arg_spec")


def bucket(n: int) -> int:
    """The power of two at or above `n` (1 for 0 and 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def arg_spec(configs: Iterable[InputConfig]) -> str:
    """The bucketed dtypes and shapes of a task's dynamic arguments, one group per input configuration:
    `bfloat16[256,512],bfloat16[512,512]` (configurations joined by `;`)."""
    return ";".join(
        ",".join(f"{a.dtype}[{','.join(str(bucket(d)) for d in a.shape)}]" for a in c.dynamic)
        for c in configs
    )


def device_kind(generations: list[str]) -> str:
    """The device kind a tuning is keyed by: that of the generation estimates are ranked on (the first)."""
    return get_spec(first_generation(generations)).device_kind


class TuningKey(BaseModel):
    model_config = ConfigDict(frozen=True)

    family: str = Field(description="kernel family from the author's plan, e.g. 'matmul'")
    device_kind: str = Field(description="`jax.Device.device_kind` of the generation it was ranked on")
    arg_spec: str = Field(description="bucketed argument dtypes and shapes, see `arg_spec`")


class TunedConfig(TuningKey):
    config: dict[str, int | str]
    score_kind: str = Field(description="'measured' or 'estimated': what ranked the winner")
    score: float = Field(description="speedup of kind `score_kind` (vs the task's reference)")
    task_id: str = ""
    source_hash: str = ""
    created_at: str = ""


class TuningTable:
    """The `tuned_configs` table of a results store."""

    def __init__(self, store: ResultsStore) -> None:
        self.store = store
        with store.sql.schema_lock():  # threads and processes may create it at once
            store.sql.create_table(
                TABLE,
                {
                    "family": str,
                    "device_kind": str,
                    "arg_spec": str,
                    "config": str,
                    "score_kind": str,
                    "score": float,
                    "task_id": str,
                    "source_hash": str,
                    "created_at": str,
                },
                pk=KEY_FIELDS,
            )

    def get(self, key: TuningKey) -> TunedConfig | None:
        rows = list(
            self.store.sql.query(
                f"select * from {TABLE} where family = ? and device_kind = ? and arg_spec = ?",
                [key.family, key.device_kind, key.arg_spec],
            )
        )
        return _entry(rows[0]) if rows else None

    def put(self, entry: TunedConfig) -> bool:
        """Record a winner; returns whether it was written. The latest winner replaces the row, except that
        an estimated winner never replaces a measured one."""
        old = self.get(entry)
        if old is not None and SCORE_RANKS.get(entry.score_kind, 0) < SCORE_RANKS.get(old.score_kind, 0):
            return False
        row = entry.model_dump()
        row["config"] = json.dumps(entry.config, sort_keys=True)
        row["created_at"] = entry.created_at or datetime.now(UTC).isoformat(timespec="seconds")
        self.store.sql.upsert(TABLE, row, pk=KEY_FIELDS)
        return True

    def export(self) -> list[dict[str, Any]]:
        """Every row, as JSON-ready dicts, in key order."""
        rows = self.store.sql.query(f"select * from {TABLE} order by family, device_kind, arg_spec")
        return [_entry(r).model_dump() for r in rows]

    def import_rows(self, rows: Iterable[dict[str, Any]]) -> int:
        """Load exported rows (validated); returns how many were written (see `put`'s rule)."""
        return sum(self.put(TunedConfig.model_validate(r)) for r in rows)


def _entry(row: dict[str, Any]) -> TunedConfig:
    return TunedConfig.model_validate({**row, "config": json.loads(row["config"])})
