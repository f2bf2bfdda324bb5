"""The reads behind the ledger's gauges (observability/ledger_gauges.py): each
bounded by what needs attention, through an index, never by the ledger's size."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select, text
from sqlalchemy.ext.asyncio import AsyncConnection

from intentledger.store.tables import (
    OPERATOR_DECISION,
    decisions,
    operations,
    outbox,
    webhook_deliveries,
)

# The partial index's predicate, written the same way so SQLite's planner uses it.
FLAGGED = text("outcome_contradicted OR duplicate_detected")
# An aggregate over SQLite's text timestamps comes back as text.
Instant = datetime | str | None


async def unresolved_counts(
    conn: AsyncConnection, unresolved: Collection[str]
) -> list[tuple[str, str, int, Instant]]:
    """(state, kind, count, oldest created_at) of operations in the given states."""
    rows = await conn.execute(
        select(
            operations.c.state,
            operations.c.kind,
            func.count(),
            func.min(operations.c.created_at),
        )
        .where(operations.c.state.in_(unresolved))
        .group_by(operations.c.state, operations.c.kind)
    )
    return [(state, kind, int(count), oldest) for state, kind, count, oldest in rows]


async def flag_counts(conn: AsyncConnection) -> dict[str, int]:
    flags = (
        await conn.execute(
            select(
                func.count().filter(operations.c.outcome_contradicted),
                func.count().filter(operations.c.duplicate_detected),
            ).where(FLAGGED)
        )
    ).one()
    return {"outcome_contradicted": int(flags[0]), "duplicate_detected": int(flags[1])}


async def oldest_due_outbox(conn: AsyncConnection, now: datetime) -> Instant:
    """When the oldest due, unfinished outbox row fell due (None when none is)."""
    result = await conn.execute(
        select(func.min(outbox.c.due_at)).where(outbox.c.done_at.is_(None), outbox.c.due_at <= now)
    )
    return result.scalar_one()  # type: ignore[no-any-return]


async def oldest_due_delivery(conn: AsyncConnection, now: datetime) -> Instant:
    """When the oldest due, pending merchant webhook delivery fell due."""
    result = await conn.execute(
        select(func.min(webhook_deliveries.c.due_at)).where(
            webhook_deliveries.c.status == "pending", webhook_deliveries.c.due_at <= now
        )
    )
    return result.scalar_one()  # type: ignore[no-any-return]


async def operator_action_counts(conn: AsyncConnection) -> dict[str, int]:
    """rule -> operator decisions ever recorded under it."""
    actions = await conn.execute(
        select(decisions.c.rule, func.count())
        .where(text(OPERATOR_DECISION))
        # What a person's action leads to later (a duplicate's refund
        # settling, recorded under their name) is not another action.
        .where(decisions.c.rule.startswith("operator_", autoescape=True))
        .group_by(decisions.c.rule)
    )
    return {rule: int(count) for rule, count in actions}


@dataclass(frozen=True)
class DatabaseServer:
    """The PostgreSQL server a connection reached, as a ledger's operator needs
    it: when it started (another value after a restart, or after a failover
    to another node), whether this session's commits wait for a standby, and
    how many standbys are synchronous now (None when this role may not read
    pg_stat_replication's sync_state: it needs pg_monitor's privileges)."""

    started_at: datetime
    commits_wait_for_standby: bool
    synchronous_standbys: int | None


_DATABASE_SERVER = text(
    """
    SELECT pg_postmaster_start_time(),
           current_setting('synchronous_standby_names') <> ''
             AND current_setting('synchronous_commit') IN ('on', 'remote_write', 'remote_apply'),
           (SELECT count(*) FILTER (WHERE sync_state IN ('sync', 'quorum'))
              FROM pg_stat_replication),
           (SELECT count(*) FILTER (WHERE sync_state IS NULL) FROM pg_stat_replication)
    """
)


async def database_server(conn: AsyncConnection) -> DatabaseServer | None:
    """The server behind `conn`, on PostgreSQL; None on SQLite (one file, no
    standby to wait for)."""
    if conn.dialect.name != "postgresql":
        return None
    started_at, waits, synchronous, unreadable = (await conn.execute(_DATABASE_SERVER)).one()
    return DatabaseServer(started_at, bool(waits), None if unreadable else int(synchronous))
