"""Durations as operators write them in settings: ``250ms``, ``30s``, ``5m``, ``24h``, ``2d``.

One form only — a whole number and one unit — so a value in the environment means
exactly one thing: no fractions to round, no signs, no compound forms to misread.
"""

from __future__ import annotations

import re
from datetime import timedelta

__all__ = ["ACCEPTED_FORMS", "format_duration", "parse_duration"]

ACCEPTED_FORMS = "a whole number followed by one of ms, s, m, h, d (e.g. 250ms, 30s, 5m, 24h)"

_UNIT_MS: dict[str, int] = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}

# Largest unit first: the first that divides the value gives the shortest text.
_UNITS_BY_SIZE = sorted(_UNIT_MS.items(), key=lambda item: item[1], reverse=True)

# re.ASCII: str.isdigit and \d would also accept digits such as "٣" or "²".
_DURATION = re.compile(r"\s*([0-9]+)(ms|s|m|h|d)\s*", re.ASCII)

_ONE_MS = timedelta(milliseconds=1)


def parse_duration(text: str) -> timedelta:
    """Parse ``<digits><unit>`` (units ``ms``, ``s``, ``m``, ``h``, ``d``) into a timedelta.

    Surrounding whitespace is ignored. Anything else — empty, signed, fractional,
    unit-less, an unknown or upper-case unit, or a value too large for a timedelta —
    raises ``ValueError`` naming the bad value and the accepted forms.
    """
    match = _DURATION.fullmatch(text)
    if match is None:
        raise ValueError(_bad(text))
    digits, unit = match.groups()
    try:
        # int() refuses more than 4300 digits, timedelta refuses > 999999999 days:
        # both are the same operator mistake and get the same message.
        return timedelta(milliseconds=int(digits) * _UNIT_MS[unit])
    except (OverflowError, ValueError):
        raise ValueError(_bad(text) + "; the value is too large") from None


def format_duration(value: timedelta) -> str:
    """Write ``value`` in the shortest exact ``<digits><unit>`` form.

    ``parse_duration(format_duration(td)) == td`` for every non-negative whole
    number of milliseconds; other values have no exact form and raise ``ValueError``.
    Zero is written ``0s``.
    """
    if value < timedelta(0):
        raise ValueError(f"cannot format negative duration {value!r}: durations are >= 0")
    if value % _ONE_MS:
        raise ValueError(f"cannot format {value!r} exactly: it is not a whole number of ms")
    total_ms = value // _ONE_MS
    if total_ms == 0:
        return "0s"
    for unit, size_ms in _UNITS_BY_SIZE:
        if total_ms % size_ms == 0:
            return f"{total_ms // size_ms}{unit}"
    raise AssertionError("unreachable: every whole number of ms has the ms unit")


def _bad(text: str) -> str:
    return f"invalid duration {text!r}: expected {ACCEPTED_FORMS}"
