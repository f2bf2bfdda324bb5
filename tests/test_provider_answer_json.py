"""A provider's answer is read as the standard library reads JSON
(providers/http.py: ProviderResponse.json): every digit of an integer kept,
however long, where a faster parser (orjson) silently reads one beyond 64 bits
as a float."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from intentledger.providers.http import ProviderResponse


def response(content: bytes) -> ProviderResponse:
    return ProviderResponse(200, CIMultiDictProxy(CIMultiDict()), content)


@pytest.mark.parametrize(
    "literal",
    ["18446744073709551616", "-9223372036854775809", "123456789012345678901234567890"],
)
def test_an_integer_beyond_64_bits_keeps_every_digit(literal: str) -> None:
    parsed = response(f'{{"amount": {literal}}}'.encode()).json()
    assert parsed == {"amount": int(literal)}
    assert isinstance(parsed["amount"], int)


@pytest.mark.parametrize("content", [b"", b"<html>busy</html>", b'{"id": '])
def test_what_is_not_json_is_a_value_error(content: bytes) -> None:
    with pytest.raises(ValueError):
        response(content).json()
