from __future__ import annotations

from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from intentledger.domain.durations import format_duration, parse_duration

UNITS = {
    "ms": timedelta(milliseconds=1),
    "s": timedelta(seconds=1),
    "m": timedelta(minutes=1),
    "h": timedelta(hours=1),
    "d": timedelta(days=1),
}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("250ms", timedelta(milliseconds=250)),
        ("30s", timedelta(seconds=30)),
        ("5m", timedelta(minutes=5)),
        ("24h", timedelta(hours=24)),
        ("2d", timedelta(days=2)),
        ("0s", timedelta(0)),
        ("0ms", timedelta(0)),
        ("007s", timedelta(seconds=7)),
        ("  10s\t", timedelta(seconds=10)),
        ("\n1m\n", timedelta(minutes=1)),
        ("1000ms", timedelta(seconds=1)),
        ("999999999d", timedelta(days=999_999_999)),
    ],
)
def test_parse_accepts_digits_and_one_unit(text: str, expected: timedelta) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "30",
        "s",
        "-5s",
        "+5s",
        "1.5s",
        ".5s",
        "5 s",
        "5S",
        "5Ms",
        "5sec",
        "5us",
        "5w",
        "1h30m",
        "5s5",
        "\u0663s",  # Arabic-Indic digit three: a digit to str.isdigit, not to the grammar
        "\u00b2s",  # superscript two
        "5s\x00",
        "1e3ms",
        "0x10s",
        "1_000ms",
    ],
)
def test_parse_rejects_everything_else(text: str) -> None:
    with pytest.raises(ValueError) as raised:
        parse_duration(text)
    message = str(raised.value)
    assert repr(text) in message
    assert "ms, s, m, h, d" in message
    assert "250ms" in message


@pytest.mark.parametrize("text", ["1000000000d", "9" * 30 + "d", "1" * 5000 + "ms"])
def test_parse_rejects_values_too_large_with_the_same_kind_of_message(text: str) -> None:
    with pytest.raises(ValueError, match="too large"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (timedelta(0), "0s"),
        (timedelta(milliseconds=250), "250ms"),
        (timedelta(milliseconds=1500), "1500ms"),
        (timedelta(seconds=30), "30s"),
        (timedelta(seconds=90), "90s"),
        (timedelta(minutes=5), "5m"),
        (timedelta(minutes=90), "90m"),
        (timedelta(hours=24), "1d"),
        (timedelta(hours=36), "36h"),
        (timedelta(days=3), "3d"),
    ],
)
def test_format_gives_the_shortest_exact_form(value: timedelta, expected: str) -> None:
    assert format_duration(value) == expected


@pytest.mark.parametrize("value", [timedelta(microseconds=1), timedelta(microseconds=1500)])
def test_format_rejects_sub_millisecond_values(value: timedelta) -> None:
    with pytest.raises(ValueError, match="whole number of ms"):
        format_duration(value)


def test_format_rejects_negative_values() -> None:
    with pytest.raises(ValueError, match="negative"):
        format_duration(timedelta(seconds=-1))


whole_ms = st.integers(min_value=0, max_value=timedelta.max // timedelta(milliseconds=1)).map(
    lambda ms: timedelta(milliseconds=ms)
)


@given(whole_ms)
def test_format_then_parse_round_trips(value: timedelta) -> None:
    assert parse_duration(format_duration(value)) == value


@given(st.integers(min_value=0, max_value=10**6), st.sampled_from(sorted(UNITS)))
def test_parse_then_format_gives_the_same_duration(number: int, unit: str) -> None:
    text = f"{number}{unit}"
    assert parse_duration(text) == number * UNITS[unit]
    assert parse_duration(format_duration(parse_duration(text))) == parse_duration(text)
    assert len(format_duration(parse_duration(text))) <= max(len(text), 2)


@given(st.text())
def test_parse_raises_only_value_error(text: str) -> None:
    try:
        result = parse_duration(text)
    except ValueError:
        return
    assert result >= timedelta(0)
