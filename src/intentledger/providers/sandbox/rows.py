"""Row plumbing every sandbox table shares: JSON bodies and one timestamp text form."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

JSONObject = dict[str, Any]


def format_timestamp(moment: datetime) -> str:
    # A fixed-width form (always microseconds, always Z) so that text order is time order
    # and ORDER BY executed_at is correct without parsing.
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_timestamp(text: str) -> datetime:
    return datetime.fromisoformat(text).astimezone(UTC)


def where_equal(**filters: str | None) -> tuple[str, tuple[str, ...]]:
    """A WHERE clause for the filters given (None means no filter) and its parameters."""
    # Column names come from our own keyword arguments, never from a request.
    chosen = {column: value for column, value in filters.items() if value is not None}
    if not chosen:
        return "", ()
    return " WHERE " + " AND ".join(f"{column} = ?" for column in chosen), tuple(chosen.values())
