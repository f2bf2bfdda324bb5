"""Reaping: the bulky rows of operations past the record retention, removed in
bounded batches (decision 0018; the rule is domain/reaping.py).

One batch is one transaction: it picks up to `limit` reapable operations,
oldest change first — on PostgreSQL skipping any a concurrent writer holds,
so reaping never waits on (or blocks) a payment — deletes their done outbox
rows, replaces their request body with a marker and stamps `reaped_at` and
the last of their observations (`reaped_through_observation`); on
SQLite it also deletes their observations' provider answers, which on
PostgreSQL go later, with their month's partition (store/partitions.py). What
stays is the ledger: the operation row, attempts, observations, decisions,
transitions and the idempotency record. The outbox is not partitioned: its rows
are updated (leased, done) while they live, and a row is done when its work is,
not when its month ends.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import (
    ColumnElement,
    and_,
    bindparam,
    delete,
    exists,
    func,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.ext.asyncio import AsyncConnection

from intentledger.domain.states import FINAL
from intentledger.store.tables import (
    REAPABLE_PREDICATE,
    observation_details,
    observations,
    operations,
    outbox,
)

_FINAL = [state.value for state in FINAL]


class Candidate(NamedTuple):
    """An operation chosen for reaping, with the request body it loses."""

    operation_id: str
    request_context: Any


@dataclass(frozen=True)
class Reaped:
    operations: int = 0
    # Provider answers deleted row by row (SQLite).
    observation_details: int = 0
    outbox_rows: int = 0
    # PostgreSQL: partitions of answers dropped, and answers moved out of
    # them first because they must outlive them (store/partitions.py).
    detail_partitions: int = 0
    details_moved_out: int = 0

    def __add__(self, other: Reaped) -> Reaped:
        return Reaped(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(Reaped)))


def _pending_outbox(operation: Any) -> ColumnElement[bool]:
    return exists(
        select(outbox.c.id).where(
            outbox.c.operation_id == operation.c.operation_id, outbox.c.done_at.is_(None)
        )
    )


def reapable(cutoff: datetime) -> ColumnElement[bool]:
    """domain/reaping.may_reap as SQL, over `operations`. The partial index's
    predicate comes first, verbatim, as SQLite needs to see it."""
    refund = operations.alias("refund")
    parent = operations.alias("parent")
    # A refund is open while it is not final, while it still has outbox work
    # (a person's "failed" the audit has not yet checked holds its money), or
    # while it is flagged (a person must look at it, and at its payment).
    open_refund = exists(
        select(refund.c.operation_id).where(
            refund.c.parent_operation_id == operations.c.operation_id,
            or_(
                refund.c.state.not_in(_FINAL),
                _pending_outbox(refund),
                refund.c.duplicate_detected.is_(True),
                refund.c.outcome_contradicted.is_(True),
            ),
        )
    )
    flagged_parent = exists(
        select(parent.c.operation_id).where(
            parent.c.operation_id == operations.c.parent_operation_id,
            or_(parent.c.duplicate_detected.is_(True), parent.c.outcome_contradicted.is_(True)),
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
        ~flagged_parent,
        ~_pending_outbox(operations),
    )


async def reap_batch(conn: AsyncConnection, now: datetime, cutoff: datetime, limit: int) -> Reaped:
    chosen = await lock_candidates(conn, cutoff, limit)
    if chosen:
        # On PostgreSQL the candidates were judged on the statement's snapshot
        # but locked afterwards: a writer that committed in between without
        # changing the operation's row (a refund accepted under the payment's
        # lock, an audit look enqueued) would be missed. Judged again now, on a
        # fresh snapshot (READ COMMITTED), while holding the locks every such
        # writer needs. (SQLite's one writer at a time leaves no "in between";
        # the one statement more is asked there too, so one rule holds both.)
        still = await still_reapable(conn, [row.operation_id for row in chosen], cutoff)
        chosen = [row for row in chosen if row.operation_id in still]
    if not chosen:
        return Reaped()
    return await _reap(conn, chosen, now)


async def lock_candidates(conn: AsyncConnection, cutoff: datetime, limit: int) -> list[Candidate]:
    query = (
        select(operations.c.operation_id, operations.c.request_context)
        .where(reapable(cutoff))
        .order_by(operations.c.updated_at)
        .limit(limit)
    )
    if conn.dialect.name == "postgresql":
        # Skipping what a writer holds: reaping never waits on (or blocks) a payment.
        query = query.with_for_update(skip_locked=True, of=operations)
    else:
        # Without statistics SQLite picks the (state, updated_at) index and sorts
        # every settled operation, the reaped ones too, at every batch.
        query = query.with_hint(operations, "INDEXED BY ix_operations_reapable", "sqlite")
    return [Candidate(*row) for row in await conn.execute(query)]


async def still_reapable(conn: AsyncConnection, ids: list[str], cutoff: datetime) -> set[str]:
    rows = await conn.execute(
        select(operations.c.operation_id).where(
            operations.c.operation_id.in_(ids), reapable(cutoff)
        )
    )
    return {row.operation_id for row in rows}


async def _reap(conn: AsyncConnection, chosen: list[Candidate], now: datetime) -> Reaped:
    ids = [row.operation_id for row in chosen]
    details = 0
    if conn.dialect.name != "postgresql":
        # PostgreSQL drops them with their month (store/partitions.py).
        deleted = await conn.execute(
            delete(observation_details).where(
                observation_details.c.observation_id.in_(
                    select(observations.c.id).where(observations.c.operation_id.in_(ids))
                )
            )
        )
        details = deleted.rowcount
    done = await conn.execute(
        delete(outbox).where(outbox.c.operation_id.in_(ids), outbox.c.done_at.is_not(None))
    )
    # Read under the operations' locks, which every writer of an answer takes:
    # an answer written after this transaction has a higher id, and outlives
    # its partition (domain/reaping.outlives_its_partition).
    last_observation = {
        operation_id: last
        for operation_id, last in await conn.execute(
            select(observations.c.operation_id, func.max(observations.c.id))
            .where(observations.c.operation_id.in_(ids))
            .group_by(observations.c.operation_id)
        )
    }
    await conn.execute(
        update(operations)
        .where(operations.c.operation_id == bindparam("reaped_id"))
        .values(
            request_context=bindparam("context"),
            reaped_at=bindparam("at"),
            reaped_through_observation=bindparam("through"),
        ),
        [
            {
                "reaped_id": row.operation_id,
                "context": {**row.request_context, "body": {}, "body_reaped_at": now.isoformat()},
                "at": now,
                "through": last_observation.get(row.operation_id, 0),
            }
            for row in chosen
        ],
    )
    return Reaped(len(chosen), details, done.rowcount)
