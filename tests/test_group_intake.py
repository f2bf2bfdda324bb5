"""Group commit: concurrent intents share a transaction, and each gets exactly
what `accept()` alone would have given it, on both databases; on PostgreSQL
the group is one autocommitted statement on the group statement's connection."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
from prometheus_client import REGISTRY
from sqlalchemy import event, func, select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.canonical import request_hash
from intentledger.engine.clock import system_clock
from intentledger.engine.group_intake import IntakeGroups
from intentledger.engine.intake import IntakeResult, Intent, accept, operation_values
from intentledger.engine.refusal import IdempotencyKeyReused
from intentledger.store import group_statement as group_statement_module
from intentledger.store.group_statement import GroupStatement, group_statement_for
from intentledger.store.intake import ACCEPT_GROUP_COLUMNS
from intentledger.store.tables import idempotency_records, operations, outbox, transitions
from tests.support import until_backend

ROUTE = "POST /v1/payments"


def intent(key: str, amount: int = 1250, actor: str = "alice") -> Intent:
    body = {"amount": amount, "currency": "EUR", "payment_method": "pm_ok", "metadata": {}}
    return Intent(actor, ROUTE, key, request_hash(actor, ROUTE, body), body, "sandbox")


@pytest.fixture
async def group_statement(database_url: str) -> AsyncIterator[GroupStatement | None]:
    """What `serve` gives the groups: a connection of their own on PostgreSQL, none on SQLite."""
    statement = group_statement_for(database_url)
    yield statement
    if statement is not None:
        await statement.close()


@pytest.fixture
def groups(engine: AsyncEngine, group_statement: GroupStatement | None) -> IntakeGroups:
    return IntakeGroups(engine, system_clock, group_statement=group_statement)


def groups_committed() -> float:
    """How many intake groups have committed in this process (the group-size histogram's count)."""
    value = REGISTRY.get_sample_value("intentledger_group_commit_size_count", {"stage": "intake"})
    return value or 0.0


def record_psycopg_statements(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """Each group statement sent on the group statement's own connection
    (through libpq; SQLAlchemy sends through cursors), and whether that
    connection autocommits. What the server ran is read from the server."""
    sent: list[tuple[str, bool]] = []
    original = GroupStatement._call

    async def call(
        self: GroupStatement, conn: psycopg.AsyncConnection[Any], values: Any
    ) -> list[bytes]:
        sent.append((group_statement_module._ACCEPT_GROUP_SQL.decode(), conn.autocommit))
        return await original(self, conn, values)

    monkeypatch.setattr(GroupStatement, "_call", call)
    return sent


def operation_id(result: IntakeResult | BaseException) -> str:
    assert isinstance(result, IntakeResult), result
    return result.operation_id


async def rows_of(engine: AsyncEngine, op_id: str) -> dict[str, list[tuple[Any, ...]]]:
    """An operation's rows, without ids, times and the operation id itself, and
    how many distinct instants intake wrote (created, updated, due, logged)."""
    async with engine.connect() as conn:
        op = (
            await conn.execute(select(operations).where(operations.c.operation_id == op_id))
        ).one()
        boxes = (await conn.execute(select(outbox).where(outbox.c.operation_id == op_id))).all()
        moves = (
            await conn.execute(select(transitions).where(transitions.c.operation_id == op_id))
        ).all()
        record = (
            await conn.execute(
                select(idempotency_records).where(idempotency_records.c.resource_id == op_id)
            )
        ).one()
    skip = {"operation_id", "idempotency_key", "created_at", "updated_at"}
    return {
        "operation": [tuple(v for k, v in op._mapping.items() if k not in skip)],
        "outbox": [(b.kind, b.lease_owner, b.deliveries, b.decision_id, b.done_at) for b in boxes],
        "transitions": [
            (t.from_state, t.to_state, t.next_action, t.reason, t.source) for t in moves
        ],
        "record": [(record.actor, record.route, record.request_hash)],
        "instants": [
            (
                len(
                    {op.created_at, op.updated_at}
                    | {b.due_at for b in boxes}
                    | {b.created_at for b in boxes}
                    | {t.at for t in moves}
                ),
            )
        ],
    }


async def test_concurrent_intents_share_commits_and_write_what_accept_writes(
    engine: AsyncEngine, groups: IntakeGroups
) -> None:
    alone = operation_id(await accept(engine, system_clock, intent("alone")))
    before = groups_committed()
    results = await asyncio.gather(*(groups.accept(intent(f"k{n}")) for n in range(100)))
    assert groups_committed() - before == 2  # 100 intents, groups of at most 64
    ids = {operation_id(r) for r in results}
    assert len(ids) == 100 and not any(r.replayed for r in results)
    reference = await rows_of(engine, alone)
    assert reference["instants"] == [(1,)]  # all written at one `now`
    for op_id in ids:
        assert await rows_of(engine, op_id) == reference


async def test_a_group_answers_retries_conflicts_and_repeated_keys(
    engine: AsyncEngine, groups: IntakeGroups
) -> None:
    first = await groups.accept(intent("seen"))
    new, replay, reused, twice_a, twice_b = await asyncio.gather(
        groups.accept(intent("fresh")),
        groups.accept(intent("seen")),
        groups.accept(intent("seen", amount=999)),
        groups.accept(intent("twice")),
        groups.accept(intent("twice")),
        return_exceptions=True,
    )
    assert isinstance(new, IntakeResult) and not new.replayed
    assert isinstance(replay, IntakeResult) and replay.replayed
    assert operation_id(replay) == operation_id(first)
    assert isinstance(reused, IdempotencyKeyReused)
    assert reused.resource_id == operation_id(first)
    # The same key twice in one group: the second waits for the next group and replays.
    assert isinstance(twice_a, IntakeResult) and isinstance(twice_b, IntakeResult)
    assert (twice_a.replayed, twice_b.replayed) == (False, True)
    assert operation_id(twice_a) == operation_id(twice_b)
    async with engine.connect() as conn:
        keys = (await conn.execute(select(idempotency_records.c.idempotency_key))).scalars()
        assert sorted(keys) == ["fresh", "seen", "twice"]


async def test_a_failed_group_is_tried_one_intent_at_a_time(
    groups: IntakeGroups, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = operation_id(await groups.accept(intent("seen")))

    async def broken(_group: Any) -> Any:
        raise RuntimeError("the group's transaction failed")

    monkeypatch.setattr(groups, "_commit", broken)
    new, replay, reused = await asyncio.gather(
        groups.accept(intent("after")),
        groups.accept(intent("seen")),
        groups.accept(intent("seen", amount=1)),
        return_exceptions=True,
    )
    assert isinstance(new, IntakeResult) and not new.replayed
    assert isinstance(replay, IntakeResult) and operation_id(replay) == seen
    assert isinstance(reused, IdempotencyKeyReused)


async def test_a_request_that_goes_away_leaves_its_intent_and_the_others_answered(
    groups: IntakeGroups,
) -> None:
    gone = asyncio.create_task(groups.accept(intent("gone")))
    kept = asyncio.create_task(groups.accept(intent("kept")))
    await asyncio.sleep(0)  # both queued
    gone.cancel()
    assert not (await kept).replayed
    with pytest.raises(asyncio.CancelledError):
        await gone
    # The intent was made durable all the same; a retry finds it.
    assert (await groups.accept(intent("gone"))).replayed


def record_statements(engine: AsyncEngine) -> list[tuple[str, bool]]:
    """Each statement the engine sends, and whether its connection autocommits."""
    sent: list[tuple[str, bool]] = []

    def before(conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        sent.append((statement, conn.connection.dbapi_connection.autocommit))

    event.listen(engine.sync_engine, "before_cursor_execute", before)
    return sent


@pytest.mark.parametrize("backend", ["postgresql"])
async def test_on_postgresql_a_group_is_one_autocommitted_statement(
    engine: AsyncEngine, groups: IntakeGroups, monkeypatch: pytest.MonkeyPatch
) -> None:
    await groups.accept(intent("warm-up"))
    on_ledger = record_statements(engine)
    on_group_connection = record_psycopg_statements(monkeypatch)
    before = groups_committed()
    results = await asyncio.gather(*(groups.accept(intent(f"k{n}")) for n in range(20)))
    assert not any(r.replayed for r in results)
    assert len(on_group_connection) == 1 and on_group_connection[0][1] is True
    assert on_ledger == []  # no BEGIN, no COMMIT, no pre-ping: the statement alone
    assert groups_committed() - before == 1  # and it was counted
    statement = groups.group_statement
    assert statement is not None and statement._conn is not None
    async with engine.connect() as conn:
        stored = await conn.scalar(select(func.count()).select_from(operations))
        # What the server last ran on the group's connection, and that it
        # left no transaction open: migration 0019's function, whose plan is
        # kept per server connection.
        last = (
            await conn.execute(
                text("SELECT query, state FROM pg_stat_activity WHERE pid = :pid"),
                {"pid": statement._conn.info.backend_pid},
            )
        ).one()
    assert stored == 21
    assert "intentledger_accept_group(" in last.query and last.state == "idle"


@pytest.mark.parametrize("backend", ["postgresql"])
async def test_a_group_on_a_connection_that_died_is_tried_again_and_loses_nothing(
    engine: AsyncEngine, groups: IntakeGroups, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No pre-ping on the group statement's connection: one the server dropped
    between groups fails the group's statement, the group's intents are
    accepted one by one on the ledger engine, and the next group gets a new
    connection."""
    await groups.accept(intent("before"))
    statement = groups.group_statement
    assert statement is not None and statement._conn is not None
    pid = statement._conn.info.backend_pid
    async with engine.connect() as conn:
        assert await conn.scalar(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
    assert await until_backend(engine, pid, lambda seen: seen is None) is None
    on_ledger = record_statements(engine)
    during = await asyncio.gather(*(groups.accept(intent(f"d{n}")) for n in range(5)))
    assert all(isinstance(r, IntakeResult) and not r.replayed for r in during)
    assert any("INSERT INTO idempotency_records" in s for s, _ in on_ledger)  # one by one
    on_ledger.clear()
    on_group_connection = record_psycopg_statements(monkeypatch)
    after = await asyncio.gather(*(groups.accept(intent(f"a{n}")) for n in range(5)))
    assert not any(r.replayed for r in after)
    assert len(on_group_connection) == 1  # a group again,
    assert statement._conn is not None and statement._conn.info.backend_pid != pid  # anew
    assert not any("INSERT" in s for s, _ in on_ledger)
    async with engine.connect() as conn:
        keys = (await conn.execute(select(idempotency_records.c.idempotency_key))).scalars()
        stored = await conn.scalar(select(func.count()).select_from(operations))
    assert sorted(keys) == sorted(
        ["before", *(f"d{n}" for n in range(5)), *(f"a{n}" for n in range(5))]
    )
    assert stored == 11


async def test_a_group_that_committed_and_then_failed_answers_each_request_as_new(
    engine: AsyncEngine, groups: IntakeGroups, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The group's commit reached the database but its answer did not come back
    (a connection lost on the way back, the retries' judging failing): each
    intent, accepted on its own, finds the operation its group minted for it.
    That is its own first write, not a replay; a real retry in the same burst
    still replays."""
    committed_then_lost = 0
    original = IntakeGroups._commit

    async def commit_then_fail(self: IntakeGroups, group: Any) -> Any:
        nonlocal committed_then_lost
        await original(self, group)
        committed_then_lost += 1
        raise ConnectionError("the server closed the connection unexpectedly")

    first = await groups.accept(intent("earlier"))
    assert not first.replayed
    monkeypatch.setattr(IntakeGroups, "_commit", commit_then_fail)
    results = await asyncio.gather(
        groups.accept(intent("earlier")), *(groups.accept(intent(f"k{n}")) for n in range(6))
    )
    assert committed_then_lost >= 1
    assert results[0].replayed and operation_id(results[0]) == operation_id(first)
    assert not any(r.replayed for r in results[1:])
    async with engine.connect() as conn:
        stored = await conn.scalar(select(func.count()).select_from(operations))
        queued = await conn.scalar(select(func.count()).select_from(outbox))
    assert (stored, queued) == (7, 7)
    assert len({operation_id(r) for r in results[1:]}) == 6


def test_the_group_function_takes_every_column_intake_writes() -> None:
    """Migration 0019's function lists the operation columns it writes; a column
    added to `operation_values` without a migration that replaces the function
    would be refused by the writer: this says so before it ships."""
    assert tuple(operation_values(intent("k"), system_clock())) == ACCEPT_GROUP_COLUMNS
