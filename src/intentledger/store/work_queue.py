"""The operator console's reads: the work queue, and mandates and cards.

The queue reads through a partial index (migration 0012) that holds only the
operations a person may be asked about — those with `next_action: operator`,
the flagged ones and the unresolved ones — so a page costs the same on a
ledger of a million settled operations as on an empty one. The index's
predicate is written once (store/tables.py) and repeated verbatim in every query: SQLite
uses a partial index only when the query's WHERE carries its predicate term
for term.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, String, and_, bindparam, case, func, or_, select, text, tuple_
from sqlalchemy.ext.asyncio import AsyncConnection

from intentledger.domain.states import FINAL, NextAction, State
from intentledger.domain.watching import Watch
from intentledger.domain.work_queue import WAITING_STATES, Cursor, Need
from intentledger.store.records import (
    CardRecord,
    MandateRecord,
    MerchantEventRecord,
    OperationRecord,
    QueueRow,
)
from intentledger.store.tables import (
    WORK_QUEUE_PREDICATE,
    UTCDateTime,
    cards,
    mandates,
    merchant_events,
    operations,
)

QUEUE_COLUMNS = (
    operations.c.operation_id,
    operations.c.kind,
    operations.c.actor,
    operations.c.provider,
    operations.c.state,
    operations.c.next_action,
    operations.c.amount,
    operations.c.currency,
    operations.c.duplicate_detected,
    operations.c.outcome_contradicted,
    operations.c.created_at,
    operations.c.updated_at,
    operations.c.watch,
)


@dataclass(frozen=True)
class QueueFilter:
    """What the person asked to see; None shows every value."""

    state: State | None = None
    provider: str | None = None
    actor: str | None = None
    # Only operations at least this old.
    older_than: timedelta | None = None


@dataclass(frozen=True)
class QueuePage:
    rows: Sequence[QueueRow]
    # Where the next page starts; None on the last page.
    next_cursor: Cursor | None
    counts: dict[Need, int]
    total: int


def _in_queue(now: datetime, waiting_threshold: timedelta) -> ColumnElement[bool]:
    # Given the index predicate, a row lacking the first three reasons is a
    # waiting one: it is in the queue once it is old enough.
    return and_(
        text(f"({WORK_QUEUE_PREDICATE})"),
        or_(
            operations.c.next_action == NextAction.OPERATOR.value,
            operations.c.duplicate_detected.is_(True),
            operations.c.outcome_contradicted.is_(True),
            operations.c.created_at <= now - waiting_threshold,
        ),
    )


def _filtered(now: datetime, chosen: QueueFilter) -> list[ColumnElement[bool]]:
    conditions: list[ColumnElement[bool]] = []
    if chosen.state is not None:
        conditions.append(operations.c.state == chosen.state.value)
    if chosen.provider is not None:
        conditions.append(operations.c.provider == chosen.provider)
    if chosen.actor is not None:
        conditions.append(operations.c.actor == chosen.actor)
    if chosen.older_than is not None:
        conditions.append(operations.c.created_at <= now - chosen.older_than)
    return conditions


async def work_queue(
    conn: AsyncConnection,
    now: datetime,
    waiting_threshold: timedelta,
    chosen: QueueFilter,
    after: Cursor | None,
    page_size: int,
) -> QueuePage:
    """One page of the queue, oldest first, with the counts of the whole of it."""
    where = [_in_queue(now, waiting_threshold), *_filtered(now, chosen)]
    paged = list(where)
    if after is not None:
        # A row-value comparison: both databases seek the index to the position
        # (an OR of the two columns made SQLite scan from the start).
        paged.append(
            tuple_(operations.c.created_at, operations.c.operation_id)
            > tuple_(
                bindparam("after_created_at", after.created_at, type_=UTCDateTime()),
                bindparam("after_operation_id", after.operation_id, type_=String()),
            )
        )
    rows = [
        QueueRow.of(row)
        for row in await conn.execute(
            select(*QUEUE_COLUMNS)
            .where(*paged)
            .order_by(operations.c.created_at, operations.c.operation_id)
            .limit(page_size + 1)
        )
    ]
    next_cursor = None
    if len(rows) > page_size:
        rows = rows[:page_size]
        last = rows[-1]
        next_cursor = Cursor(last.created_at, last.operation_id)
    waiting = and_(
        operations.c.state.in_([state.value for state in WAITING_STATES]),
        operations.c.created_at <= now - waiting_threshold,
    )
    counted = (
        await conn.execute(
            select(
                func.count(),
                _sum(operations.c.next_action == NextAction.OPERATOR.value),
                _sum(operations.c.outcome_contradicted.is_(True)),
                _sum(operations.c.duplicate_detected.is_(True)),
                _sum(waiting),
                _sum(operations.c.watch == Watch.NOT_FINAL.value),
            ).where(*where)
        )
    ).one()
    total, operator, contradicted, duplicate, waited, not_final = (
        int(value or 0) for value in counted
    )
    counts = {
        Need.OPERATOR: operator,
        Need.CONTRADICTED: contradicted,
        Need.DUPLICATE: duplicate,
        Need.WAITING: waited,
        Need.PROVIDER_NOT_FINAL: not_final,
    }
    return QueuePage(rows, next_cursor, counts, total)


def _sum(condition: ColumnElement[bool]) -> ColumnElement[int]:
    return func.sum(case((condition, 1), else_=0))


async def queue_providers(conn: AsyncConnection) -> list[str]:
    """The providers the queue's operations went to (the filter's choices)."""
    rows = await conn.execute(
        select(operations.c.provider)
        .where(text(f"({WORK_QUEUE_PREDICATE})"))
        .distinct()
        .order_by(operations.c.provider)
    )
    return [row.provider for row in rows]


async def merchant_events_of(conn: AsyncConnection, object_id: str) -> list[MerchantEventRecord]:
    """The webhook events announced about one object (an operation, mandate, card)."""
    rows = await conn.execute(
        select(merchant_events)
        .where(merchant_events.c.object_id == object_id)
        .order_by(merchant_events.c.created_at, merchant_events.c.event_id)
    )
    return [MerchantEventRecord.of(row) for row in rows]


async def open_operations_of_mandate(
    conn: AsyncConnection, mandate_id: str, limit: int
) -> list[QueueRow]:
    """The mandate's operations without a final state, newest first: what its
    reservation is made of."""
    rows = await conn.execute(
        select(*QUEUE_COLUMNS)
        .where(
            operations.c.mandate_id == mandate_id,
            operations.c.state.not_in([state.value for state in FINAL]),
        )
        .order_by(operations.c.created_at.desc())
        .limit(limit)
    )
    return [QueueRow.of(row) for row in rows]


async def list_mandates(
    conn: AsyncConnection, status: str | None, actor: str | None, after: str | None, limit: int
) -> list[MandateRecord]:
    query = select(mandates).order_by(mandates.c.mandate_id).limit(limit)
    if status is not None:
        query = query.where(mandates.c.status == status)
    if actor is not None:
        query = query.where(mandates.c.actor == actor)
    if after is not None:
        query = query.where(mandates.c.mandate_id > after)
    return [MandateRecord.of(row) for row in await conn.execute(query)]


async def list_cards(
    conn: AsyncConnection,
    indeterminate: bool | None,
    actor: str | None,
    after: str | None,
    limit: int,
) -> list[CardRecord]:
    query = select(cards).order_by(cards.c.card_id).limit(limit)
    if indeterminate is not None:
        query = query.where(cards.c.indeterminate.is_(indeterminate))
    if actor is not None:
        query = query.where(cards.c.actor == actor)
    if after is not None:
        query = query.where(cards.c.card_id > after)
    return [CardRecord.of(row) for row in await conn.execute(query)]


async def recent_operations(
    conn: AsyncConnection, state: State | None, limit: int
) -> list[OperationRecord]:
    """Operations of every actor, newest first, optionally of one state."""
    query = select(operations).order_by(operations.c.created_at.desc()).limit(limit)
    if state is not None:
        query = query.where(operations.c.state == state)
    return [OperationRecord.of(row) for row in await conn.execute(query)]
