"""The app's state (api/app.py: AppState) behaves as Starlette's `State`: its
values are only kept where the ordinary attribute lookup finds them."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy.ext.asyncio import create_async_engine
from starlette.datastructures import State

from intentledger.api.app import AppState, create_api
from intentledger.engine.clock import system_clock

# Intake's names, and names that meet State's own: its store, and methods it has not.
ALL_NAMES = ["engine", "clock", "provider_name", "intake_groups", "_state", "keys", "get"]
NAMES = st.sampled_from(ALL_NAMES)
OPERATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("set"), NAMES, st.integers()),
        st.tuples(st.just("set_item"), NAMES, st.integers()),
        st.tuples(st.just("delete"), NAMES, st.none()),
        st.tuples(st.just("delete_item"), NAMES, st.none()),
    ),
    max_size=30,
)


def observe(state: State, names: list[str]) -> dict[str, Any]:
    """Everything a reader can see of `state`: each name read three ways, and the whole."""
    seen: dict[str, Any] = {"iter": sorted(state), "len": len(state)}
    for name in names:
        seen[f"getattr {name}"] = getattr(state, name, "missing")
        try:
            seen[f"item {name}"] = state[name]
        except KeyError:
            seen[f"item {name}"] = "KeyError"
        try:
            seen[f"attribute {name}"] = state.__getattr__(name)
        except AttributeError as exc:
            seen[f"attribute {name}"] = type(exc).__name__
    return seen


def apply(state: State, operation: tuple[str, str, Any]) -> str:
    kind, name, value = operation
    try:
        if kind == "set":
            setattr(state, name, value)
        elif kind == "set_item":
            state[name] = value
        elif kind == "delete":
            delattr(state, name)
        else:
            del state[name]
    except (AttributeError, KeyError) as exc:
        return type(exc).__name__
    return "ok"


@given(OPERATIONS)
def test_app_state_answers_as_starlettes_state(operations: list[tuple[str, str, Any]]) -> None:
    ours, theirs = AppState(), State()
    for operation in operations:
        assert apply(ours, operation) == apply(theirs, operation), operation
        assert observe(ours, ALL_NAMES) == observe(theirs, ALL_NAMES), operation


def test_its_values_need_no_getattr_call() -> None:
    """What the change is for: a value is an attribute of the instance, so
    reading it never reaches `__getattr__`."""
    state = AppState()
    state.provider_name = "sandbox"
    assert vars(state) == {"provider_name": "sandbox"}
    with pytest.raises(AttributeError, match="'AppState' object has no attribute 'engine'"):
        _ = state.engine


def test_the_api_keeps_its_state_there() -> None:
    engine = create_async_engine("sqlite+aiosqlite://")
    app = create_api(engine, system_clock, "sandbox")
    assert isinstance(app.state, AppState)
    assert vars(app.state)["provider_name"] == "sandbox"
    assert {"engine", "intake_groups", "replay_window"} <= set(app.state)
