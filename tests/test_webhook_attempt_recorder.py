"""Merchant webhook attempts are recorded as they end, grouped by when they end,
on both databases: attempts that end together share one transaction and two
statements; each moves its delivery on only if its worker still holds it; a
group whose transaction fails is recorded attempt by attempt, once each even
if its commit landed; each recorded attempt is reported exactly once."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import event, select
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.engine.webhook_sender import AttemptRecorder
from intentledger.store.tables import webhook_attempts, webhook_deliveries
from intentledger.store.webhooks import AttemptResult, Claimed, WebhookStore
from tests.test_merchant_webhooks_engine import add_endpoint, pending_deliveries
from tests.test_recovery_model import SECOND, ControlledClock

LEASE = timedelta(seconds=40)


async def claimed(engine: AsyncEngine, clock: ControlledClock, owner: str, n: int) -> list[Claimed]:
    async with engine.begin() as conn:
        return await WebhookStore(conn).claim_due(clock(), LEASE, owner, n, n)


async def leased(
    engine: AsyncEngine, n: int, owner: str = "w1"
) -> tuple[ControlledClock, list[Claimed]]:
    """`n` events of an endpoint of ana's, each delivery leased by `owner`."""
    clock = ControlledClock()
    endpoint_id = await add_endpoint(engine, clock, "ana", "http://127.0.0.1:9/x")
    await pending_deliveries(engine, clock, endpoint_id, n)
    return clock, await claimed(engine, clock, owner, n)


def reporting(engine: AsyncEngine, **options: Any) -> tuple[AttemptRecorder, list[int]]:
    """A recorder of w1's attempts, and the deliveries it reported, in order."""
    reported: list[int] = []
    recorder = AttemptRecorder(
        engine, "w1", lambda claimed, _: reported.append(claimed.delivery_id), **options
    )
    return recorder, reported


async def statuses(engine: AsyncEngine) -> dict[int, tuple[str, int, str | None]]:
    async with engine.connect() as conn:
        rows = await conn.execute(
            select(
                webhook_deliveries.c.id,
                webhook_deliveries.c.status,
                webhook_deliveries.c.attempts,
                webhook_deliveries.c.lease_owner,
            )
        )
        return {r.id: (r.status, r.attempts, r.lease_owner) for r in rows}


async def kept(engine: AsyncEngine) -> list[tuple[int, int | None, bool]]:
    async with engine.connect() as conn:
        rows = await conn.execute(
            select(
                webhook_attempts.c.delivery_id,
                webhook_attempts.c.http_status,
                webhook_attempts.c.delivered,
            ).order_by(webhook_attempts.c.delivery_id)
        )
        return [(r.delivery_id, r.http_status, r.delivered) for r in rows]


async def test_attempts_that_end_together_share_one_transaction(engine: AsyncEngine) -> None:
    clock, taken = await leased(engine, 5)
    delivered = AttemptResult(clock(), 4, 204, None, True, None)
    refused = AttemptResult(clock(), 9, 500, None, False, clock() + 10 * SECOND)
    given_up = AttemptResult(clock(), 7, None, "ConnectError: refused", False, None)
    results = [delivered, refused, given_up, delivered, delivered]
    statements: list[str] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        statements.append(statement.split()[0].upper())

    event.listen(engine.sync_engine, "before_cursor_execute", count)
    try:
        recorder, reported = reporting(engine, window=timedelta(milliseconds=50))
        await asyncio.gather(*(recorder.record(c, r) for c, r in zip(taken, results, strict=True)))
        assert sorted(reported) == sorted(c.delivery_id for c in taken)
    finally:
        event.remove(engine.sync_engine, "before_cursor_execute", count)

    # One insert of the attempts and one update of the deliveries (a ping and
    # SQLite's BEGIN are not statements of the recording).
    assert [s for s in statements if s in ("INSERT", "UPDATE")] == ["INSERT", "UPDATE"]
    by_id = await statuses(engine)
    expected = {"delivered": 3, "pending": 1, "failed": 1}
    assert sorted(status for status, _, _ in by_id.values()) == sorted(
        s for s, n in expected.items() for _ in range(n)
    )
    assert all(attempts == 1 and owner is None for _, attempts, owner in by_id.values())
    assert [(d, s, ok) for d, s, ok in await kept(engine)] == sorted(
        (c.delivery_id, r.http_status, r.delivered) for c, r in zip(taken, results, strict=True)
    )


async def test_an_attempt_whose_lease_passed_on_is_kept_but_moves_nothing(
    engine: AsyncEngine,
) -> None:
    clock, (first, second) = await leased(engine, 2, "slow-worker")
    clock.advance(LEASE + SECOND)
    [again] = await claimed(engine, clock, "w2", 1)
    assert again.delivery_id == first.delivery_id
    late = AttemptResult(clock(), 5, 204, None, True, None)
    recorder = AttemptRecorder(engine, "slow-worker")
    await asyncio.gather(recorder.record(first, late), recorder.record(second, late))
    by_id = await statuses(engine)
    # The first is w2's now: its attempt decides; the second was still held.
    assert by_id[first.delivery_id] == ("pending", 0, "w2")
    assert by_id[second.delivery_id] == ("delivered", 1, None)
    assert len(await kept(engine)) == 2


async def test_a_failed_group_records_each_attempt_alone(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock, taken = await leased(engine, 3)

    async def fails(*_: Any, **__: Any) -> None:
        raise RuntimeError("the group's transaction fails")

    monkeypatch.setattr(WebhookStore, "record_attempts", fails)
    done = AttemptResult(clock(), 4, 204, None, True, None)
    recorder, reported = reporting(engine, window=timedelta(milliseconds=50))
    await asyncio.gather(*(recorder.record(c, done) for c in taken))
    assert [status for status, _, _ in (await statuses(engine)).values()] == ["delivered"] * 3
    assert len(await kept(engine)) == 3
    assert sorted(reported) == sorted(c.delivery_id for c in taken)


async def test_a_group_whose_commit_landed_unheard_is_kept_once(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The group's transaction commits but its reply is lost: each attempt is
    recorded again alone, and must not be kept twice."""
    clock, taken = await leased(engine, 3)
    record_attempts = WebhookStore.record_attempts

    async def commits_unheard(store: WebhookStore, *args: Any, **kwargs: Any) -> None:
        await record_attempts(store, *args, **kwargs)
        await store.conn.commit()
        raise ConnectionError("the server's reply to COMMIT was lost")

    monkeypatch.setattr(WebhookStore, "record_attempts", commits_unheard)
    done = AttemptResult(clock(), 4, 204, None, True, None)
    recorder, reported = reporting(engine)
    await asyncio.gather(*(recorder.record(c, done) for c in taken))
    assert len(await kept(engine)) == 3
    assert [status for status, _, _ in (await statuses(engine)).values()] == ["delivered"] * 3
    assert sorted(reported) == sorted(c.delivery_id for c in taken)


async def test_a_group_that_fills_while_it_waits_commits_without_waiting_its_window(
    engine: AsyncEngine,
) -> None:
    clock, taken = await leased(engine, 4)
    done = AttemptResult(clock(), 4, 204, None, True, None)
    recorder = AttemptRecorder(engine, "w1", window=timedelta(seconds=60), group=2)
    for first, second in (taken[:2], taken[2:]):
        # The first waits for company; the second fills the group, which
        # commits at once rather than at the end of the minute.
        waiting = asyncio.ensure_future(recorder.record(first, done))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await asyncio.wait_for(asyncio.gather(waiting, recorder.record(second, done)), 20)
    await recorder.wait_idle()
    assert len(await kept(engine)) == 4


async def test_a_report_that_fails_costs_the_group_nothing(engine: AsyncEngine) -> None:
    clock, taken = await leased(engine, 3)

    def fails(claimed: Claimed, _: AttemptResult) -> None:
        raise RuntimeError("a metric could not be counted")

    recorder = AttemptRecorder(engine, "w1", fails, window=timedelta(milliseconds=50))
    done = AttemptResult(clock(), 4, 204, None, True, None)
    await asyncio.gather(*(recorder.record(c, done) for c in taken))
    assert [status for status, _, _ in (await statuses(engine)).values()] == ["delivered"] * 3


async def test_an_attempt_that_cannot_be_recorded_raises_to_its_delivery(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock, [taken] = await leased(engine, 1)

    async def fails(*_: Any, **__: Any) -> None:
        raise RuntimeError("the database is gone")

    monkeypatch.setattr(WebhookStore, "record_attempts", fails)
    monkeypatch.setattr(WebhookStore, "record_attempt", fails)
    recorder = AttemptRecorder(engine, "w1")
    with pytest.raises(RuntimeError, match="the database is gone"):
        await recorder.record(taken, AttemptResult(clock(), 4, 204, None, True, None))
    # Still leased: its lease runs out and it falls due again.
    assert (await statuses(engine))[taken.delivery_id] == ("pending", 0, "w1")
