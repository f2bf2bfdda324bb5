"""Intake's group statement sent through psycopg's libpq layer
(store/group_statement.py): the values it writes are the ones the ledger
engine writes, it is prepared once per connection and never behind a pooler,
a statement's error is psycopg's, and a connection whose statement failed or
was cancelled midway is never used again."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta, timezone, tzinfo
from typing import Any

import psycopg
import pytest
from psycopg.adapt import PyFormat, Transformer
from psycopg.pq import ExecStatus
from psycopg.waiting import Ready, Wait
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.canonical import request_hash
from intentledger.engine.clock import system_clock
from intentledger.engine.intake import ACCEPTED_REASON, Intent, accepted_by, operation_values
from intentledger.store import group_statement as group_statement_module
from intentledger.store import libpq as libpq_module
from intentledger.store.database import Pooler, libpq_url
from intentledger.store.group_statement import GroupStatement, _text
from intentledger.store.intake import Accepted, IntakeLedger
from intentledger.store.tables import idempotency_records, operations, outbox, transitions
from tests.support import until_backend

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
        waits_on = await until_backend(engine, pid, lambda seen: seen == "Lock")
        assert waits_on == "Lock", "the group never waited on the held key"
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert statement._conn is None
        # The server stopped the statement: its backend ends while the key is
        # still held. Closing the connection alone would leave it waiting for
        # the key, and then commit the group.
        after_cancel = await until_backend(engine, pid, lambda seen: seen is None)
        assert after_cancel is None, "the cancelled statement's backend still waits for the key"
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


@pytest.mark.parametrize(
    "value", [None, True, False, 0, -12, 2**62, "", "pm_ok", "zoë ☕ 🔑", '{"a": "\\u0000"}']
)
def test_values_are_written_as_psycopgs_text_dumpers_write_them(backend: str, value: Any) -> None:
    expected = None
    if value is not None:
        expected = bytes(Transformer().get_dumper(value, PyFormat.TEXT).dump(value))
    assert _text(value, "utf-8") == expected
    # psycopg writes UTF-8 where the connection's encoding is SQL_ASCII.
    assert _text(value, "ascii") == expected


async def test_instants_are_read_by_the_server_as_the_same_instants(database_url: str) -> None:
    """psycopg writes an instant with a space where `isoformat` writes a T:
    the server reads each as the instant it is, whatever its offset."""
    instants = [
        datetime(2026, 12, 7, 11, 0, 0, 5, tzinfo=UTC),
        datetime(2026, 12, 7, 13, 0, 0, 999999, tzinfo=timezone(timedelta(hours=2))),
        datetime(1999, 12, 31, 23, 59, 59, tzinfo=timezone(timedelta(hours=-9, minutes=-30))),
    ]
    async with await psycopg.AsyncConnection.connect(libpq_url(database_url)) as conn:
        await conn.execute("SET TIME ZONE 'Pacific/Chatham'")  # neither UTC nor a whole hour
        for instant in instants:
            written = _text(instant, "utf-8")
            assert written is not None
            cursor = await conn.execute(
                "SELECT CAST(%s::text AS timestamptz) = %s", (written.decode(), instant)
            )
            assert await cursor.fetchone() == (True,)


class _NoOffset(tzinfo):
    def utcoffset(self, dt: datetime | None) -> timedelta | None:
        return None

    def dst(self, dt: datetime | None) -> timedelta | None:
        return None

    def tzname(self, dt: datetime | None) -> str | None:
        return None


def test_what_has_no_exact_text_is_refused(backend: str) -> None:
    with pytest.raises(TypeError, match="aware"):
        _text(datetime(2026, 12, 7, 11, 0), "utf-8")
    with pytest.raises(TypeError, match="aware"):  # a zone that knows no offset
        _text(datetime(2026, 12, 7, 11, 0, tzinfo=_NoOffset()), "utf-8")
    with pytest.raises(TypeError, match="float"):
        _text(1.5, "utf-8")
    with pytest.raises(psycopg.DataError, match="NUL"):  # libpq would cut the value there
        _text("before\x00after", "utf-8")


async def test_a_connection_in_sql_ascii_stores_the_same_text(
    engine: AsyncEngine, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client encoding of SQL_ASCII (PGCLIENTENCODING) on a UTF-8 database:
    text that is not ASCII is written as UTF-8, as psycopg writes it, and is
    stored as it was sent."""
    monkeypatch.setenv("PGCLIENTENCODING", "SQL_ASCII")
    statement = GroupStatement(database_url)
    now = system_clock()
    try:
        claimed = await statement.accept_group(
            group([intent("ключ-✓", actor="zoë")], now), ACCEPTED_REASON, now
        )
        assert statement._conn is not None and statement._conn.info.encoding == "ascii"
    finally:
        await statement.close()
        monkeypatch.delenv("PGCLIENTENCODING")  # read back as the ledger engine reads
    assert len(claimed) == 1
    async with engine.connect() as conn:
        row = (
            await conn.execute(
                select(idempotency_records.c.actor, idempotency_records.c.idempotency_key)
            )
        ).one()
    assert tuple(row) == ("zoë", "ключ-✓")


async def test_a_statement_larger_than_the_socket_takes_is_sent_in_turns(
    engine: AsyncEngine, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group whose values outgrow what the socket takes at once: libpq sends
    it in turns, the statement waiting for the socket between them (and
    reading what the server sends meanwhile), and every byte arrives."""
    waits: list[Wait] = []
    original = libpq_module.ready

    async def counted(loop: asyncio.AbstractEventLoop, fileno: int, wait: Wait) -> Ready:
        waits.append(wait)
        return await original(loop, fileno, wait)

    monkeypatch.setattr(libpq_module, "ready", counted)
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
    assert context is not None and context["body"]["description"] == description


# -- how the answer is read, against a scripted libpq ---------------------------------------


class _Result:
    def __init__(self, status: ExecStatus, rows: Sequence[bytes] = ()) -> None:
        self.status = status
        self.rows = list(rows)
        self.ntuples = len(self.rows)

    def get_value(self, row: int, column: int) -> bytes:
        assert column == 0
        return self.rows[row]


_END = _Result(ExecStatus.EMPTY_QUERY)  # stands for ReadyForQuery: no more results


class _ScriptedLibpq:
    """libpq as `_first_column` drives it. Each arrival (results, or the end)
    comes in on the `consume_input` after a wait for reading. `get_result`
    while busy fails the test: the real one would block the thread, and with
    it the event loop, until the server's next bytes came."""

    socket = 7

    def __init__(self, arrivals: list[list[_Result]], flushes: Sequence[int] = (0,)) -> None:
        self.arrivals = arrivals
        self.flushes = list(flushes)
        self.available: list[_Result] = []
        self.finished = False
        self.waited_for_reading = False
        self.consumed_while_sending = 0

    def flush(self) -> int:
        return self.flushes.pop(0)

    def consume_input(self) -> None:
        if self.flushes:
            self.consumed_while_sending += 1
        if self.waited_for_reading and self.arrivals:
            for result in self.arrivals.pop(0):
                if result is _END:
                    self.finished = True
                else:
                    self.available.append(result)
        self.waited_for_reading = False

    def is_busy(self) -> int:
        return int(not self.available and not self.finished)

    def get_result(self) -> _Result | None:
        if self.is_busy():
            raise AssertionError("get_result while busy: libpq would block the event loop")
        return self.available.pop(0) if self.available else None


class _Info:
    encoding = "utf-8"


class _Conn:
    def __init__(self, pgconn: _ScriptedLibpq) -> None:
        self.pgconn = pgconn
        self.info = _Info()


def _script(
    monkeypatch: pytest.MonkeyPatch, pgconn: _ScriptedLibpq, answers: Sequence[Ready] = ()
) -> list[Wait]:
    """`libpq.ready` answered at once (by `answers` in turn, then "readable"); the waits asked."""
    waits: list[Wait] = []
    queued = list(answers)

    async def ready(loop: asyncio.AbstractEventLoop, socket: int, wait: Wait) -> Ready:
        waits.append(wait)
        answer = queued.pop(0) if queued else Ready.R
        if answer & Ready.R:
            pgconn.waited_for_reading = True
        return answer

    monkeypatch.setattr(libpq_module, "ready", ready)
    return waits


async def test_each_result_is_taken_only_once_libpq_is_not_busy(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rows come in one read and the end of the command in the next, as
    an error and the server's ReadyForQuery do: the second result is taken
    only after a wait, never with libpq busy."""
    rows = _Result(ExecStatus.TUPLES_OK, [b"op-1", b"op-2"])
    pgconn = _ScriptedLibpq([[rows], [_END]])
    waits = _script(monkeypatch, pgconn)
    column = await group_statement_module._first_column(_Conn(pgconn))  # type: ignore[arg-type]
    assert column == [b"op-1", b"op-2"]
    assert waits == [Wait.R, Wait.R]


async def test_an_error_ahead_of_the_end_is_raised_once_the_command_ends(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    failure = _Result(ExecStatus.FATAL_ERROR)
    pgconn = _ScriptedLibpq([[failure], [_END]])
    _script(monkeypatch, pgconn)
    made: list[_Result] = []

    def error_from_result(result: _Result, encoding: str) -> psycopg.Error:
        made.append(result)
        return psycopg.errors.SerializationFailure("could not serialize access")

    monkeypatch.setattr(psycopg.errors, "error_from_result", error_from_result)
    with pytest.raises(psycopg.errors.SerializationFailure):
        await group_statement_module._first_column(_Conn(pgconn))  # type: ignore[arg-type]
    assert made == [failure]
    assert pgconn.finished  # read to its end: nothing left on the connection


async def test_what_the_server_sends_while_a_send_waits_is_read(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """libpq's rule for a send that must wait: the socket is watched for
    reading too, and what arrived is read before the send goes on."""
    pgconn = _ScriptedLibpq([[], [_Result(ExecStatus.TUPLES_OK, [b"op"])], [_END]], [1, 1, 0])
    waits = _script(monkeypatch, pgconn, [Ready.R, Ready.W])
    assert await group_statement_module._first_column(_Conn(pgconn)) == [b"op"]  # type: ignore[arg-type]
    assert waits[:2] == [Wait.RW, Wait.RW]
    assert pgconn.consumed_while_sending == 1


async def test_a_copy_answer_is_refused_not_read_for_ever(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pgconn = _ScriptedLibpq([[_Result(ExecStatus.COPY_OUT)]])
    _script(monkeypatch, pgconn)
    with pytest.raises(psycopg.ProgrammingError, match="COPY"):
        await group_statement_module._first_column(_Conn(pgconn))  # type: ignore[arg-type]
