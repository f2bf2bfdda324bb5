"""The edge's strict parse refuses a body that nests deeper than 32 levels or has
NUL in any text (a key or a value), whatever the shape around it (api/edge.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from intentledger.api.edge import MAX_JSON_DEPTH, parse_json
from intentledger.web.problems import Problem

# Text with NUL now and then, so that both answers come up often.
TEXT = st.text(st.sampled_from("ab\x00é"), max_size=3)
SCALARS = st.none() | st.booleans() | st.integers(-(10**6), 10**6) | TEXT
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=40,
)


def _too_deep(value: Any, depth: int = 1) -> bool:
    """The rule, written plainly (recursively: these values are small)."""
    if isinstance(value, dict | list):
        items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
        return depth > MAX_JSON_DEPTH or any(_too_deep(item, depth + 1) for item in items)
    return False


def _holds_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict | list):
        items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
        return any(_holds_nul(item) for item in items)
    return False


def _nest(value: Any, levels: int) -> Any:
    for level in range(levels):
        value = [value] if level % 2 else {"k": value}
    return value


@given(value=VALUES, levels=st.integers(0, MAX_JSON_DEPTH + 2))
def test_refused_exactly_when_too_deep_or_holding_nul(value: Any, levels: int) -> None:
    nested = _nest(value, levels)
    body = json.dumps(nested).encode()
    too_deep, holds_nul = _too_deep(nested), _holds_nul(nested)
    if not (too_deep or holds_nul):
        assert parse_json(body, b"application/json") == nested
        return
    with pytest.raises(Problem) as refused:
        parse_json(body, b"application/json")
    assert (refused.value.status, refused.value.slug) == (400, "malformed-json")
    # A body with both faults is told of one of them: which one, the rule
    # does not say (the walk meets text before deeper containers).
    told = {"nests deeper" in refused.value.detail, "NUL" in refused.value.detail}
    assert told == {True, False}
    assert ("nests deeper" in refused.value.detail and too_deep) or (
        "NUL" in refused.value.detail and holds_nul
    )
