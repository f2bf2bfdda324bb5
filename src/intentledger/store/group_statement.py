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

There is no pre-ping. A connection that fails its statement (the server
restarted, a pooler dropped it) is closed and the error goes to the caller,
which accepts the group's intents one by one on the ledger engine, whose
pre-ping replaces dead connections; the next group opens a new connection.
The connection is made with `connect_args`, so behind a pooler nothing is
prepared, as on every other connection.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import psycopg

from intentledger.store.database import Pooler, connect_args, dialect_of, libpq_url
from intentledger.store.intake import Accepted, accept_group_call, accept_group_parameters

_ACCEPT_GROUP = accept_group_call("%({})s")


class GroupStatement:
    def __init__(self, url: str, pooler: Pooler = "none") -> None:
        self._conninfo = libpq_url(url)
        self._connect_args = connect_args(url, pooler)
        self._conn: psycopg.AsyncConnection[Any] | None = None

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
        try:
            cursor = await conn.execute(_ACCEPT_GROUP, parameters)
            found = await cursor.fetchall()
        except BaseException:
            # Whatever state it is in (dead, or cancelled mid-statement), the
            # next group starts on a new connection.
            await self.close()
            raise
        return {row[0] for row in found}

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close()


def group_statement_for(url: str, pooler: Pooler = "none") -> GroupStatement | None:
    """The group statement on PostgreSQL; None on SQLite, whose writes take
    BEGIN IMMEDIATE on the ledger engine."""
    return GroupStatement(url, pooler) if dialect_of(url) == "postgresql" else None
