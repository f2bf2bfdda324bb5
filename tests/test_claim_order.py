"""Work is taken in one order, whatever the disk holds.

A claim takes the earliest due outbox rows (or merchant webhook deliveries)
and, of equal due times, the first made; the sweeper takes the longest stale
SUBMITTING operations first. Rows made in one transaction share their due
time, and PostgreSQL hands out rows an ORDER BY leaves tied in the order their
versions lie on disk, which every update moves. So each test first rewrites
the earliest rows, putting their versions behind the others, and then asks
for the order on both databases.
"""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import Table, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.canonical import request_hash
from intentledger.domain.states import State
from intentledger.engine import intake
from intentledger.engine.intake import Intent
from intentledger.store.batches import BatchLedger
from intentledger.store.ledger import Ledger
from intentledger.store.tables import operations, outbox, webhook_deliveries
from intentledger.store.webhooks import WebhookStore
from tests.test_merchant_webhooks_engine import add_endpoint, pending_deliveries
from tests.test_recovery_model import ControlledClock

ROUTE = "POST /v1/payments"
NOW = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)
LEASE = timedelta(minutes=5)
MICROSECOND = timedelta(microseconds=1)


def at_noon() -> datetime:
    return NOW


async def accept_payments(engine: AsyncEngine, count: int) -> list[str]:
    """`count` payments made at one instant: their submit rows share a due time."""
    made = []
    for number in range(count):
        body = {"amount": 500, "currency": "EUR", "payment_method": "pm_ok", "metadata": {}}
        intent = Intent(
            "alice", ROUTE, f"order-{number}", request_hash("alice", ROUTE, body), body, "sandbox"
        )
        result = await intake.accept(engine, at_noon, intent)
        made.append(str(result.operation["operation_id"]))
    return made


async def outbox_ids(engine: AsyncEngine) -> list[int]:
    async with engine.connect() as conn:
        return list((await conn.execute(select(outbox.c.id).order_by(outbox.c.id))).scalars())


async def rewrite(engine: AsyncEngine, table: Table, ids: list[int], due_at: datetime) -> None:
    """New versions of these rows, their due time as it was. Each update changes
    the indexed due time (no HOT update), so on PostgreSQL the row's live
    version and its index entry move behind the rows not rewritten."""
    for row_id in ids:
        for moved in (due_at + MICROSECOND, due_at):
            async with engine.begin() as conn:
                await conn.execute(update(table).where(table.c.id == row_id).values(due_at=moved))


async def test_equal_due_times_are_claimed_in_the_order_the_rows_were_made(
    engine: AsyncEngine,
) -> None:
    await accept_payments(engine, 6)
    ids = await outbox_ids(engine)
    await rewrite(engine, outbox, ids[:3], NOW)

    claimed = []
    for _ in ids:
        async with engine.begin() as conn:
            row = await Ledger(conn).claim_outbox_row(NOW, LEASE, "one-by-one")
        assert row is not None
        claimed.append(row.id)
    assert claimed == ids


async def test_a_batch_claim_takes_the_first_made_of_equal_due_times(
    engine: AsyncEngine,
) -> None:
    await accept_payments(engine, 6)
    ids = await outbox_ids(engine)
    await rewrite(engine, outbox, ids[:3], NOW)

    async with engine.begin() as conn:
        first = await BatchLedger(conn).claim_outbox_rows(NOW, LEASE, "batch", 3)
    async with engine.begin() as conn:
        second = await BatchLedger(conn).claim_outbox_rows(NOW, LEASE, "batch", 3)
    assert [row.id for row in first] == ids[:3]
    assert [row.id for row in second] == ids[3:]


async def test_a_webhook_claim_takes_the_first_made_of_equal_due_times(
    engine: AsyncEngine,
) -> None:
    clock = ControlledClock()
    endpoint_id = await add_endpoint(engine, clock, "ana", "http://127.0.0.1:9/x")
    await pending_deliveries(engine, clock, endpoint_id, 6)
    async with engine.connect() as conn:
        query = select(webhook_deliveries.c.id).order_by(webhook_deliveries.c.id)
        ids = list((await conn.execute(query)).scalars())
    await rewrite(engine, webhook_deliveries, ids[:3], clock())

    taken = []
    for _ in range(2):
        async with engine.begin() as conn:
            claimed = await WebhookStore(conn).claim_due(clock(), LEASE, "sender", 3, 10)
        taken.append(sorted(c.delivery_id for c in claimed))
    assert taken == [ids[:3], ids[3:]]


async def test_the_sweeper_takes_the_longest_stale_first(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ids that fall as the payments are made: an order by id is then not the
    # order of the rows on disk, on either database.
    falling = itertools.count(99, -1)
    monkeypatch.setattr(intake, "new_operation_id", lambda: f"op_{next(falling):024x}")
    made = await accept_payments(engine, 5)
    # All SUBMITTING, each rewritten in the order made, so the last made (which
    # has waited longest) lies last; then two that waited alike (their ids
    # decide, against the order made), then the rest.
    since = {
        made[4]: NOW - timedelta(minutes=9),
        made[0]: NOW - timedelta(minutes=7),
        made[2]: NOW - timedelta(minutes=7),
        made[1]: NOW - timedelta(minutes=5),
        made[3]: NOW - timedelta(minutes=4),
    }
    for operation_id in made:
        async with engine.begin() as conn:
            await conn.execute(
                update(operations)
                .where(operations.c.operation_id == operation_id)
                .values(state=State.SUBMITTING, updated_at=since[operation_id])
            )
    async with engine.connect() as conn:
        stale = await Ledger(conn).stale_submitting(NOW - timedelta(minutes=3), 3)
    assert stale == [made[4], made[2], made[0]]
