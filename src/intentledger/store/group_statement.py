"""Intake's group statement, on a psycopg connection of its own.

A transport, not a second writer: it sends the call `IntakeLedger` sends
(store/intake.py: the same function, migration 0019's
`intentledger_accept_group`, with the same parameters), only over another
connection. On PostgreSQL a group of intents is that one statement, and so a
transaction by itself. Sent through SQLAlchemy it also paid for a pool
checkout, a greenlet switch, an execution context and the result's wrapping:
about a fifth of an API process's CPU per intent (docs/benchmarks.md step
25). An API process's one committer sends one group at a time
(engine/group_intake.py), so one connection, kept open and in autocommit, is
all it needs: one round trip per group, nothing else sent.

psycopg makes the connection (the URL, its host list, authentication, TLS)
and closes it; the statement itself goes through psycopg's libpq layer
(`psycopg.pq`), its results read by store/libpq.py with one readiness wait
on the event loop at a time. A cursor's execute also made a cursor, its
adapters and a query object, asked the prepared-statement cache, polled the
socket for writing and set and cancelled a timer on every wait: measured
here, 148 µs of CPU a group of eight against 97 for the same statement sent
this way (docs/benchmarks.md, "The group statement through libpq"). Its
parameters are of five known kinds (`_text`), written as psycopg's text
dumpers write them, and its only column read back is text.

The statement is prepared once per connection, as psycopg prepares a
statement after its fifth use. Behind a pooler nothing is prepared, as on
every other connection (store/database.py: `connect_args`): each group then
sends the statement's text with its values.

There is no pre-ping. A connection that fails its statement (the server
restarted, a pooler dropped it) or whose statement was cancelled midway is
closed and the error goes to the caller, which accepts the group's intents
one by one on the ledger engine, whose pre-ping replaces dead connections;
the next group opens a new connection. A statement error is psycopg's
exception for its SQLSTATE, as a cursor would raise it. A cancelled
statement is cancelled on the server too, as psycopg cancels one; one
cancelled while still being sent may yet run, as under psycopg: closing
the connection sends the rest, and the server ignores a cancel until a
statement runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import psycopg
from psycopg.pq import ExecStatus

from intentledger.store import libpq
from intentledger.store.database import Pooler, connect_args, dialect_of, libpq_url
from intentledger.store.intake import (
    ACCEPT_GROUP_PARAMETERS,
    Accepted,
    accept_group_call,
    accept_group_parameters,
)

# libpq's placeholders, by position. psycopg names the statements it
# prepares "_pg3_N": this name never meets one of those.
_ACCEPT_GROUP_SQL = accept_group_call("${1}").encode("ascii")
_PREPARED_NAME = b"intentledger_accept_group"


def _text(value: object, encoding: str) -> bytes | None:
    """A parameter in PostgreSQL's text form, as psycopg's text dumpers write
    it; the server types it from the function's signature and the casts.
    Text goes in the connection's encoding, UTF-8 where that is SQL_ASCII
    (psycopg's rule), and never with a NUL, which libpq would take for its
    end (psycopg refuses it too)."""
    if value is None:
        return None
    if isinstance(value, str):
        if "\x00" in value:
            raise psycopg.DataError("PostgreSQL text cannot contain NUL (0x00) bytes")
        return value.encode("utf-8" if encoding == "ascii" else encoding)
    if isinstance(value, bool):  # before int: True is an int
        return b"t" if value else b"f"
    if isinstance(value, int):
        return str(value).encode("ascii")
    if isinstance(value, datetime):
        if value.utcoffset() is None:
            # Read in the session's time zone it would be another instant.
            raise TypeError("the group statement takes aware instants, not naive ones")
        return value.isoformat().encode("ascii")
    raise TypeError(f"the group statement has no text form for {type(value).__name__}")


class GroupStatement:
    def __init__(self, url: str, pooler: Pooler = "none") -> None:
        self._conninfo = libpq_url(url)
        self._connect_args = connect_args(url, pooler)
        self._prepare = pooler == "none"
        self._conn: psycopg.AsyncConnection[Any] | None = None
        # Whether `_conn` holds the prepared statement.
        self._prepared = False

    async def accept_group(
        self, accepted: Sequence[Accepted], reason: str, now: datetime
    ) -> set[str]:
        """`IntakeLedger.accept_group`, committed by the statement itself: the
        operation ids whose keys were claimed."""
        parameters = accept_group_parameters(accepted, reason, now)
        conn = self._conn
        if conn is None or conn.closed:
            conn = self._conn = await psycopg.AsyncConnection.connect(
                self._conninfo, autocommit=True, **self._connect_args
            )
            self._prepared = False
        try:
            encoding = conn.info.encoding
            values = [_text(parameters[name], encoding) for name in ACCEPT_GROUP_PARAMETERS]
            rows = await self._call(conn, values)
        except BaseException:
            # Whatever state it is in (dead, or cancelled mid-statement and
            # cancelled on the server: store/libpq.py), the next group starts
            # on a new connection.
            await self.close()
            raise
        return {row.decode(encoding) for row in rows}

    async def _call(
        self, conn: psycopg.AsyncConnection[Any], values: Sequence[bytes | None]
    ) -> list[bytes]:
        """The statement's first column of each row it returns."""
        pgconn = conn.pgconn
        if not self._prepare:
            pgconn.send_query_params(_ACCEPT_GROUP_SQL, values)
            return await _first_column(conn)
        if not self._prepared:
            pgconn.send_prepare(_PREPARED_NAME, _ACCEPT_GROUP_SQL)
            await _first_column(conn)
            self._prepared = True
        pgconn.send_query_prepared(_PREPARED_NAME, values)
        return await _first_column(conn)

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        self._prepared = False
        if conn is not None:
            await conn.close()


async def _first_column(conn: psycopg.AsyncConnection[Any]) -> list[bytes]:
    """What the command just sent returns (store/libpq.py reads it): the first
    column of its rows, or psycopg's error for the first result that failed."""
    got = await libpq.results(conn)
    failed = libpq.first_failure(conn, got)
    if failed is not None:
        raise failed
    return [
        value
        for result in got
        if result.status == ExecStatus.TUPLES_OK
        for row in range(result.ntuples)
        if (value := result.get_value(row, 0)) is not None
    ]


def group_statement_for(url: str, pooler: Pooler = "none") -> GroupStatement | None:
    """The group statement on PostgreSQL; None on SQLite, whose writes take
    BEGIN IMMEDIATE on the ledger engine."""
    return GroupStatement(url, pooler) if dialect_of(url) == "postgresql" else None
