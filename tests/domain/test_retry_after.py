from __future__ import annotations

import email.utils
from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from intentledger.domain.retry_after import (
    DEFAULT_CEILING,
    EMPTY,
    FRACTIONAL,
    INVALID_DATE,
    NEGATIVE,
    REPEATED,
    UNPARSEABLE,
    RetryAfter,
    parse_retry_after,
    require_utc,
)

RECEIVED = datetime(2024, 6, 1, 12, 0, 0, tzinfo=UTC)
DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
LONG_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
LONG = timedelta(days=366 * 100)  # a ceiling that never clamps, to observe the instant itself


def imf_fixdate(moment: datetime) -> str:
    day, month = DAYS[moment.weekday()], MONTHS[moment.month - 1]
    return f"{day}, {moment.day:02d} {month} {moment.year:04d} {moment:%H:%M:%S} GMT"


def rfc850_date(moment: datetime) -> str:
    day, month = LONG_DAYS[moment.weekday()], MONTHS[moment.month - 1]
    return f"{day}, {moment.day:02d}-{month}-{moment.year % 100:02d} {moment:%H:%M:%S} GMT"


def asctime_date(moment: datetime) -> str:
    day, month = DAYS[moment.weekday()], MONTHS[moment.month - 1]
    return f"{day} {month} {moment.day:2d} {moment:%H:%M:%S} {moment.year:04d}"


def parse(value: str, ceiling: timedelta = DEFAULT_CEILING) -> RetryAfter:
    return parse_retry_after([value], RECEIVED, ceiling)


# --- absent and delay-seconds ------------------------------------------------------


def test_absent_field_is_no_guidance_and_no_problem() -> None:
    assert parse_retry_after([], RECEIVED) == RetryAfter(raw=None, at=None, problem=None)


@pytest.mark.parametrize(
    ("value", "delay"),
    [
        ("0", timedelta(0)),
        ("1", timedelta(seconds=1)),
        ("120", timedelta(seconds=120)),
        ("0120", timedelta(seconds=120)),
        ("21600", timedelta(hours=6)),
        (" 2 ", timedelta(seconds=2)),  # OWS around a field value (RFC 9110 §5.6.3)
        ("\t2\t", timedelta(seconds=2)),
    ],
)
def test_delay_seconds_count_from_receipt(value: str, delay: timedelta) -> None:
    assert parse(value) == RetryAfter(raw=value, at=RECEIVED + delay, problem=None)


@pytest.mark.parametrize("value", ["21601", "999999", "9" * 40, "1" * 5000, "0" * 5000 + "1" * 30])
def test_delay_beyond_the_ceiling_is_clamped(value: str) -> None:
    result = parse(value)
    assert result == RetryAfter(
        raw=value, at=RECEIVED + DEFAULT_CEILING, problem=None, clamped=True
    )


def test_many_leading_zeros_are_still_a_small_delay() -> None:
    assert parse("0" * 5000 + "7").at == RECEIVED + timedelta(seconds=7)


def test_ceiling_is_configurable() -> None:
    result = parse_retry_after(["120"], RECEIVED, ceiling=timedelta(seconds=60))
    assert result.at == RECEIVED + timedelta(seconds=60)
    assert result.clamped
    assert parse_retry_after(["5"], RECEIVED, ceiling=timedelta(0)).at == RECEIVED


def test_received_at_microseconds_are_kept() -> None:
    received = RECEIVED.replace(microsecond=250_000)
    assert parse_retry_after(["3"], received).at == received + timedelta(seconds=3)


# --- HTTP-date: all three forms (RFC 9110 §5.6.7) ------------------------------------


def test_rfc_examples_name_the_same_instant() -> None:
    # The three examples of RFC 9110 §5.6.7, received just before that instant.
    received = datetime(1994, 11, 6, 8, 0, 0, tzinfo=UTC)
    expected = datetime(1994, 11, 6, 8, 49, 37, tzinfo=UTC)
    for value in (
        "Sun, 06 Nov 1994 08:49:37 GMT",
        "Sunday, 06-Nov-94 08:49:37 GMT",
        "Sun Nov  6 08:49:37 1994",
    ):
        assert parse_retry_after([value], received) == RetryAfter(
            raw=value, at=expected, problem=None
        )


@pytest.mark.parametrize("form", [imf_fixdate, rfc850_date, asctime_date])
def test_future_date_is_that_instant(form: object) -> None:
    assert callable(form)
    moment = RECEIVED + timedelta(minutes=90)
    assert parse(form(moment)).at == moment


@pytest.mark.parametrize(
    "value",
    [
        "Sun, 06 Nov 1994 08:49:37 GMT",
        "Sunday, 06-Nov-94 08:49:37 GMT",
        "Sun Nov  6 08:49:37 1994",
        imf_fixdate(RECEIVED),
        imf_fixdate(RECEIVED - timedelta(seconds=1)),
        "Mon, 01 Jan 0001 00:00:00 GMT",
        "Sat, 01 Jan 0000 00:00:00 GMT",  # year 0000 is grammatical, and long past
    ],
)
def test_past_or_present_date_means_now(value: str) -> None:
    assert parse(value) == RetryAfter(raw=value, at=RECEIVED, problem=None)


def test_date_within_the_received_second_means_now() -> None:
    received = RECEIVED.replace(microsecond=999_999)
    assert parse_retry_after([imf_fixdate(RECEIVED)], received).at == received


def test_date_beyond_the_ceiling_is_clamped() -> None:
    for value in (imf_fixdate(RECEIVED + timedelta(hours=7)), "Fri, 31 Dec 9999 23:59:59 GMT"):
        assert parse(value) == RetryAfter(
            raw=value, at=RECEIVED + DEFAULT_CEILING, problem=None, clamped=True
        )


def test_date_exactly_at_the_ceiling_is_not_clamped() -> None:
    value = imf_fixdate(RECEIVED + DEFAULT_CEILING)
    assert parse(value) == RetryAfter(raw=value, at=RECEIVED + DEFAULT_CEILING, problem=None)


def test_asctime_day_may_be_two_digits() -> None:
    assert parse("Sat Jun 01 13:00:00 2024").at == RECEIVED + timedelta(hours=1)
    assert parse("Sat Jun 15 13:00:00 2024", LONG).at == datetime(2024, 6, 15, 13, tzinfo=UTC)


def test_leap_second_at_the_end_of_a_day_is_the_next_midnight() -> None:
    received = datetime(2016, 12, 31, 23, 0, 0, tzinfo=UTC)
    value = "Sat, 31 Dec 2016 23:59:60 GMT"
    assert parse_retry_after([value], received).at == datetime(2017, 1, 1, tzinfo=UTC)


def test_weekday_is_grammar_only() -> None:
    # 2024-06-01 is a Saturday; RFC 9110 does not ask recipients to cross-check.
    assert parse("Mon, 01 Jun 2024 13:00:00 GMT").at == RECEIVED + timedelta(hours=1)


# --- RFC 850 two-digit years (RFC 9110 §5.6.7) --------------------------------------


@pytest.mark.parametrize(
    ("value", "year"),
    [
        ("Sunday, 01-Jun-25 12:00:00 GMT", 2025),
        ("Monday, 01-Jun-74 12:00:00 GMT", 2074),  # exactly 50 years ahead: not "more than"
        ("Monday, 01-Jun-74 12:00:01 GMT", None),  # a second more: 1974, in the past
        ("Monday, 31-Dec-74 00:00:00 GMT", None),
        ("Monday, 01-Jun-99 12:00:00 GMT", None),  # 1999
        ("Monday, 01-Jun-24 12:00:00 GMT", None),  # 2024, this instant
        ("Monday, 01-Jun-24 12:00:05 GMT", 2024),
    ],
)
def test_two_digit_year_more_than_50_years_ahead_is_the_past_century(
    value: str, year: int | None
) -> None:
    result = parse(value, LONG)
    if year is None:
        assert result.at == RECEIVED
    else:
        assert result.at is not None
        assert result.at.year == year


def test_two_digit_year_near_a_century_boundary() -> None:
    received = datetime(2099, 6, 1, tzinfo=UTC)
    result = parse_retry_after(["Friday, 01-Jun-01 00:00:00 GMT"], received, LONG)
    assert result.at == datetime(2101, 6, 1, tzinfo=UTC)


@given(
    received=st.datetimes(
        min_value=datetime(1900, 1, 1), max_value=datetime(9900, 1, 1), timezones=st.just(UTC)
    ),
    offset=st.integers(min_value=-49 * 365 * 86400, max_value=49 * 365 * 86400),
)
def test_rfc850_names_the_instant_within_50_years(received: datetime, offset: int) -> None:
    moment = received.replace(microsecond=0) + timedelta(seconds=offset)
    result = parse_retry_after([rfc850_date(moment)], received, LONG)
    assert result.at == max(moment, received)


# --- values outside the grammar are ignored, with the reason -------------------------


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("", EMPTY),
        ("   ", EMPTY),
        ("\t", EMPTY),
        ("-5", NEGATIVE),
        ("-0", NEGATIVE),
        ("-1.5", NEGATIVE),
        ("-.5", NEGATIVE),
        ("1.5", FRACTIONAL),
        ("1.", FRACTIONAL),
        (".5", FRACTIONAL),
        ("0.0", FRACTIONAL),
        ("120, 60", REPEATED),
        ("120,60", REPEATED),
        ("1,5", REPEATED),
        (",", REPEATED),
        ("120, Sun, 06 Nov 1994 08:49:37 GMT", REPEATED),
        ("Sun, 06 Nov 1994 08:49:37 GMT, 120", REPEATED),
        ("Sun, 06 Nov 1994 08:49:37 GMT, Sun, 06 Nov 1994 08:49:37 GMT", REPEATED),
        ("abc", UNPARSEABLE),
        ("abc, def", UNPARSEABLE),  # one comma after a word: a malformed date, not a list
        ("+5", UNPARSEABLE),
        ("5s", UNPARSEABLE),
        ("1e3", UNPARSEABLE),
        ("0x10", UNPARSEABLE),
        ("5\n", UNPARSEABLE),  # only SP and HTAB are optional whitespace
        ("1 2", UNPARSEABLE),
        ("\u0661\u0662\u0660", UNPARSEABLE),  # Arabic-Indic "120": digits to str.isdigit only
        ("\uff11\uff12\uff10", UNPARSEABLE),  # full-width "120"
        ("inf", UNPARSEABLE),
        ("NaN", UNPARSEABLE),
        ("Sun, 06 Nov garbage", UNPARSEABLE),
        # HTTP-date is case-sensitive and its spacing exact (RFC 9110 §5.6.7)
        ("sun, 06 Nov 1994 08:49:37 GMT", UNPARSEABLE),
        ("Sun, 06 nov 1994 08:49:37 GMT", UNPARSEABLE),
        ("Sun, 06 NOV 1994 08:49:37 GMT", UNPARSEABLE),
        ("Sun, 06 Nov 1994 08:49:37 gmt", UNPARSEABLE),
        ("Sun, 06 Nov 1994 08:49:37 UTC", UNPARSEABLE),
        ("Sun, 06 Nov 1994 08:49:37 +0000", UNPARSEABLE),
        ("Sun, 06 Nov 1994 08:49:37", UNPARSEABLE),
        ("Sun, 6 Nov 1994 08:49:37 GMT", UNPARSEABLE),
        ("Sun, 06 Nov 94 08:49:37 GMT", UNPARSEABLE),
        ("Sun,  06 Nov 1994 08:49:37 GMT", UNPARSEABLE),
        ("Sun 06 Nov 1994 08:49:37 GMT", UNPARSEABLE),
        ("Sunday, 06 Nov 1994 08:49:37 GMT", UNPARSEABLE),
        ("Sun, 06-Nov-94 08:49:37 GMT", UNPARSEABLE),
        ("Sunday, 06-Nov-1994 08:49:37 GMT", UNPARSEABLE),
        ("Sun Nov 6 08:49:37 1994", UNPARSEABLE),
        ("Sun Nov  6 08:49:37 1994 GMT", UNPARSEABLE),
        ("Sun Nov  6 8:49:37 1994", UNPARSEABLE),
        ("1994-11-06T08:49:37Z", UNPARSEABLE),
        ("Sun, 06 Nov 1994 08:49 GMT", UNPARSEABLE),
        ("Sun, 06 Nov 1994 08:49:37.5 GMT", UNPARSEABLE),
    ],
)
def test_invalid_values_are_ignored_and_recorded(value: str, problem: str) -> None:
    assert parse(value) == RetryAfter(raw=value, at=None, problem=problem)


@pytest.mark.parametrize(
    "value",
    [
        "Sat, 00 Jun 2024 13:00:00 GMT",
        "Sat, 31 Jun 2024 13:00:00 GMT",
        "Fri, 29 Feb 2023 13:00:00 GMT",
        "Sat, 01 Jun 2024 24:00:00 GMT",
        "Sat, 01 Jun 2024 13:60:00 GMT",
        "Sat, 01 Jun 2024 13:00:60 GMT",  # a leap second comes only at 23:59:60
        "Sat, 01 Jun 2024 23:59:61 GMT",
        "Saturday, 31-Jun-24 13:00:00 GMT",
        "Sat Jun 31 13:00:00 2024",
        "Sat Jun  0 13:00:00 2024",
    ],
)
def test_dates_naming_no_real_instant_are_ignored(value: str) -> None:
    assert parse(value) == RetryAfter(raw=value, at=None, problem=INVALID_DATE)


def test_leap_day_is_a_real_date() -> None:
    received = datetime(2028, 2, 29, 12, tzinfo=UTC)
    assert parse_retry_after(["Tue, 29 Feb 2028 13:00:00 GMT"], received).at == received.replace(
        hour=13
    )


@pytest.mark.parametrize(
    "values",
    [["120", "60"], ["120", "120"], ["", "5"], [imf_fixdate(RECEIVED), "5"], ["1", "2", "3"]],
)
def test_repeated_field_lines_are_ignored(values: list[str]) -> None:
    assert parse_retry_after(values, RECEIVED) == RetryAfter(
        raw=", ".join(values), at=None, problem=REPEATED
    )


# --- arguments ------------------------------------------------------------------------


def test_naive_received_at_is_refused() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        parse_retry_after(["5"], datetime(2024, 6, 1, 12))


def test_non_utc_received_at_is_refused() -> None:
    with pytest.raises(ValueError, match="UTC"):
        parse_retry_after(["5"], datetime(2024, 6, 1, 12, tzinfo=timezone(timedelta(hours=2))))


def test_zero_offset_timezone_is_normalised_to_utc() -> None:
    received = datetime(2024, 6, 1, 12, tzinfo=timezone(timedelta(0), "Z"))
    result = parse_retry_after(["5"], received)
    assert result.at == RECEIVED + timedelta(seconds=5)
    assert result.at is not None and result.at.tzinfo is UTC
    assert require_utc(received, "x").tzinfo is UTC


def test_negative_ceiling_is_refused() -> None:
    with pytest.raises(ValueError, match="ceiling"):
        parse_retry_after(["5"], RECEIVED, timedelta(seconds=-1))


def test_unrepresentable_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="representable"):
        parse_retry_after(["5"], datetime.max.replace(tzinfo=UTC))


# --- properties -----------------------------------------------------------------------

received_ats = st.datetimes(
    min_value=datetime(1970, 1, 1), max_value=datetime(9000, 1, 1), timezones=st.just(UTC)
)
ceilings = st.timedeltas(min_value=timedelta(0), max_value=timedelta(days=3650))
header_text = st.one_of(
    st.text(),
    st.text(alphabet="0123456789 ,.-+\t:GMTSunNovJanFeb", max_size=40),
    st.integers(min_value=-(10**30), max_value=10**30).map(str),
    st.floats(allow_nan=True).map(str),
    st.datetimes(timezones=st.just(UTC)).map(imf_fixdate),
    st.datetimes(timezones=st.just(UTC)).map(rfc850_date),
    st.datetimes(timezones=st.just(UTC)).map(asctime_date),
)


@given(st.lists(header_text, max_size=3), received_ats, ceilings)
def test_any_header_lines_give_a_bounded_result_and_never_raise(
    values: list[str], received: datetime, ceiling: timedelta
) -> None:
    result = parse_retry_after(values, received, ceiling)
    assert result.raw == (", ".join(values) if values else None)
    assert (result.at is None) == (result.problem is not None or not values)
    if result.at is not None:
        assert received <= result.at <= received + ceiling
        assert result.at.tzinfo is UTC
    assert not result.clamped or result.at == received + ceiling


@given(st.integers(min_value=0, max_value=10**25), received_ats)
def test_delay_seconds_is_received_at_plus_capped_delay(seconds: int, received: datetime) -> None:
    result = parse_retry_after([str(seconds)], received)
    assert result.problem is None
    assert result.at == received + min(timedelta(hours=6), timedelta(seconds=min(seconds, 10**9)))
    assert result.clamped == (seconds > 6 * 3600)


@given(st.datetimes(min_value=datetime(1, 1, 1), timezones=st.just(UTC)), received_ats)
def test_imf_fixdate_and_asctime_name_the_same_clamped_instant(
    moment: datetime, received: datetime
) -> None:
    moment = moment.replace(microsecond=0)
    expected = min(max(moment, received), received + DEFAULT_CEILING)
    for value in (imf_fixdate(moment), asctime_date(moment)):
        assert parse_retry_after([value], received).at == expected


@given(st.datetimes(min_value=datetime(1900, 1, 1), timezones=st.just(UTC)))
def test_imf_fixdate_agrees_with_the_standard_library_formatter(moment: datetime) -> None:
    moment = moment.replace(microsecond=0)
    value = email.utils.format_datetime(moment, usegmt=True)
    received = moment - timedelta(hours=1)
    assert parse_retry_after([value], received).at == moment
