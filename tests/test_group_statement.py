"""Intake's group statement sent through psycopg's libpq layer
(store/group_statement.py): the values it writes are the ones the ledger
engine writes, it is prepared once per connection and never behind a pooler,
a statement's error is psycopg's, and a connection whose statement failed or
was cancelled midway is never used again."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from psycopg.waiting import Ready, Wait
from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.canonical import request_hash
from intentledger.engine.clock import system_clock
from intentledger.engine.intake import ACCEPTED_REASON, Intent, accepted_by, operation_values
from intentledger.store import group_statement as group_statement_module
from intentledger.store.database import Pooler
from intentledger.store.group_statement import GroupStatement, _text
from intentledger.store.intake import Accepted, IntakeLedger
from intentledger.store.tables import idempotency_records, operations, outbox, transitions

pytestmark = pytest.mark.parametrize("backend", ["postgresql"])

ROUTE = "POST /v1/payments"


def intent(key: str, actor: str = "alice", description: str | None = None) -> Intent:
    body: dict[str, Any] = {"amount": 1250, "currency": "EUR", "payment_method": "pm_ok"}
    if description is not None:
        body["description"] = description
    return Intent(actor, ROUTE, key, request_hash(actor, ROUTE, body), body, "sandbox")


def group(intents: Sequence[Intent], now: datetime) -> list[Accepted]:
    return [(operation_values(i, now), accepted_by(i)) for i in intents]


async def stored(engine: AsyncEngine, operation_id: str) -> dict[str, Any]:
    """An operation's four rows, with the instants, and nothing that is an id."""
    async with engine.connect() as conn:
        op = (
            await conn.execute(select(operations).where(operations.c.operation_id == operation_id))
        ).one()
        box = (
            await conn.execute(select(outbox).where(outbox.c.operation_id == operation_id))
        ).one()
        move = (
            await conn.execute(
                select(transitions).where(transitions.c.operation_id == operation_id)
            )
        ).one()
        record = (
            await conn.execute(
                select(idempotency_records).where(idempotency_records.c.resource_id == operation_id)
            )
        ).one()
    return {
        "operation": {k: v for k, v in op._mapping.items() if k != "operation_id"},
        "outbox": {k: v for k, v in box._mapping.items() if k not in ("id", "operation_id")},
        "transition": {k: v for k, v in move._mapping.items() if k not in ("id", "operation_id")},
        "record": {k: v for k, v in record._mapping.items() if k != "resource_id"},
    }


async def backend_pid(statement: GroupStatement) -> int:
    assert statement._conn is not None
    return statement._conn.info.backend_pid


async def prepared_on(statement: GroupStatement) -> list[str]:
    """The statements prepared on the group statement's own connection."""
    assert statement._conn is not None
    cursor = await statement._conn.execute("SELECT name FROM pg_prepared_statements ORDER BY name")
    return [row[0] for row in await cursor.fetchall()]


async def test_the_statement_writes_what_the_ledger_engine_writes(
    engine: AsyncEngine, database_url: str
) -> None:
    """The same intents, one group through libpq and one through SQLAlchemy on
    the ledger engine, at the same instant: every column of the four rows is
    equal, text that is not ASCII included, and the instants are the instant."""
    now = datetime(2026, 12, 7, 10, 59, 1, 234567, tzinfo=UTC)
    keys = ["ascii-1", "ключ-✓", "zoë's 🔑"]
    ours = group([intent("a-" + k, actor="zoë", description="café ☕") for k in keys], now)
    theirs = group([intent("b-" + k, actor="zoë", description="café ☕") for k in keys], now)
    statement = GroupStatement(database_url)
    try:
        claimed = await statement.accept_group(ours, ACCEPTED_REASON, now)
    finally:
        await statement.close()
    async with engine.begin() as conn:
        claimed_there = await IntakeLedger(conn).accept_group(theirs, ACCEPTED_REASON, now)
    assert claimed == {str(values["operation_id"]) for values, _ in ours}
    assert claimed_there == {str(values["operation_id"]) for values, _ in theirs}
    for (mine, _), (other, _) in zip(ours, theirs, strict=True):
        here = await stored(engine, str(mine["operation_id"]))
        there = await stored(engine, str(other["operation_id"]))
        assert here["operation"].pop("idempotency_key") == mine["idempotency_key"]
        assert there["operation"].pop("idempotency_key") == other["idempotency_key"]
        assert here["record"].pop("idempotency_key") == mine["idempotency_key"]
        assert there["record"].pop("idempotency_key") == other["idempotency_key"]
        assert here == there
        assert here["operation"]["created_at"] == now
        assert here["outbox"]["due_at"] == now
        assert here["operation"]["actor"] == "zoë"


@pytest.mark.parametrize("pooler", ["none", "pgbouncer"])
async def test_prepared_once_per_connection_and_never_behind_a_pooler(
    database_url: str, pooler: Pooler
) -> None:
    statement = GroupStatement(database_url, pooler)
    now = system_clock()
    try:
        for n in range(3):
            claimed = await statement.accept_group(
                group([intent(f"{pooler}-{n}-{m}") for m in range(4)], now), ACCEPTED_REASON, now
            )
            assert len(claimed) == 4
        first_connection = await backend_pid(statement)
        expected = ["intentledger_accept_group"] if pooler == "none" else []
        assert await prepared_on(statement) == expected
        # A new connection is prepared anew.
        await statement.close()
        await statement.accept_group(group([intent(f"{pooler}-again")], now), ACCEPTED_REASON, now)
        assert await backend_pid(statement) != first_connection
        assert await prepared_on(statement) == expected
    finally:
        await statement.close()


async def test_a_statement_error_is_psycopgs_and_the_next_group_starts_anew(
    engine: AsyncEngine, database_url: str
) -> None:
    """A group the server refuses (here a currency wider than its column)
    raises psycopg's exception for its SQLSTATE, writes nothing, and the
    connection is dropped: the next group goes on a new one."""
    statement = GroupStatement(database_url)
    now = system_clock()
    try:
        await statement.accept_group(group([intent("first")], now), ACCEPTED_REASON, now)
        pid = await backend_pid(statement)
        bad = group([intent("bad-1"), intent("bad-2")], now)
        bad[1] = ({**bad[1][0], "currency": "EURO"}, bad[1][1])
        with pytest.raises(psycopg.errors.StringDataRightTruncation) as raised:
            await statement.accept_group(bad, ACCEPTED_REASON, now)
        assert raised.value.sqlstate == "22001"
        assert statement._conn is None
        async with engine.connect() as conn:
            keys = set(
                (await conn.execute(select(idempotency_records.c.idempotency_key))).scalars()
            )
        assert keys == {"first"}  # the failed group wrote nothing
        claimed = await statement.accept_group(group([intent("after")], now), ACCEPTED_REASON, now)
        assert len(claimed) == 1
        assert await backend_pid(statement) != pid
    finally:
        await statement.close()


async def test_a_statement_cancelled_midway_leaves_its_connection_and_nothing_written(
    engine: AsyncEngine, database_url: str
) -> None:
    """A group waiting on a key another transaction holds is cancelled while
    libpq waits for its answer: the cancellation goes through, the server is
    asked to cancel the statement and the connection is closed, and the next group,
    with the same key once it is free, is claimed on a new connection."""
    statement = GroupStatement(database_url)
    now = system_clock()
    try:
        await statement.accept_group(group([intent("warm")], now), ACCEPTED_REASON, now)
        pid = await backend_pid(statement)
        blocker = await engine.connect()
        held = await blocker.begin()
        await IntakeLedger(blocker).accept_group(
            group([intent("contended")], now), ACCEPTED_REASON, now
        )
        waiting = asyncio.create_task(
            statement.accept_group(group([intent("contended")], now), ACCEPTED_REASON, now)
        )
        async with engine.connect() as conn:
            for _ in range(200):
                lock_waits = await conn.scalar(
                    text(
                        "SELECT count(*) FROM pg_stat_activity "
                        "WHERE pid = :pid AND wait_event_type = 'Lock'"
                    ),
                    {"pid": pid},
                )
                if lock_waits:
                    break
                await asyncio.sleep(0.02)
        assert lock_waits == 1, "the group never waited on the held key"
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert statement._conn is None
        # The server stopped the statement: its backend ends while the key is
        # still held. Closing the connection alone would leave it waiting for
        # the key, and then commit the group.
        async with engine.connect() as conn:
            for _ in range(250):
                gone = not await conn.scalar(
                    text("SELECT count(*) FROM pg_stat_activity WHERE pid = :pid"), {"pid": pid}
                )
                if gone:
                    break
                await asyncio.sleep(0.02)
        assert gone, "the cancelled statement's backend still waits for the key"
        await held.rollback()
        await blocker.close()
        claimed = await statement.accept_group(
            group([intent("contended")], now), ACCEPTED_REASON, now
        )
        assert len(claimed) == 1
        assert await backend_pid(statement) != pid
        async with engine.connect() as conn:
            keys = sorted(
                (await conn.execute(select(idempotency_records.c.idempotency_key))).scalars()
            )
        assert keys == ["contended", "warm"]
    finally:
        await statement.close()


def test_parameters_are_written_as_psycopgs_text_dumpers_write_them(backend: str) -> None:
    instant = datetime(2026, 12, 7, 11, 0, 0, 5, tzinfo=UTC)
    assert _text(None, "utf-8") is None
    assert _text(True, "utf-8") == b"t" and _text(False, "utf-8") == b"f"
    assert _text(0, "utf-8") == b"0" and _text(-12, "utf-8") == b"-12"
    assert _text("zoë", "utf-8") == "zoë".encode()
    assert _text(instant, "utf-8") == b"2026-12-07T11:00:00.000005+00:00"
    east = instant.astimezone(timezone(timedelta(hours=2)))
    assert _text(east, "utf-8") == b"2026-12-07T13:00:00.000005+02:00"  # the same instant
    with pytest.raises(TypeError, match="aware"):
        _text(datetime(2026, 12, 7, 11, 0), "utf-8")
    with pytest.raises(TypeError, match="float"):
        _text(1.5, "utf-8")


async def test_a_statement_larger_than_the_socket_takes_is_sent_in_turns(
    engine: AsyncEngine, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group whose values outgrow what the socket takes at once: libpq sends
    it in turns, the statement waiting for the socket between them (and
    reading what the server sends meanwhile), and every byte arrives."""
    waits: list[Wait] = []
    original = group_statement_module._ready

    async def counted(loop: asyncio.AbstractEventLoop, fileno: int, wait: Wait) -> Ready:
        waits.append(wait)
        return await original(loop, fileno, wait)

    monkeypatch.setattr(group_statement_module, "_ready", counted)
    description = "ü" * (8 * 1024 * 1024)  # 16 MiB of UTF-8
    statement = GroupStatement(database_url)
    now = system_clock()
    big = group([intent("big", description=description)], now)
    try:
        claimed = await statement.accept_group(big, ACCEPTED_REASON, now)
    finally:
        await statement.close()
    assert claimed == {str(big[0][0]["operation_id"])}
    assert Wait.RW in waits, "the statement went out in one send: make it larger"
    async with engine.connect() as conn:
        context = await conn.scalar(
            select(operations.c.request_context).where(
                operations.c.operation_id == big[0][0]["operation_id"]
            )
        )
    assert context["body"]["description"] == description
