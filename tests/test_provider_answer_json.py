"""A provider's answer is parsed by orjson, and by the standard library where
orjson refuses (providers/http.py: ProviderResponse.json): what both read, they
read alike, and what only the standard library reads is still read."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from multidict import CIMultiDict, CIMultiDictProxy

from intentledger.providers.http import ProviderResponse

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


def response(content: bytes) -> ProviderResponse:
    return ProviderResponse(200, CIMultiDictProxy(CIMultiDict()), content)


@given(json_values, st.booleans())
def test_what_both_parsers_read_is_read_alike(value: Any, ascii_only: bool) -> None:
    content = json.dumps(value, ensure_ascii=ascii_only).encode()
    # repr: 1 == 1.0 and 0.0 == -0.0 would hide a difference.
    assert repr(response(content).json()) == repr(json.loads(content))


@pytest.mark.parametrize(
    "content",
    [
        b'{"amount": NaN}',
        b'{"amount": 123456789012345678901234567890}',
        b'{"amount": 18446744073709551616}',
        b'{"amount": -9223372036854775809}',
        b'{"amount": 1e400}',
        b'\xef\xbb\xbf{"id": "ch_1"}',
        '{"id": "ch_1"}'.encode("utf-16"),
        b'{"name": "\\ud800"}',
    ],
    ids=["nan", "big-integer", "2**64", "below--2**63", "1e400", "utf-16", "bom", "surrogate"],
)
def test_what_only_the_standard_library_reads_is_still_read(content: bytes) -> None:
    parsed, expected = response(content).json(), json.loads(content)
    # repr: NaN is not equal to itself, and 1 == 1.0 would hide a lost integer.
    assert repr(parsed) == repr(expected)


@pytest.mark.parametrize("content", [b"", b"<html>busy</html>", b'{"id": '])
def test_what_neither_reads_is_a_value_error(content: bytes) -> None:
    with pytest.raises(ValueError):
        response(content).json()
