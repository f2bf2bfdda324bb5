"""The ``Retry-After`` response field (RFC 9110 §10.2.3), parsed exactly.

``Retry-After = HTTP-date / delay-seconds`` and ``delay-seconds = 1*DIGIT``, counted
from the moment the response was received. ``Retry-After`` is *timing* guidance
only: it can make a check due later, never create evidence about an outcome.

What this module decides, and why:

- All three HTTP-date forms are accepted, because RFC 9110 §5.6.7 says a recipient
  MUST accept them: IMF-fixdate, the obsolete RFC 850 form and ANSI C asctime.
  The grammar is case-sensitive and spaces are exact (§5.6.7); only the optional
  whitespace around a field value (OWS, §5.6.3) is stripped.
- Values outside the grammar — negative (``-5``), fractional (``1.5``), garbage, or
  a repeated field (``Retry-After`` is a singleton, §5.3: two lines, or ``120, 60``
  as a proxy would join them) — are ignored: ``at`` is None and ``problem`` says why.
  Guessing which of two values was meant would be inventing guidance.
- A date in the past means "now"; RFC 9110 gives no rule, and "now" is the only
  reading that neither invents a wait nor hastens anything.
- Any instant beyond ``received_at + ceiling`` is clamped to it (default 6 h, as
  urllib3 2.6.3+ does), so one bad header cannot park an operation for a year.
- The weekday name is checked against the grammar but not against the date: the
  RFC does not ask for it, and the date fields alone name the instant.
- ``email.utils.parsedate_to_datetime`` is not used: it accepts what the grammar
  rejects (lower case, numeric zones such as ``+0200``, a missing zone read as
  naive local time, two-digit years in the IMF form, one-digit days).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

from intentledger.domain.quick_init import quick_init

__all__ = [
    "DEFAULT_CEILING",
    "EMPTY",
    "FRACTIONAL",
    "INVALID_DATE",
    "NEGATIVE",
    "REPEATED",
    "UNPARSEABLE",
    "RetryAfter",
    "parse_retry_after",
    "require_utc",
]

DEFAULT_CEILING = timedelta(hours=6)

# Machine-readable reasons a received value was ignored (RetryAfter.problem).
EMPTY = "empty"  # the field was present with an empty value
REPEATED = "repeated"  # more than one line, or a list such as "120, 60" (§5.3)
NEGATIVE = "negative"  # "-5": delay-seconds is a non-negative integer
FRACTIONAL = "fractional"  # "1.5": delay-seconds is 1*DIGIT
INVALID_DATE = "invalid-date"  # the shape of an HTTP-date naming no real instant
UNPARSEABLE = "unparseable"  # anything else outside the grammar


@quick_init
@dataclass(frozen=True)
class RetryAfter:
    """What one response's ``Retry-After`` said, kept raw and parsed side by side.

    ``raw`` is the value as received (lines joined with ``", "`` if repeated), or
    None when the field was absent. ``at`` is the UTC instant it names, or None when
    absent or invalid. ``problem`` is None when valid or absent, else one of the
    module's reason codes. ``clamped`` is True when ``at`` was cut to the ceiling.
    """

    raw: str | None
    at: datetime | None
    problem: str | None
    clamped: bool = False


def parse_retry_after(
    values: Sequence[str],
    received_at: datetime,
    ceiling: timedelta = DEFAULT_CEILING,
) -> RetryAfter:
    """Parse every received ``Retry-After`` line per RFC 9110 §10.2.3.

    ``values`` holds each field line as received (empty when absent).
    ``received_at`` (timezone-aware, UTC) anchors delay-seconds and past dates.
    The result's ``at``, when set, lies in ``[received_at, received_at + ceiling]``.
    Raises ``ValueError`` only for bad arguments, never for a bad header value.
    """
    received_at = require_utc(received_at, "received_at")
    if ceiling < timedelta(0):
        raise ValueError(f"ceiling must be >= 0, got {ceiling!r}")
    try:
        limit = received_at + ceiling
    except OverflowError:
        raise ValueError("received_at + ceiling is past the last representable instant") from None

    if not values:
        return RetryAfter(raw=None, at=None, problem=None)
    raw = ", ".join(values)
    if len(values) > 1:
        return RetryAfter(raw=raw, at=None, problem=REPEATED)

    offset = _offset_us(values[0], received_at)
    if isinstance(offset, str):
        return RetryAfter(raw=raw, at=None, problem=offset)
    if offset <= 0:
        return RetryAfter(raw=raw, at=received_at, problem=None)  # a past date means "now"
    if offset > ceiling // _MICROSECOND:
        return RetryAfter(raw=raw, at=limit, problem=None, clamped=True)
    return RetryAfter(raw=raw, at=received_at + offset * _MICROSECOND, problem=None)


def require_utc(value: datetime, name: str) -> datetime:
    """Return ``value`` as a UTC datetime; raise ``ValueError`` if naive or not UTC.

    The domain never reads a clock: every instant is passed in from the engine's one
    UTC clock, so a naive or offset value is a caller bug, not something to guess at.
    """
    offset = value.utcoffset()
    if offset is None:
        raise ValueError(f"{name} must be timezone-aware UTC, got naive {value!r}")
    if offset != timedelta(0):
        raise ValueError(f"{name} must be UTC, got offset {offset} in {value!r}")
    return value.astimezone(UTC)


# --- one field value -------------------------------------------------------------
#
# Instants are handled as whole microseconds relative to ``received_at`` (plain
# ints), so a value naming the year 0 or 10049 — which a datetime cannot hold — is
# still compared and clamped exactly rather than raising.

_MICROSECOND = timedelta(microseconds=1)
_US_PER_S = 1_000_000
_S_PER_DAY = 86_400
_DAYS_PER_400_YEARS = 146_097  # the Gregorian calendar repeats every 400 years

_OWS = " \t"  # RFC 9110 §5.6.3
_DELAY_SECONDS = re.compile(r"[0-9]+", re.ASCII)  # \d would also take e.g. U+0663
_NEGATIVE = re.compile(r"-(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)", re.ASCII)
_FRACTIONAL = re.compile(r"[0-9]+\.[0-9]*|\.[0-9]+", re.ASCII)

# Past this many significant digits a delay exceeds every timedelta, so its exact
# value no longer matters; stopping keeps int() far from its 4300-digit limit.
_MAX_DELAY_DIGITS = 18
_BEYOND_ANY_DELAY_S = 10**18


def _offset_us(value: str, received_at: datetime) -> int | str:
    """Return how far after ``received_at`` ``value`` points, or why it is ignored."""
    text = value.strip(_OWS)
    if not text:
        return EMPTY
    if _DELAY_SECONDS.fullmatch(text):
        return _delay_seconds(text) * _US_PER_S
    named = _parse_http_date(text, received_at)
    if isinstance(named, int):
        return named * _US_PER_S - _timestamp_us(received_at)
    if named is not None:
        return named
    if _is_list(text):
        return REPEATED
    if _NEGATIVE.fullmatch(text):
        return NEGATIVE
    if _FRACTIONAL.fullmatch(text):
        return FRACTIONAL
    return UNPARSEABLE


def _delay_seconds(digits: str) -> int:
    significant = digits.lstrip("0")
    if len(significant) > _MAX_DELAY_DIGITS:
        return _BEYOND_ANY_DELAY_S
    return int(significant or "0")


def _is_list(text: str) -> bool:
    """True if ``text`` has a comma that cannot be the one inside an HTTP-date.

    IMF-fixdate and rfc850-date have exactly one comma, straight after the day
    name. Any other comma can only come from joining repeated values (§5.3); a
    single comma after a word is more likely a malformed date, so that is left to
    be reported as unparseable.
    """
    commas = text.count(",")
    if commas != 1:
        return commas > 1
    first = text.partition(",")[0]
    return not (first.isascii() and first.isalpha())


# --- HTTP-date (RFC 9110 §5.6.7) -------------------------------------------------

_DAY_NAMES = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_LONG_DAY_NAMES = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")

_DAY_NAME = "(?:" + "|".join(_DAY_NAMES) + ")"
_LONG_DAY_NAME = "(?:" + "|".join(_LONG_DAY_NAMES) + ")"
_MONTH = "(?P<month>" + "|".join(_MONTHS) + ")"
_TIME = r"(?P<hour>[0-9]{2}):(?P<minute>[0-9]{2}):(?P<second>[0-9]{2})"

# IMF-fixdate = day-name "," SP date1 SP time-of-day SP GMT ; date1 = day SP month SP year
_IMF_FIXDATE = re.compile(
    _DAY_NAME + r", (?P<day>[0-9]{2}) " + _MONTH + r" (?P<year>[0-9]{4}) " + _TIME + " GMT",
    re.ASCII,
)
# rfc850-date = day-name-l "," SP date2 SP time-of-day SP GMT ; date2 = day "-" month "-" 2DIGIT
_RFC850_DATE = re.compile(
    _LONG_DAY_NAME + r", (?P<day>[0-9]{2})-" + _MONTH + r"-(?P<yy>[0-9]{2}) " + _TIME + " GMT",
    re.ASCII,
)
# asctime-date = day-name SP date3 SP time-of-day SP year ; date3 = month SP (2DIGIT / (SP DIGIT))
_ASCTIME_DATE = re.compile(
    _DAY_NAME + " " + _MONTH + r" (?P<day>[0-9]{2}| [0-9]) " + _TIME + r" (?P<year>[0-9]{4})",
    re.ASCII,
)


class _NoInstant(Exception):
    """The value has an HTTP-date's shape but names no real instant (31 Feb, 25:00)."""


def _parse_http_date(text: str, received_at: datetime) -> int | str | None:
    """Return the instant in whole seconds, ``INVALID_DATE``, or None if no HTTP-date."""
    try:
        if match := _IMF_FIXDATE.fullmatch(text):
            return _seconds(int(match["year"]), match)
        if match := _ASCTIME_DATE.fullmatch(text):
            return _seconds(int(match["year"]), match)
        if match := _RFC850_DATE.fullmatch(text):
            return _seconds(_rfc850_year(int(match["yy"]), match, received_at), match)
    except _NoInstant:
        return INVALID_DATE
    return None


def _rfc850_year(yy: int, match: re.Match[str], received_at: datetime) -> int:
    """Resolve a two-digit year as RFC 9110 §5.6.7 requires.

    A timestamp "that appears to be more than 50 years in the future" is read as
    "the most recent year in the past that had the same last two digits": of all
    years ending in ``yy``, take the latest that is at most 50 years ahead.
    """
    received = received_at
    horizon = (received.year + 50, received.month, received.day, *_clock(received))
    named = (_month(match), int(match["day"]), *_time_of_day(match))
    year = (received.year // 100 + 1) * 100 + yy
    while (year, *named) > horizon:
        year -= 100
    return year


def _seconds(year: int, match: re.Match[str]) -> int:
    """Seconds from 0001-01-01T00:00:00Z to the named instant, for any 4-digit year."""
    hour, minute, second = _time_of_day(match)
    # §5.6.7 allows 23:59:60: counted as it is, it lands on the next day's 00:00:00.
    if hour > 23 or minute > 59 or second > 60 or (second == 60 and (hour, minute) != (23, 59)):
        raise _NoInstant
    day = _day_number(year, _month(match), int(match["day"].lstrip(" ")))
    return day * _S_PER_DAY + hour * 3600 + minute * 60 + second


def _day_number(year: int, month: int, day: int) -> int:
    # date() holds only years 1..9999, while HTTP-date allows 0000 and the rfc850
    # rule can reach past 9999; the 400-year cycle maps any year into range exactly.
    cycles, year_in_cycle = divmod(year, 400)
    try:
        ordinal = date(400 + year_in_cycle, month, day).toordinal()
    except ValueError:
        raise _NoInstant from None
    return ordinal + (cycles - 1) * _DAYS_PER_400_YEARS


def _timestamp_us(moment: datetime) -> int:
    hour, minute, second = _clock(moment)
    seconds = moment.toordinal() * _S_PER_DAY + hour * 3600 + minute * 60 + second
    return seconds * _US_PER_S + moment.microsecond


def _month(match: re.Match[str]) -> int:
    return _MONTHS.index(match["month"]) + 1


def _time_of_day(match: re.Match[str]) -> tuple[int, int, int]:
    return int(match["hour"]), int(match["minute"]), int(match["second"])


def _clock(moment: datetime) -> tuple[int, int, int]:
    return moment.hour, moment.minute, moment.second
