"""The offline author's matmul, attention, conv, grouped-matmul, top-k and column-reduction families,
each accepted by the real harness (TPU interpret mode on 3 input sets, the Pallas check, AOT Mosaic compile
for v5e and v6e at the task's own shapes). The cases and the check live in test_offline_author.py; this
file holds the half of them that `--dist loadfile` runs beside that one."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_offline_author import check_family_is_accepted, family_cases


@pytest.fixture(scope="module")
def tasks_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("offline-family-tasks")


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("offline-family-work")


@pytest.mark.parametrize("name", family_cases(here=False))
def test_family_is_accepted_by_the_harness(name: str, tasks_root: Path, work: Path) -> None:
    check_family_is_accepted(name, tasks_root, work)
