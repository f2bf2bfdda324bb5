"""Group commit: concurrent intents share a transaction, and each gets exactly
what `accept()` alone would have given it, on both databases."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy import event, select
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.canonical import request_hash
from intentledger.engine.clock import system_clock
from intentledger.engine.group_intake import IntakeGroups
from intentledger.engine.intake import IntakeResult, Intent, accept
from intentledger.engine.refusal import IdempotencyKeyReused
from intentledger.store.tables import idempotency_records, operations, outbox, transitions

ROUTE = "POST /v1/payments"


def intent(key: str, amount: int = 1250, actor: str = "alice") -> Intent:
    body = {"amount": amount, "currency": "EUR", "payment_method": "pm_ok", "metadata": {}}
    return Intent(actor, ROUTE, key, request_hash(actor, ROUTE, body), body, "sandbox")


def count_commits(engine: AsyncEngine) -> list[int]:
    commits: list[int] = []
    event.listen(engine.sync_engine, "commit", lambda _conn: commits.append(1))
    return commits


def operation_id(result: IntakeResult | BaseException) -> str:
    assert isinstance(result, IntakeResult), result
    operation: Any = result.operation
    return str(operation["operation_id"] if isinstance(operation, dict) else operation.operation_id)


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
    engine: AsyncEngine,
) -> None:
    alone = operation_id(await accept(engine, system_clock, intent("alone")))
    commits = count_commits(engine)
    groups = IntakeGroups(engine, system_clock)
    results = await asyncio.gather(*(groups.accept(intent(f"k{n}")) for n in range(100)))
    assert len(commits) == 2  # 100 intents, groups of at most 64
    ids = {operation_id(r) for r in results}
    assert len(ids) == 100 and not any(r.replayed for r in results)
    reference = await rows_of(engine, alone)
    assert reference["instants"] == [(1,)]  # all written at one `now`
    for op_id in ids:
        assert await rows_of(engine, op_id) == reference


async def test_a_group_answers_retries_conflicts_and_repeated_keys(engine: AsyncEngine) -> None:
    groups = IntakeGroups(engine, system_clock)
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
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    groups = IntakeGroups(engine, system_clock)
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
    engine: AsyncEngine,
) -> None:
    groups = IntakeGroups(engine, system_clock)
    gone = asyncio.create_task(groups.accept(intent("gone")))
    kept = asyncio.create_task(groups.accept(intent("kept")))
    await asyncio.sleep(0)  # both queued
    gone.cancel()
    assert not (await kept).replayed
    with pytest.raises(asyncio.CancelledError):
        await gone
    # The intent was made durable all the same; a retry finds it.
    assert (await groups.accept(intent("gone"))).replayed
