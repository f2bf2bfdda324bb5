"""Reaping: the bulky rows of operations past the record retention, removed in
bounded batches (decision 0018; the rule is domain/reaping.py).

One batch is one transaction: it picks up to `limit` reapable operations,
oldest change first — on PostgreSQL skipping any a concurrent writer holds,
so reaping never waits on (or blocks) a payment — clears their observations'
details, deletes their done outbox rows, replaces their request body with a
marker and stamps `reaped_at`. What stays is the ledger: the operation row,
attempts, decisions, transitions and the idempotency record.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import ColumnElement, and_, bindparam, delete, exists, select, text, update
from sqlalchemy.ext.asyncio import AsyncConnection

from intentledger.domain.states import FINAL
from intentledger.store.tables import REAPABLE_PREDICATE, observations, operations, outbox

_FINAL = [state.value for state in FINAL]


@dataclass(frozen=True)
class Reaped:
    operations: int = 0
    observation_details: int = 0
    outbox_rows: int = 0

    def __add__(self, other: Reaped) -> Reaped:
        return Reaped(
            self.operations + other.operations,
            self.observation_details + other.observation_details,
            self.outbox_rows + other.outbox_rows,
        )


def reapable(cutoff: datetime) -> ColumnElement[bool]:
    """domain/reaping.may_reap as SQL, over `operations`. The partial index's
    predicate comes first, verbatim: SQLite uses the index only when it sees it."""
    refund = operations.alias("refund")
    open_refund = exists(
        select(refund.c.operation_id).where(
            refund.c.parent_operation_id == operations.c.operation_id,
            refund.c.state.not_in(_FINAL),
        )
    )
    pending = exists(
        select(outbox.c.id).where(
            outbox.c.operation_id == operations.c.operation_id, outbox.c.done_at.is_(None)
        )
    )
    return and_(
        text(f"({REAPABLE_PREDICATE})"),
        operations.c.reaped_at.is_(None),
        operations.c.state.in_(_FINAL),
        operations.c.updated_at <= cutoff,
        operations.c.duplicate_detected.is_(False),
        operations.c.outcome_contradicted.is_(False),
        ~open_refund,
        ~pending,
    )


async def reap_batch(conn: AsyncConnection, now: datetime, cutoff: datetime, limit: int) -> Reaped:
    query = (
        select(operations.c.operation_id, operations.c.request_context)
        .where(reapable(cutoff))
        .order_by(operations.c.updated_at)
        .limit(limit)
    )
    if conn.dialect.name == "postgresql":
        query = query.with_for_update(skip_locked=True, of=operations)
    chosen = list(await conn.execute(query))
    if not chosen:
        return Reaped()
    ids = [row.operation_id for row in chosen]
    details = await conn.execute(
        update(observations)
        .where(observations.c.operation_id.in_(ids), observations.c.detail.is_not(None))
        .values(detail=None)
    )
    done = await conn.execute(
        delete(outbox).where(outbox.c.operation_id.in_(ids), outbox.c.done_at.is_not(None))
    )
    await conn.execute(
        update(operations)
        .where(operations.c.operation_id == bindparam("reaped_id"))
        .values(request_context=bindparam("context"), reaped_at=bindparam("at")),
        [
            {
                "reaped_id": row.operation_id,
                "context": {**row.request_context, "body": {}, "body_reaped_at": now.isoformat()},
                "at": now,
            }
            for row in chosen
        ],
    )
    return Reaped(len(chosen), details.rowcount, done.rowcount)
