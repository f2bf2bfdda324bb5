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


def _acceptable(value: Any, depth: int = 1) -> bool:
    """The rule, written plainly (recursively: these values are small)."""
    if isinstance(value, str):
        return "\x00" not in value
    if isinstance(value, dict):
        return depth <= MAX_JSON_DEPTH and all(
            _acceptable(key, depth + 1) and _acceptable(item, depth + 1)
            for key, item in value.items()
        )
    if isinstance(value, list):
        return depth <= MAX_JSON_DEPTH and all(_acceptable(item, depth + 1) for item in value)
    return True


def _nest(value: Any, levels: int) -> Any:
    for level in range(levels):
        value = [value] if level % 2 else {"k": value}
    return value


@given(value=VALUES, levels=st.integers(0, MAX_JSON_DEPTH + 2))
def test_refused_exactly_when_too_deep_or_holding_nul(value: Any, levels: int) -> None:
    nested = _nest(value, levels)
    body = json.dumps(nested).encode()
    if _acceptable(nested):
        assert parse_json(body, b"application/json") == nested
    else:
        with pytest.raises(Problem) as refused:
            parse_json(body, b"application/json")
        assert refused.value.status == 400
