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
(`psycopg.pq`), the way psycopg's own generators drive libpq, with one
readiness wait on the event loop. A cursor's execute also made a cursor, its
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

import asyncio
import logging
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import psycopg
from psycopg.pq import ExecStatus, TransactionStatus
from psycopg.waiting import Ready, Wait

from intentledger.store.database import Pooler, connect_args, dialect_of, libpq_url
from intentledger.store.intake import (
    ACCEPT_GROUP_PARAMETERS,
    Accepted,
    accept_group_call,
    accept_group_parameters,
)

log = logging.getLogger(__name__)

# How long a cancelled statement's cancel request may take (psycopg's own bound).
CANCEL_TIMEOUT_SECONDS = 5.0

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
        except BaseException as exc:
            # Whatever state it is in (dead, or cancelled mid-statement), the
            # next group starts on a new connection.
            try:
                if isinstance(exc, asyncio.CancelledError):
                    await _cancel_on_the_server(conn)
            finally:
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


# What a COPY would answer: libpq hands it back on every call, never ending.
_COPY = frozenset({ExecStatus.COPY_IN, ExecStatus.COPY_OUT, ExecStatus.COPY_BOTH})


async def _first_column(conn: psycopg.AsyncConnection[Any]) -> list[bytes]:
    """What the command just sent returns, once libpq has sent it all and read
    its every result: the first column of its rows, or psycopg's error for
    the first result that failed. libpq's own reads block the thread while
    the connection is busy, so each result is taken only once it is not, as
    psycopg's generators take them."""
    pgconn = conn.pgconn
    loop = asyncio.get_running_loop()
    while pgconn.flush():
        # libpq's rule for a send that must wait: read what the server sends
        # meanwhile, or each side may wait for the other.
        if await _ready(loop, pgconn.socket, Wait.RW) & Ready.R:
            pgconn.consume_input()
    column: list[bytes] = []
    failed: psycopg.Error | None = None
    while True:
        while pgconn.is_busy():
            await _ready(loop, pgconn.socket, Wait.R)
            pgconn.consume_input()
        result = pgconn.get_result()
        if result is None:
            break
        status = result.status
        if status == ExecStatus.TUPLES_OK:
            column.extend(
                value
                for row in range(result.ntuples)
                if (value := result.get_value(row, 0)) is not None
            )
        elif status in _COPY:
            raise psycopg.ProgrammingError("the group statement cannot be answered by a COPY")
        elif status != ExecStatus.COMMAND_OK and failed is None:
            failed = psycopg.errors.error_from_result(result, encoding=conn.info.encoding)
    if failed is not None:
        raise failed
    return column


async def _ready(loop: asyncio.AbstractEventLoop, socket: int, wait: Wait) -> Ready:
    """Until the connection's socket is ready for what `wait` asks: which it
    is ready for. A socket the loop cannot watch (closed under it) is
    psycopg's `OperationalError`, as psycopg's own wait makes it."""
    ready: asyncio.Future[Ready] = loop.create_future()
    reading, writing = bool(wait & Wait.R), bool(wait & Wait.W)
    try:
        if reading:
            loop.add_reader(socket, _wake, ready, Ready.R)
        if writing:
            loop.add_writer(socket, _wake, ready, Ready.W)
        return await ready
    except OSError as exc:
        raise psycopg.OperationalError("connection socket closed") from exc
    finally:
        if reading:
            loop.remove_reader(socket)
        if writing:
            loop.remove_writer(socket)


async def _cancel_on_the_server(conn: psycopg.AsyncConnection[Any]) -> None:
    """psycopg's rule for a query whose task is cancelled: the server is asked
    to cancel it too. Closing the connection alone would not stop it: a
    backend waiting on a lock notices its client gone only once it has the
    lock, and then commits the group (tests/test_group_statement.py)."""
    if conn.pgconn.transaction_status != TransactionStatus.ACTIVE:
        return
    try:
        await conn.cancel_safe(timeout=CANCEL_TIMEOUT_SECONDS)
    except Exception as exc:
        log.warning("the group statement's cancellation failed: %s", exc)


def _wake(ready: asyncio.Future[Ready], state: Ready) -> None:
    # The socket stays ready until the waiting task runs and stops watching it.
    if not ready.done():
        ready.set_result(state)


def group_statement_for(url: str, pooler: Pooler = "none") -> GroupStatement | None:
    """The group statement on PostgreSQL; None on SQLite, whose writes take
    BEGIN IMMEDIATE on the ledger engine."""
    return GroupStatement(url, pooler) if dialect_of(url) == "postgresql" else None
