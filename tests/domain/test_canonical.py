from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from decimal import Decimal
from enum import IntEnum, StrEnum
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from intentledger.domain import canonical
from intentledger.domain.canonical import canonical_json, request_hash

# --- shape ----------------------------------------------------------------------------


def test_keys_sorted_and_no_whitespace() -> None:
    value = {"b": [1, {"z": None, "a": True}], "a": "x", "": False}
    assert canonical_json(value) == b'{"":false,"a":"x","b":[1,{"a":true,"z":null}]}'


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, b"null"),
        (True, b"true"),
        (False, b"false"),
        ("", b'""'),
        ([], b"[]"),
        ({}, b"{}"),
        ([[], {}], b"[[],{}]"),
    ],
)
def test_scalars_and_empty_containers(value: object, expected: bytes) -> None:
    assert canonical_json(value) == expected


def test_keys_sort_by_utf16_code_units_as_rfc8785_section_3_2_3() -> None:
    # The sorting example of RFC 8785 §3.2.3.
    value = {
        "\u20ac": "Euro Sign",
        "\r": "Carriage Return",
        "\ufb33": "Hebrew Letter Dalet With Dagesh",
        "1": "One",
        "\U0001f600": "Emoji: Grinning Face",
        "\u0080": "Control",
        "\u00f6": "Latin Small Letter O With Diaeresis",
    }
    pairs = json.loads(canonical_json(value), object_pairs_hook=lambda items: items)
    assert [name for _, name in pairs] == [
        "Carriage Return",
        "One",
        "Control",
        "Latin Small Letter O With Diaeresis",
        "Euro Sign",
        "Emoji: Grinning Face",  # U+1F600 is D83D DE00 in UTF-16: before U+FB33
        "Hebrew Letter Dalet With Dagesh",
    ]


# --- strings --------------------------------------------------------------------------


def test_string_escapes_as_rfc8785_section_3_2_2_2() -> None:
    value = "\u20ac$\u000f\u000aA'\u0042\u0022\u005c\\\"/"
    assert canonical_json(value) == '"€$\\u000f\\nA\'B\\"\\\\\\\\\\"/"'.encode()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("\b\t\n\f\r", b'"\\b\\t\\n\\f\\r"'),
        ("\x00\x1f", b'"\\u0000\\u001f"'),
        ("\x7f", b'"\x7f"'),  # DEL is not a JSON control character
        ("\u2028\u2029", '"\u2028\u2029"'.encode()),
        ("é", '"é"'.encode()),
        ("\U0001f600", '"\U0001f600"'.encode()),
        ("/", b'"/"'),
    ],
)
def test_only_what_json_requires_is_escaped(text: str, expected: bytes) -> None:
    assert canonical_json(text) == expected


@pytest.mark.parametrize("value", ["\ud800", ["a\udfff"], {"\ud83d": 1}])
def test_lone_surrogates_are_refused(value: object) -> None:
    with pytest.raises(ValueError, match="surrogate"):
        canonical_json(value)


# --- numbers --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, b"0"),
        (-7, b"-7"),
        (1.0, b"1"),
        (-0.0, b"0"),
        (0.0, b"0"),
        (1.5, b"1.5"),
        (0.1, b"0.1"),
        (-2.5e-07, b"-2.5e-07"),
        (1e-07, b"1e-07"),
        (123456789.0, b"123456789"),
        (2.0**53, b"9007199254740992"),
        (-(2.0**53), b"-9007199254740992"),
        (2.0**53 + 2, b"9007199254740994.0"),  # beyond 2**53: Python's repr
        (1e16, b"1e+16"),
        (1.7976931348623157e308, b"1.7976931348623157e+308"),
        (5e-324, b"5e-324"),
        (2**53 + 1, b"9007199254740993"),  # ints are exact at any size
        (10**30, b"1" + b"0" * 30),
    ],
)
def test_one_number_form(value: float, expected: bytes) -> None:
    assert canonical_json(value) == expected


def test_integral_float_and_int_are_the_same_value() -> None:
    assert canonical_json({"amount": 1000.0}) == canonical_json({"amount": 1000})
    assert request_hash("a", "/r", {"n": 1.0}) == request_hash("a", "/r", {"n": 1})


def test_booleans_are_not_numbers() -> None:
    assert canonical_json([True, 1, False, 0]) == b"[true,1,false,0]"


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), [1, float("nan")]])
def test_non_finite_numbers_are_refused(value: object) -> None:
    with pytest.raises(ValueError):
        canonical_json(value)


def test_enums_are_written_as_their_values() -> None:
    class Colour(StrEnum):
        RED = "red"

    class Level(IntEnum):
        HIGH = 3

    assert canonical_json({"c": Colour.RED, "l": Level.HIGH}) == b'{"c":"red","l":3}'


# --- what is refused ------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        (1, 2),
        {1, 2},
        b"bytes",
        Decimal("1.5"),
        object(),
        [1, (2,)],
        {"a": {"b": frozenset()}},
    ],
)
def test_non_json_types_are_refused(value: object) -> None:
    with pytest.raises(TypeError, match="cannot canonicalise"):
        canonical_json(value)


@pytest.mark.parametrize("value", [{1: "a"}, {None: 1}, {"ok": {(1,): 2}}, {b"k": 1}])
def test_non_string_keys_are_refused(value: object) -> None:
    with pytest.raises(TypeError, match="keys must be str"):
        canonical_json(value)


def test_circular_references_are_refused() -> None:
    looped: list[object] = []
    looped.append(looped)
    with pytest.raises(ValueError, match="circular"):
        canonical_json(looped)
    parent: dict[str, object] = {}
    parent["child"] = {"parent": parent}
    with pytest.raises(ValueError, match="circular"):
        canonical_json(parent)


def test_shared_non_circular_values_are_fine() -> None:
    shared = [1]
    assert canonical_json({"a": shared, "b": [shared, shared]}) == b'{"a":[1],"b":[[1],[1]]}'


# --- request_hash ---------------------------------------------------------------------


def test_request_hash_is_sha256_of_the_canonical_envelope() -> None:
    expected = hashlib.sha256(b'{"actor":"alice","body":{"x":1},"route":"/v1/charges"}')
    assert request_hash("alice", "/v1/charges", {"x": 1}) == expected.hexdigest()


def test_request_hash_is_lowercase_hex() -> None:
    digest = request_hash("a", "/r", None)
    assert len(digest) == 64
    assert digest == digest.lower()
    int(digest, 16)


def test_request_hash_separates_actor_route_and_body() -> None:
    base = request_hash("alice", "/v1/charges", {"amount": 100})
    assert base == request_hash("alice", "/v1/charges", {"amount": 100.0})
    assert base != request_hash("bob", "/v1/charges", {"amount": 100})
    assert base != request_hash("alice", "/v1/refunds", {"amount": 100})
    assert base != request_hash("alice", "/v1/charges", {"amount": 101})
    assert base != request_hash("alice", "/v1/charges", {"amount": "100"})


# --- properties -----------------------------------------------------------------------

unicode_text = st.text(st.characters(exclude_categories=["Cs"]))
bmp_text = st.text(st.characters(max_codepoint=0xD7FF))  # code-point order == UTF-16 order
floats = st.floats(allow_nan=False, allow_infinity=False)


def json_values(text: st.SearchStrategy[str]) -> st.SearchStrategy[Any]:
    scalars = st.none() | st.booleans() | st.integers() | floats | text
    return st.recursive(
        scalars,
        lambda children: (
            st.lists(children, max_size=4) | st.dictionaries(text, children, max_size=4)
        ),
        max_leaves=20,
    )


def reversed_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: reversed_keys(value[key]) for key in reversed(list(value))}
    if isinstance(value, list):
        return [reversed_keys(item) for item in value]
    return value


def shuffled_keys(value: Any, rng: random.Random) -> Any:
    if isinstance(value, dict):
        keys = list(value)
        rng.shuffle(keys)
        return {key: shuffled_keys(value[key], rng) for key in keys}
    if isinstance(value, list):
        return [shuffled_keys(item, rng) for item in value]
    return value


def integral_floats_as_ints(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer() and abs(value) <= 2**53:
        return int(value)
    if isinstance(value, dict):
        return {key: integral_floats_as_ints(item) for key, item in value.items()}
    if isinstance(value, list):
        return [integral_floats_as_ints(item) for item in value]
    return value


DUMPS_VARIANTS: list[Callable[[Any], str]] = [
    json.dumps,
    lambda value: json.dumps(value, indent=2),
    lambda value: json.dumps(value, indent="\t", sort_keys=True),
    lambda value: json.dumps(value, separators=(",", ":"), ensure_ascii=False),
    lambda value: json.dumps(value, separators=(" , ", " : ")),
]


@given(json_values(unicode_text))
def test_output_is_valid_json_that_loads_to_an_equal_value(value: Any) -> None:
    encoded = canonical_json(value)
    assert json.loads(encoded.decode("utf-8")) == value


@given(json_values(unicode_text))
def test_canonical_form_is_a_fixed_point(value: Any) -> None:
    encoded = canonical_json(value)
    assert canonical_json(json.loads(encoded)) == encoded


@given(json_values(unicode_text), st.randoms(use_true_random=False))
def test_invariant_under_key_order(value: Any, rng: random.Random) -> None:
    encoded = canonical_json(value)
    assert canonical_json(reversed_keys(value)) == encoded
    assert canonical_json(shuffled_keys(value, rng)) == encoded


@given(json_values(unicode_text), st.sampled_from(DUMPS_VARIANTS))
def test_invariant_under_serialisation_whitespace_and_escaping(
    value: Any, dumps: Callable[[Any], str]
) -> None:
    assert canonical_json(json.loads(dumps(value))) == canonical_json(value)


@given(json_values(bmp_text))
def test_matches_sorted_compact_json_dumps_where_the_forms_agree(value: Any) -> None:
    # For keys below the surrogates and with integral floats already ints, the
    # stdlib's sorted compact form is the same bytes (strings escaped the same way).
    normalised = integral_floats_as_ints(value)
    reference = json.dumps(
        normalised, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )
    assert canonical_json(value) == reference.encode("utf-8")


@given(st.dictionaries(unicode_text, st.integers(), min_size=2, max_size=8))
def test_member_order_is_utf16_code_unit_order(value: dict[str, int]) -> None:
    pairs = json.loads(canonical_json(value), object_pairs_hook=lambda items: items)
    keys = [key for key, _ in pairs]
    assert keys == sorted(value, key=lambda key: key.encode("utf-16-be"))


@given(unicode_text, unicode_text, json_values(unicode_text))
def test_request_hash_ignores_body_key_order(actor: str, route: str, body: Any) -> None:
    assert request_hash(actor, route, body) == request_hash(actor, route, reversed_keys(body))


# --- the orjson path: the same bytes as the writer ---------------------------------------

# Everything a JSON value may hold but floats, with keys of any characters and
# strings with lone surrogates too, and integers on both sides of 64 bits.
any_text = st.text(st.characters())
orjson_candidates = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(-(2**64), 2**64) | any_text,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            any_text | st.text(st.characters(max_codepoint=0x7F)), children, max_size=4
        )
    ),
    max_leaves=20,
)


@given(orjson_candidates)
def test_orjson_path_writes_the_writers_bytes(value: Any) -> None:
    try:
        expected = canonical._written(value)
    except ValueError:  # a lone surrogate
        with pytest.raises(ValueError):
            canonical_json(value)
        return
    assert canonical_json(value) == expected


def test_intakes_body_takes_the_orjson_path_and_others_do_not() -> None:
    body = {
        "amount": 1250,
        "currency": "EUR",
        "payment_method": "pm_ok",
        "description": 'a "quoted"\n\u00e9\U0001f600',
        "metadata": {"order": "A-1", "note": "\u0000\u001f\u2028"},
    }
    envelope = {"actor": "petra", "route": "POST /v1/payments", "body": body}
    assert canonical._orjson_writes_it_canonically(envelope)
    assert canonical_json(envelope) == canonical._written(envelope)

    class Code(IntEnum):
        ONE = 1

    for other in (
        {"amount": 1.0},  # another number form
        {"\u00e9": 1},  # a key whose order may differ from UTF-16's
        {"n": 2**63},  # beyond 64 bits signed
        {"n": Code.ONE},  # a subclass
        (1, 2),  # not JSON
    ):
        assert not canonical._orjson_writes_it_canonically(other)
