"""Checkpoints may revive only the types `STATE_TYPES` names, and that list is derived from the state models.
These tests fail if a pydantic model reachable from a graph's state would be blocked on resume."""

from __future__ import annotations

import logging
import types
import typing
from typing import Any

import pytest
from langchain_core.messages import AIMessage, BaseMessage
from pydantic import BaseModel

from maxkernel.checkpointing import DEFAULT_CHECKPOINTS, reachable_models, serializer, state_types
from maxkernel.state import AgentState, BranchTask, SearchState

_SCALARS: dict[type, Any] = {str: "x", int: 1, float: 1.5, bool: True}


def _value_for(annotation: Any, depth: int) -> Any:
    """A value of the annotated type, filling nested models all the way down (so every model reachable
    from the state is present in the checkpoint, not left at its None default)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseMessage):
        # LangChain messages (a step's tool conversation): a real one, as the model's turn would be
        return AIMessage(content="x", tool_calls=[{"name": "t", "args": {"a": 1}, "id": "c1"}])
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return _filled(annotation, depth + 1)
    if annotation in _SCALARS:
        return _SCALARS[annotation]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:  # Annotated[list[X], reducer], Annotated[X, Tag(...)]
        return _value_for(args[0], depth)
    if origin is typing.Literal:
        return args[0]
    if origin is list:
        return [_value_for(args[0], depth)]
    if origin is dict:  # a key of the declared type (positions are ints: InputConfig.index_values)
        return {_value_for(args[0], depth) if args[0] in _SCALARS else "k": _value_for(args[1], depth)}
    if origin is tuple:
        return tuple(_value_for(a, depth) for a in args if a is not Ellipsis)
    if origin is typing.Union or isinstance(annotation, types.UnionType):
        chosen = [a for a in args if a is not type(None)]
        models = [a for a in chosen if isinstance(a, type) and issubclass(a, BaseModel)]
        return _value_for((models or chosen)[0], depth)
    return None


def _filled(model: type[BaseModel], depth: int = 0) -> BaseModel:
    assert depth < 12, f"model nesting too deep at {model}"
    values = {name: _value_for(info.annotation, depth) for name, info in model.model_fields.items()}
    return model.model_construct(**values)


def _models_in_instance(obj: Any, found: set[type[BaseModel]]) -> None:
    if isinstance(obj, BaseModel):
        found.add(type(obj))
        for name in type(obj).model_fields:
            _models_in_instance(getattr(obj, name, None), found)
    elif isinstance(obj, list | tuple):
        for x in obj:
            _models_in_instance(x, found)
    elif isinstance(obj, dict):
        for x in obj.values():
            _models_in_instance(x, found)


@pytest.mark.parametrize("root", [AgentState, SearchState, BranchTask])
def test_every_model_in_a_full_state_survives_a_checkpoint(root: type[BaseModel], caplog) -> None:
    state = _filled(root)
    found: set[type[BaseModel]] = set()
    _models_in_instance(state, found)
    assert len(found) >= 2  # the filler really nested models
    allowed = set(state_types())
    missing = {(m.__module__, m.__qualname__) for m in found} - allowed
    assert not missing, f"not allowed in checkpoints (resume would break): {missing}"

    ser = serializer()
    with caplog.at_level(logging.WARNING):
        back = ser.loads_typed(ser.dumps_typed({"v": state}))["v"]
    assert "Blocked deserialization" not in caplog.text
    assert type(back) is root
    revived: set[type[BaseModel]] = set()
    _models_in_instance(back, revived)
    assert revived == found


def test_a_new_model_in_the_state_is_registered_without_a_hand_edit() -> None:
    class Extra(BaseModel):
        value: int = 0

    class Wider(AgentState):
        extras: typing.Annotated[list[Extra], "reducer"] = []
        maybe: dict[str, Extra | None] = {}

    assert Extra in reachable_models([Wider])
    assert AgentState in reachable_models([Wider])  # bases too


def test_state_types_cover_what_was_listed_by_hand_before() -> None:
    before = {
        ("maxkernel.tools.tasks", "KernelTask"),
        *(
            ("maxkernel.tools.results", n)
            for n in (
                "InputConfig",
                "ArraySpec",
                "EvalResult",
                "StageError",
                "PallasCheck",
                "CorrectnessResult",
                "SetCheck",
                "CompileOutcome",
                "MeasuredTiming",
                "EstimateSummary",
            )
        ),  # fmt: skip
        ("maxkernel.authors.base", "Plan"),
        ("maxkernel.authors.base", "TileConfig"),
        *(("maxkernel.state", n) for n in ("Budgets", "Usage", "Attempt", "HumanFeedback", "AgentState")),
        *(("maxkernel.state", n) for n in ("BranchTask", "SearchNode", "SearchInput", "SearchState")),
    }
    assert before <= set(state_types())


def test_default_checkpoint_home() -> None:
    from maxkernel.cli import agent_commands, convert_command

    assert DEFAULT_CHECKPOINTS == "checkpoints/maxkernel.sqlite"
    assert agent_commands.DEFAULT_CHECKPOINTS is DEFAULT_CHECKPOINTS
    assert convert_command.DEFAULT_CHECKPOINTS is DEFAULT_CHECKPOINTS
