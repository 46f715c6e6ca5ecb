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


@pytest.fixture(scope="session")
def pg_server():
    """One real PostgreSQL server for the whole test session (see tests/pg_server.py), stopped by its PID.
    Skips only where no server binary is installed (`.ci/run` installs Debian's package)."""
    import pg_server as pg

    bindir = pg.find_bindir()
    if bindir is None:
        pytest.skip("no PostgreSQL server binaries (apt-get install postgresql)")
    server = pg.start(bindir)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def pg_url(pg_server, request: pytest.FixtureRequest) -> str:
    """A fresh, empty database on the session's server, named after the test."""
    import re

    name = "t_" + re.sub(r"[^a-z0-9]+", "_", request.node.name.lower())[:50]
    return pg_server.create_database(name)
