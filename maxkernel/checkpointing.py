"""Where LangGraph checkpoints go and which types they may hold.

Checkpoints hold the graphs' state, which nests pydantic models from several modules. LangGraph's msgpack
serializer revives a model only if its (module, name) is allowed; an unlisted one makes a resumed run fail
(or, in newer LangGraph, be refused). `STATE_TYPES` is therefore derived by walking the state models' field
annotations, so a new model reachable from the state is allowed the moment it is used there, and
`tests/test_checkpointing.py` fails if the walk ever misses one.

The default home is `checkpoints/maxkernel.sqlite` relative to the directory a command runs in (beside the
results store's `.maxkernel/`); `--checkpoint-db` (or `MAXKERNEL_CHECKPOINT_DB`) overrides it with another
path or a `postgresql://` URL. PostgreSQL checkpoints go through LangGraph's PostgresSaver over the same
per-process connection pool the results store uses (`tools/store_sql.py`: connect timeout, clear errors);
its tables are created by `setup()` under an advisory lock, so runs starting together do not race.
"""

from __future__ import annotations

import sqlite3
import types
import typing
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from maxkernel.state import AgentState, SearchState
from maxkernel.tools.store_sql import (
    DatabaseUnavailable,
    advisory_lock,
    enable_wal,
    is_postgres,
    postgres_pool,
)

DEFAULT_CHECKPOINTS = "checkpoints/maxkernel.sqlite"
"""The one default checkpoint location (relative to the current directory), used by the CLI and README."""

STATE_ROOTS: tuple[type[BaseModel], ...] = (AgentState, SearchState)
"""The graphs' state models (and through their fields, everything a checkpoint can hold). `BranchTask`
travels in `Send` packets, which are checkpointed too, so it is a root as well."""


def _models_in(annotation: Any) -> Iterable[type[BaseModel]]:
    """Pydantic model classes named anywhere inside a (resolved) annotation: X, X | None, list[X],
    dict[str, X], Annotated[list[X], reducer], Literal[...] (none)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
        return
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return
    if origin is typing.Annotated:
        yield from _models_in(typing.get_args(annotation)[0])
        return
    if origin is not None or isinstance(annotation, types.UnionType):
        for arg in typing.get_args(annotation):
            yield from _models_in(arg)


def reachable_models(roots: Iterable[type[BaseModel]]) -> list[type[BaseModel]]:
    """Every pydantic model reachable from `roots` through field annotations and base classes, in a stable
    (discovery) order."""
    seen: dict[type[BaseModel], None] = {}
    todo = list(roots)
    while todo:
        model = todo.pop(0)
        if model in seen:
            continue
        seen[model] = None
        todo.extend(b for b in model.__mro__[1:] if issubclass(b, BaseModel) and b is not BaseModel)
        for info in model.model_fields.values():
            todo.extend(_models_in(info.annotation))
    return list(seen)


@cache
def state_types() -> tuple[tuple[str, str], ...]:
    """(module, class name) of every model a checkpoint may revive."""
    from maxkernel.state import BranchTask

    return tuple((m.__module__, m.__qualname__) for m in reachable_models((*STATE_ROOTS, BranchTask)))


def serializer() -> Any:
    from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

    return JsonPlusSerializer(allowed_msgpack_modules=list(state_types()))


def sqlite_checkpointer(path: str | Path) -> Any:
    from langgraph.checkpoint.sqlite import SqliteSaver

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(str(path), check_same_thread=False, timeout=60)
    enable_wal(conn)
    return SqliteSaver(conn, serde=serializer())


def postgres_checkpointer(url: str) -> Any:
    """PostgresSaver on the process's pool for `url`, its tables created (idempotent). Raises
    `DatabaseUnavailable` when the server cannot be used or the extra is not installed."""
    try:
        from langgraph.checkpoint.postgres import PostgresSaver
    except ImportError as exc:
        raise DatabaseUnavailable(
            "a postgresql:// checkpoint URL needs the postgres extra: pip install 'maxkernel[postgres]'"
        ) from exc
    pool = postgres_pool(url)
    saver = PostgresSaver(pool, serde=serializer())
    # setup() runs LangGraph's migrations; two processes running them at once collide on the migrations
    # table, so they take turns.
    with advisory_lock(pool, "maxkernel-checkpoint-setup"):
        saver.setup()
    return saver


def checkpointer_for(url_or_path: str = DEFAULT_CHECKPOINTS) -> Any:
    """SqliteSaver for a path (default `DEFAULT_CHECKPOINTS`), PostgresSaver for a postgresql:// URL."""
    if is_postgres(url_or_path):
        return postgres_checkpointer(url_or_path)
    return sqlite_checkpointer(url_or_path)
