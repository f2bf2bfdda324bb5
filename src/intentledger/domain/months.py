"""Calendar months in UTC: the ranges the provider answers are partitioned by
on PostgreSQL (store/partitions.py, decision 0018)."""

from __future__ import annotations

from datetime import UTC, datetime


def month_start(at: datetime) -> datetime:
    """The first instant of the UTC month `at` falls in."""
    at = at.astimezone(UTC)
    return datetime(at.year, at.month, 1, tzinfo=UTC)


def add_months(month: datetime, count: int) -> datetime:
    """The start of the month `count` months after `month`'s (before, if negative)."""
    year, index = divmod(month.year * 12 + month.month - 1 + count, 12)
    return datetime(year, index + 1, 1, tzinfo=UTC)


def months_from(at: datetime, ahead: int) -> list[datetime]:
    """The month of `at` and the `ahead` months after it."""
    first = month_start(at)
    return [add_months(first, n) for n in range(ahead + 1)]
