"""Shared fixtures: test tasks and candidates live in tests/data; sandboxes run under tmp dirs."""

from __future__ import annotations

from pathlib import Path

import pytest

from maxkernel.tools.tpu_specs import allow_concurrent_compile_only_libtpu

# Tests trace and AOT-compile in-process, and several test runs may share this machine: let each load
# libtpu compile-only (see the function's docstring) before anything initialises a JAX backend.
allow_concurrent_compile_only_libtpu()

DATA = Path(__file__).parent / "data"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def data_dir() -> Path:
    return DATA


@pytest.fixture(scope="session")
def session_work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("maxkernel-work")
