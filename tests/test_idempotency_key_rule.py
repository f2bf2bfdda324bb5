"""The Idempotency-Key's rule (web/validation.py): 1-255 visible ASCII
characters, bare or as a structured-field string. It is one regular
expression since issue 39 (docs/benchmarks.md, "CPU per intent, profiled");
these hold it to the rule as written character by character before."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from starlette.datastructures import Headers

from intentledger.web.problems import Problem
from intentledger.web.validation import SF_STRING, first_field, valid_idempotency_key


def rule_as_written(value: str) -> str | None:
    """The key a header value names, or None for a refusal."""
    if SF_STRING.fullmatch(value):
        value = value[1:-1]
    if not 1 <= len(value) <= 255 or not all(0x21 <= ord(c) <= 0x7E for c in value):
        return None
    return value


# Header values as Starlette hands them over: Latin-1, so any code point below 256.
HEADER_TEXT = st.text(st.characters(max_codepoint=255), max_size=300)
VISIBLE = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7F), min_size=250, max_size=260)


@given(st.one_of(HEADER_TEXT, VISIBLE, VISIBLE.map(lambda v: f'"{v}"')))
@example("")
@example("a" * 255)
@example("a" * 256)
@example("key\n")
@example("ключ")
@example('""')
@example('"a"')
@example("a b")
@example("\x7f")
def test_the_key_is_what_the_rule_as_written_says(value: str) -> None:
    expected = rule_as_written(value)
    if expected is None:
        with pytest.raises(Problem) as refused:
            valid_idempotency_key(value)
        assert refused.value.slug == "idempotency-key-invalid"
    else:
        assert valid_idempotency_key(value) == expected


# Heads as a server might hand them over: names in any case, repeated or not.
HEAD = st.lists(
    st.tuples(
        st.sampled_from([b"idempotency-key", b"Idempotency-Key", b"authorization", b"host"]),
        st.binary(max_size=8),
    ),
    max_size=6,
)


@given(HEAD)
def test_a_field_is_read_as_starlettes_headers_read_it(raw: list[tuple[bytes, bytes]]) -> None:
    """The edge, authentication and intake read the key and the token with
    `first_field` instead of building Starlette's `Headers`: the same value
    (the first, Latin-1), and names compared as given, as `Headers.get`
    compares them."""
    for name in ("idempotency-key", "authorization", "host"):
        assert first_field(raw, name.encode()) == Headers(raw=raw).get(name)
