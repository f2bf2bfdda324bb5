"""ISO 4217 codes: what is in the table, what is kept out, and how input is normalised."""

from __future__ import annotations

import re
from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from intentledger.domain import currencies
from intentledger.domain.currencies import (
    ISO_4217_CODES,
    MINOR_UNITS,
    format_amount,
    normalise_currency,
)

ACTIVE = ["USD", "EUR", "GBP", "JPY", "CHF", "SEK", "XOF", "XAF", "ZWG", "SLE", "VES"]
# Withdrawn currencies, and List One codes with no minor unit (metals, units of
# account, the testing code, "no currency").
ABSENT = ["DEM", "FRF", "HRK", "XTS", "XXX", "XAU", "XAG", "XPD", "XPT", "XDR", "XSU", "XUA"]
THREE_UPPER_ASCII = re.compile(r"[A-Z]{3}")


@pytest.mark.parametrize("code", ACTIVE)
def test_required_active_codes_present(code: str) -> None:
    assert code in ISO_4217_CODES
    assert code in MINOR_UNITS


@pytest.mark.parametrize("code", ABSENT)
def test_withdrawn_and_non_monetary_codes_absent(code: str) -> None:
    assert code not in ISO_4217_CODES
    assert code not in MINOR_UNITS
    with pytest.raises(ValueError, match=code):
        normalise_currency(code)


def test_every_code_is_three_uppercase_ascii_letters() -> None:
    bad = sorted(c for c in ISO_4217_CODES if not THREE_UPPER_ASCII.fullmatch(c) or not c.isascii())
    assert bad == []


def test_every_code_has_a_minor_unit_and_nothing_else_does() -> None:
    assert set(MINOR_UNITS) == ISO_4217_CODES
    assert set(MINOR_UNITS.values()) <= {0, 2, 3, 4}


def test_no_code_is_listed_under_two_minor_units() -> None:
    # MINOR_UNITS is built from a dict comprehension, which would silently keep the last.
    listed = [code for codes in currencies._CODES_BY_MINOR_UNIT.values() for code in codes.split()]
    assert len(listed) == len(set(listed)) == len(ISO_4217_CODES)


@pytest.mark.parametrize(
    ("code", "exponent"),
    [("USD", 2), ("EUR", 2), ("JPY", 0), ("KRW", 0), ("XOF", 0), ("KWD", 3), ("CLF", 4)],
)
def test_known_minor_units(code: str, exponent: int) -> None:
    assert MINOR_UNITS[code] == exponent


@pytest.mark.parametrize(("text", "expected"), [("eur", "EUR"), ("EUR", "EUR"), ("uSd", "USD")])
def test_normalise_upper_cases_ascii(text: str, expected: str) -> None:
    assert normalise_currency(text) == expected


@pytest.mark.parametrize(
    "text",
    # "u\u017fd" upper-cases to "USD" with str.upper; so would fullwidth letters under NFKC.
    ["", "US", "usd ", " usd", "u\u017fd", "\uff35\uff33\uff24", "XXX", "USDX", "usd\n"],
)
def test_normalise_rejects_with_the_value_named(text: str) -> None:
    with pytest.raises(ValueError) as caught:
        normalise_currency(text)
    assert repr(text) in str(caught.value)


@given(st.sampled_from(sorted(ISO_4217_CODES)), st.lists(st.booleans(), min_size=3, max_size=3))
def test_any_casing_of_a_code_normalises_to_it(code: str, lower: list[bool]) -> None:
    text = "".join(c.lower() if flag else c for c, flag in zip(code, lower, strict=True))
    assert normalise_currency(text) == code
    assert normalise_currency(normalise_currency(text)) == code


@given(st.text(max_size=6))
def test_normalise_returns_a_listed_code_or_raises(text: str) -> None:
    try:
        code = normalise_currency(text)
    except ValueError as exc:
        assert repr(text) in str(exc)
    else:
        assert code in ISO_4217_CODES
        assert text.isascii()
        assert code == text.upper()


@pytest.mark.parametrize(
    ("amount", "currency", "shown"),
    [
        (4200, "EUR", "42.00 EUR (4200)"),
        (5, "EUR", "0.05 EUR (5)"),
        (4200, "JPY", "4200 JPY (4200)"),
        (1234, "KWD", "1.234 KWD (1234)"),
        (1, "CLF", "0.0001 CLF (1)"),
        (-1005, "USD", "-10.05 USD (-1005)"),
        (0, "EUR", "0.00 EUR (0)"),
        (42, "BGN", "42 BGN (minor units)"),  # withdrawn: no exponent guessed
        (None, None, "—"),  # a beneficiary or a card moves no money
        (None, "EUR", "—"),
    ],
)
def test_an_amount_is_shown_in_major_units_then_the_minor_units(
    amount: int | None, currency: str | None, shown: str
) -> None:
    assert format_amount(amount, currency) == shown


@given(st.integers(min_value=-(10**15), max_value=10**15), st.sampled_from(sorted(MINOR_UNITS)))
def test_the_major_units_shown_are_the_minor_units_moved_by_the_exponent(
    amount: int, currency: str
) -> None:
    major, code, minor = format_amount(amount, currency).split(" ")
    assert code == currency and minor == f"({amount})"
    assert Decimal(major) == Decimal(amount).scaleb(-MINOR_UNITS[currency])
