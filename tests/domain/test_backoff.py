from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from intentledger.domain.backoff import next_check_at, recheck_delay
from intentledger.domain.retry_after import RetryAfter, parse_retry_after

BASE = timedelta(seconds=30)
CAP = timedelta(hours=6)
NOW = datetime(2024, 6, 1, 12, tzinfo=UTC)
US = timedelta(microseconds=1)


# --- recheck_delay --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("check_number", "expected"),
    [
        (1, timedelta(seconds=30)),
        (2, timedelta(seconds=60)),
        (3, timedelta(seconds=120)),
        (4, timedelta(seconds=240)),
        (9, timedelta(seconds=30 * 256)),
        (10, timedelta(seconds=30 * 512)),
        (11, CAP),  # 30 s * 1024 = 8.5 h, capped
        (100, CAP),
        (10**9, CAP),  # must not build 2**(10**9)
    ],
)
def test_delay_doubles_from_base_up_to_the_cap(check_number: int, expected: timedelta) -> None:
    assert recheck_delay(check_number, BASE) == expected


def test_custom_cap() -> None:
    assert recheck_delay(3, BASE, cap=timedelta(seconds=100)) == timedelta(seconds=100)
    assert recheck_delay(1, timedelta(hours=1), cap=timedelta(minutes=1)) == timedelta(minutes=1)


@pytest.mark.parametrize(
    ("jitter", "expected"),
    [
        (0.0, timedelta(seconds=30)),
        (0.5, timedelta(seconds=22, milliseconds=500)),  # 30 - 30 * 0.5 / 2
        (0.2, timedelta(seconds=27)),
        (0.75, timedelta(seconds=18, milliseconds=750)),
        (math.nextafter(1.0, 0.0), timedelta(seconds=15, microseconds=1)),  # just above d/2
    ],
)
def test_jitter_shrinks_the_delay_by_up_to_half(jitter: float, expected: timedelta) -> None:
    assert recheck_delay(1, BASE, jitter=jitter) == expected


def test_smallest_delay_stays_positive_under_any_jitter() -> None:
    assert recheck_delay(1, US, jitter=math.nextafter(1.0, 0.0)) == US


@pytest.mark.parametrize("check_number", [0, -1, -(10**9)])
def test_check_number_counts_from_one(check_number: int) -> None:
    with pytest.raises(ValueError, match="check_number"):
        recheck_delay(check_number, BASE)


@pytest.mark.parametrize("base", [timedelta(0), timedelta(seconds=-1)])
def test_base_must_be_positive(base: timedelta) -> None:
    with pytest.raises(ValueError, match="base"):
        recheck_delay(1, base)


@pytest.mark.parametrize("cap", [timedelta(0), timedelta(seconds=-1)])
def test_cap_must_be_positive(cap: timedelta) -> None:
    with pytest.raises(ValueError, match="cap"):
        recheck_delay(1, BASE, cap=cap)


@pytest.mark.parametrize("jitter", [-0.1, 1.0, 1.5, math.nan, math.inf, -math.inf])
def test_jitter_must_be_in_unit_interval(jitter: float) -> None:
    with pytest.raises(ValueError, match="jitter"):
        recheck_delay(1, BASE, jitter=jitter)


bases = st.timedeltas(min_value=US, max_value=timedelta(days=30))
caps = st.timedeltas(min_value=US, max_value=timedelta(days=3650))
jitters = st.floats(min_value=0.0, max_value=1.0, exclude_max=True)
check_numbers = st.integers(min_value=1, max_value=200)


@given(check_numbers, bases, caps, jitters)
def test_delay_lies_in_upper_half_of_the_capped_exponential(
    check_number: int, base: timedelta, cap: timedelta, jitter: float
) -> None:
    undelayed_us = min(cap // US, base // US * 2 ** (check_number - 1))
    result = recheck_delay(check_number, base, cap, jitter)
    assert timedelta(0) < result <= cap
    # In whole microseconds, as the formula is: d/2 < result <= d.
    assert undelayed_us < 2 * (result // US)
    assert result // US <= undelayed_us
    if jitter == 0.0:
        assert result // US == undelayed_us


@given(check_numbers, bases, caps, jitters)
def test_delay_never_decreases_with_check_number(
    check_number: int, base: timedelta, cap: timedelta, jitter: float
) -> None:
    assert recheck_delay(check_number, base, cap, jitter) <= recheck_delay(
        check_number + 1, base, cap, jitter
    )


@given(check_numbers, bases, caps, jitters, jitters)
def test_more_jitter_never_lengthens_the_delay(
    check_number: int, base: timedelta, cap: timedelta, first: float, second: float
) -> None:
    low, high = sorted((first, second))
    assert recheck_delay(check_number, base, cap, high) <= recheck_delay(
        check_number, base, cap, low
    )


# --- next_check_at --------------------------------------------------------------------


def valid(at: datetime) -> RetryAfter:
    return RetryAfter(raw="x", at=at, problem=None)


def test_without_guidance_backoff_decides() -> None:
    assert next_check_at(NOW, None, BASE) == NOW + BASE


def test_absent_or_invalid_retry_after_is_no_guidance() -> None:
    for values in ([], ["-5"], ["120, 60"], ["soon"], ["1", "2"]):
        guidance = parse_retry_after(values, NOW)
        assert guidance.at is None
        assert next_check_at(NOW, guidance, BASE) == NOW + BASE


def test_later_retry_after_delays_the_check() -> None:
    assert next_check_at(NOW, valid(NOW + timedelta(minutes=5)), BASE) == NOW + timedelta(minutes=5)


def test_earlier_retry_after_never_hastens_the_check() -> None:
    assert next_check_at(NOW, valid(NOW + timedelta(seconds=2)), BASE) == NOW + BASE
    assert next_check_at(NOW, valid(NOW), BASE) == NOW + BASE


def test_retry_after_counted_from_an_earlier_receipt() -> None:
    # Guidance received at 12:00 for 12:10, observed (recorded) at 12:01.
    guidance = parse_retry_after(["600"], NOW)
    observed = NOW + timedelta(minutes=1)
    assert next_check_at(observed, guidance, BASE) == NOW + timedelta(minutes=10)


def test_zero_backoff_is_allowed() -> None:
    assert next_check_at(NOW, None, timedelta(0)) == NOW


def test_negative_backoff_is_refused() -> None:
    with pytest.raises(ValueError, match="backoff"):
        next_check_at(NOW, None, timedelta(seconds=-1))


def test_observed_at_must_be_utc() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        next_check_at(datetime(2024, 6, 1), None, BASE)
    with pytest.raises(ValueError, match="UTC"):
        next_check_at(datetime(2024, 6, 1, tzinfo=timezone(timedelta(hours=-5))), None, BASE)


@given(
    st.datetimes(
        min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1), timezones=st.just(UTC)
    ),
    st.one_of(st.none(), st.timedeltas(min_value=-timedelta(days=1), max_value=timedelta(days=1))),
    st.timedeltas(min_value=timedelta(0), max_value=timedelta(days=1)),
)
def test_next_check_is_the_later_of_backoff_and_guidance(
    observed: datetime, guidance_offset: timedelta | None, backoff: timedelta
) -> None:
    guidance = None if guidance_offset is None else valid(observed + guidance_offset)
    result = next_check_at(observed, guidance, backoff)
    assert result >= observed + backoff
    if guidance is not None and guidance.at is not None:
        assert result >= guidance.at
        assert result in (observed + backoff, guidance.at)
    else:
        assert result == observed + backoff
