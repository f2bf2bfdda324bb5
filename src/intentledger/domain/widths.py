"""How wide the provider answers' partitions are on PostgreSQL, from the
record retention (store/partitions.py, decision 0018).

A partition is dropped only once all of it is past the retention, so an answer
outlives the retention by up to one partition's width. The width is therefore
the largest of a small ladder — a UTC calendar month, a day, an hour, a
minute — that is at most a quarter of the retention: production's 400 days
keeps months, a retention of 30 days gets days, and a test's retention of
minutes gets minutes, so that a short soak sees partitions dropped and the
table level off.

Partitions lie on the width's grid (a month starts on the 1st at 00:00 UTC, a
minute on the minute), except where one of another width, made while the
retention was different, is in the way: a new partition then starts at that
one's upper bound or stops at its lower bound, so partitions never overlap.
A partition is named after its lower bound, written down to the coarsest of
month, day, hour and minute that states it exactly: `2026_11` (the 1st at
00:00), `2026_11_30`, `2026_11_30_12`, `2026_11_30_1203`. Bounds of partitions
that coexist differ, so their names do; and the names sort as the bounds do
(a name is a prefix of the full `YYYY_MM_DD_HHMM`, and what it leaves out is
zeros), so a month's name keeps its meaning across width changes.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from enum import Enum

from intentledger.domain.months import add_months, month_start


class Width(Enum):
    MONTH = "month"
    DAY = "day"
    HOUR = "hour"
    MINUTE = "minute"

    @property
    def longest(self) -> timedelta:
        """The longest a partition of this width lasts."""
        return _LONGEST[self]


_LONGEST = {
    Width.MONTH: timedelta(days=31),
    Width.DAY: timedelta(days=1),
    Width.HOUR: timedelta(hours=1),
    Width.MINUTE: timedelta(minutes=1),
}
# A partition is at most this fraction of the retention wide.
RETENTION_FRACTION = 4


def width_for(retention: timedelta) -> Width:
    """The widest of the ladder at most 1/RETENTION_FRACTION of `retention`;
    a minute when even that is too wide."""
    for width in Width:
        if width.longest * RETENTION_FRACTION <= retention:
            return width
    return Width.MINUTE


def floor(at: datetime, width: Width) -> datetime:
    """The start of the `width` grid cell `at` falls in (UTC)."""
    at = at.astimezone(UTC)
    if width is Width.MONTH:
        return month_start(at)
    if width is Width.DAY:
        return datetime(at.year, at.month, at.day, tzinfo=UTC)
    if width is Width.HOUR:
        return datetime(at.year, at.month, at.day, at.hour, tzinfo=UTC)
    return datetime(at.year, at.month, at.day, at.hour, at.minute, tzinfo=UTC)


def step(start: datetime, width: Width, count: int = 1) -> datetime:
    """`count` widths after `start`, a point of the grid."""
    if width is Width.MONTH:
        return add_months(start, count)
    return start + width.longest * count


def span_name(lower: datetime) -> str:
    """A partition's name suffix: its lower bound, down to the coarsest of
    month, day, hour and minute that states it exactly."""
    lower = lower.astimezone(UTC)
    if lower.second or lower.microsecond:
        raise ValueError(f"a partition bound lies on a minute: {lower.isoformat()}")
    if lower.minute:
        return f"{lower:%Y_%m_%d_%H%M}"
    if lower.hour:
        return f"{lower:%Y_%m_%d_%H}"
    if lower.day != 1:
        return f"{lower:%Y_%m_%d}"
    return f"{lower:%Y_%m}"


# The names span_name makes (and migration 0014's months).
SPAN_NAME_PATTERN = r"\d{4}_\d{2}(?:_\d{2}(?:_\d{2}(?:\d{2})?)?)?"
