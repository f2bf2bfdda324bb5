"""Statements about many rows by key, whose keys are one parameter."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from sqlalchemy import any_, bindparam
from sqlalchemy.dialects.postgresql import ARRAY

# The parameter `among_ids` binds.
IDS = "ids"
# Keys one read of many takes at most: SQLite binds each of an IN list's values
# as its own parameter, and a statement takes a bounded number of them.
IDS_PER_READ = 500


def among_ids(column: Any, is_postgres: bool) -> Any:
    """`column` is one of the `ids` parameter's values. On PostgreSQL that is one
    array parameter: the statement's text is then the same whatever the number
    of ids, so psycopg prepares it once per connection. An expanding IN list is
    a new statement for every count, parsed and planned again each time (a
    group of 7 answers and one of 8 share nothing). SQLite has no arrays."""
    if is_postgres:
        return column == any_(bindparam(IDS, type_=ARRAY(column.type)))
    return column.in_(bindparam(IDS, expanding=True))


def id_reads(keys: Iterable[str]) -> Iterator[dict[str, list[str]]]:
    """The `ids` parameter of each read that takes `keys` (each once, in order),
    at most `IDS_PER_READ` to a read; none for no keys."""
    wanted = sorted(set(keys))
    for start in range(0, len(wanted), IDS_PER_READ):
        yield {IDS: wanted[start : start + IDS_PER_READ]}
