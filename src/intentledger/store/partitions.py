"""The month partitions of the provider answers on PostgreSQL (decision 0018).

`observation_details` is range-partitioned by `retention_bucket`, one
partition per UTC month plus a DEFAULT one, so an insert never fails for want
of a partition. Retention then drops a month whole instead of deleting its
rows one by one (no bloat, no vacuum debt); SQLite keeps bounded deletes
(store/reaping.py).

- `ensure_partitions` keeps the current month and the next MONTHS_AHEAD ready,
  and gives any month the default partition caught (an answer stamped outside
  every partition: a clock far off, a month not made in time) a partition of
  its own, moving its rows there, so the default stays near empty. `migrate`
  and every reap pass call it.
- `retire_expired` drops each month whose end is at or before the retention
  cutoff. First it moves out, to the current month, every answer that must
  outlive the month (domain/reaping.outlives_its_month: its operation not
  reaped, or the answer newer than the reap), in bounded batches; then it
  detaches and drops the partition in one short transaction.

The drop relies only on `operations.reaped_at`, which reaping sets under the
operation's lock after judging it again on a fresh snapshot
(store/reaping.reap_batch) and never clears. So nothing a concurrent writer
does between the move-out and the drop — a refund accepted, a flag raised,
late evidence — can make an answer the drop takes needed again: a reaped
operation's answers were given up when it was reaped (as SQLite deletes them
then), and late evidence is stamped with the current time, in the current
month. An answer written with an instant in a month being dropped (a clock
more than the retention behind) could be lost with it; nothing writes one.

Attaching a partition locks the parent table only against other schema
changes, and the default partition exclusively; detaching and dropping lock
the parent exclusively. Each such transaction is short, waits at most
LOCK_TIMEOUT for its locks (a payment's statements queue behind a waiting
lock, so retention must never wait long) and, if it cannot have them, gives
up until the next pass. Processes take turns through an advisory lock.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import Connection, and_, or_, select, text, update
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.months import add_months, month_start, months_from
from intentledger.store.tables import observation_details, observations, operations

log = logging.getLogger(__name__)

PARENT = observation_details.name
DEFAULT_PARTITION = f"{PARENT}_default"
# The current month and this many after it always have their partition.
MONTHS_AHEAD = 3
# How long a partition change waits for its locks before trying next pass.
LOCK_TIMEOUT = "500ms"
# pg_try_advisory_xact_lock's key for partition changes: one process at a time.
MAINTENANCE_LOCK = 0x18_0B5E_DE7A
# lock_not_available (lock_timeout), deadlock_detected: try again next pass.
_BUSY = {"55P03", "40P01"}
_PARTITION_NAME = re.compile(rf"{PARENT}_(\d{{4}}_\d{{2}}|default)")


@dataclass(frozen=True)
class Partition:
    name: str
    # The month's range; both None for the default partition.
    lower: datetime | None
    upper: datetime | None


@dataclass(frozen=True)
class Retired:
    partitions_dropped: int = 0
    details_moved_out: int = 0


def is_partition_name(name: str | None) -> bool:
    """A partition's name: Alembic compares the declared tables only."""
    return name is not None and _PARTITION_NAME.fullmatch(name) is not None


def month_partition_name(month: datetime) -> str:
    return f"{PARENT}_{month:%Y_%m}"


def partitioned(conn: Connection) -> bool:
    """Whether the answers are partitioned here (PostgreSQL, from migration 0014)."""
    if conn.dialect.name != "postgresql":
        return False
    return bool(
        conn.execute(
            text(
                "SELECT EXISTS (SELECT FROM pg_partitioned_table "
                "WHERE partrelid = to_regclass(:parent))"
            ),
            {"parent": PARENT},
        ).scalar_one()
    )


def list_partitions(conn: Connection) -> list[Partition]:
    """The partitions, oldest month first, the default last."""
    # The bounds as PostgreSQL prints them, read back by PostgreSQL itself so
    # that the session's DateStyle and TimeZone cannot garble them.
    rows = conn.execute(
        text(
            r"""
            SELECT c.relname AS name,
                   substring(pg_get_expr(c.relpartbound, c.oid) FROM 'FROM \(''([^'']+)''\)')
                       ::timestamptz AS lower,
                   substring(pg_get_expr(c.relpartbound, c.oid) FROM 'TO \(''([^'']+)''\)')
                       ::timestamptz AS upper
            FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid
            WHERE i.inhparent = to_regclass(:parent)
            ORDER BY lower NULLS LAST, name
            """
        ),
        {"parent": PARENT},
    )
    return [Partition(row.name, _utc(row.lower), _utc(row.upper)) for row in rows]


def ensure_partitions(conn: Connection, now: datetime, ahead: int = MONTHS_AHEAD) -> list[str]:
    """Create the partitions of the month of `now` and the `ahead` after it,
    and of every month the default partition holds rows of (moving those rows
    in); the names created. Nothing if another process is at it."""
    if not partitioned(conn) or not _take_turn(conn):
        return []
    have = {p.lower for p in list_partitions(conn) if p.lower is not None}
    caught = conn.execute(
        text(
            f"SELECT DISTINCT date_trunc('month', retention_bucket, 'UTC') FROM {DEFAULT_PARTITION}"
        )
    ).scalars()
    wanted = set(months_from(now, ahead)) | {month_start(at) for at in caught}
    created = []
    for month in sorted(wanted - have):
        _create_month(conn, month)
        created.append(month_partition_name(month))
    return created


def _create_month(conn: Connection, month: datetime) -> None:
    # Made apart and attached, rather than CREATE ... PARTITION OF: attaching
    # locks the parent only against other schema changes, so payments go on
    # writing answers meanwhile; and the default partition's rows of the month
    # must move in before it can have a partition.
    name = month_partition_name(month)
    lower, upper = month, add_months(month, 1)
    conn.execute(text(f"CREATE TABLE {name} (LIKE {PARENT} INCLUDING DEFAULTS)"))
    # First, so that no answer of the month can reach the default partition
    # between the move and the attach (which would then refuse).
    conn.execute(text(f"LOCK TABLE {DEFAULT_PARTITION} IN ACCESS EXCLUSIVE MODE"))
    columns = ", ".join(observation_details.c.keys())
    conn.execute(
        text(
            f"WITH moved AS (DELETE FROM {DEFAULT_PARTITION} "
            "WHERE retention_bucket >= :lower AND retention_bucket < :upper "
            f"RETURNING {columns}) INSERT INTO {name} ({columns}) SELECT {columns} FROM moved"
        ),
        {"lower": lower, "upper": upper},
    )
    conn.execute(
        text(
            f"ALTER TABLE {PARENT} ATTACH PARTITION {name} "
            f"FOR VALUES FROM ('{lower.isoformat()}') TO ('{upper.isoformat()}')"
        )
    )


def move_out_batch(
    conn: Connection, partition: Partition, now: datetime, after: int, limit: int
) -> list[int]:
    """Move up to `limit` answers that must outlive `partition` (ids above
    `after`, in id order) to the month of `now`; their observation ids."""
    assert partition.lower is not None and partition.upper is not None
    details = observation_details.c
    in_month = and_(
        details.retention_bucket >= partition.lower, details.retention_bucket < partition.upper
    )
    # domain/reaping.outlives_its_month, as SQL.
    outlives = or_(operations.c.reaped_at.is_(None), observations.c.at > operations.c.reaped_at)
    kept = list(
        conn.execute(
            select(details.observation_id)
            .select_from(
                observation_details.join(
                    observations, observations.c.id == details.observation_id
                ).join(operations, operations.c.operation_id == observations.c.operation_id)
            )
            .where(in_month, details.observation_id > after, outlives)
            .order_by(details.observation_id)
            .limit(limit)
        ).scalars()
    )
    if kept:
        # Through the parent, so PostgreSQL moves each row to its new month.
        conn.execute(
            update(observation_details)
            .where(in_month, details.observation_id.in_(kept))
            .values(retention_bucket=now)
        )
    return kept


def detach_and_drop(conn: Connection, partition: Partition) -> bool:
    """Detach and drop `partition` if it is still attached as it was listed;
    whether it was dropped."""
    if not _take_turn(conn):
        return False
    if partition not in list_partitions(conn):
        return False
    conn.execute(text(f"ALTER TABLE {PARENT} DETACH PARTITION {partition.name}"))
    conn.execute(text(f"DROP TABLE {partition.name}"))
    return True


async def ensure_ahead(engine: AsyncEngine, now: datetime) -> list[str]:
    """ensure_partitions in its own transaction; nothing if the locks are busy."""
    try:
        async with engine.begin() as conn:
            return await conn.run_sync(ensure_partitions, now)
    except DBAPIError as exc:
        if not busy(exc):
            raise
        log.warning(
            "partitions of observation details not made: locks busy; next pass",
            extra={"event": "partition_busy"},
        )
        return []


async def retire_expired(
    engine: AsyncEngine, now: datetime, cutoff: datetime, batch: int
) -> Retired:
    """Drop every month partition that ended at or before `cutoff`, once what
    must outlive it is moved out. A partition whose locks are busy stays for
    the next pass (its moved-out rows stay moved)."""
    async with engine.connect() as conn:
        expired = [
            p
            for p in await conn.run_sync(list_partitions)
            if p.upper is not None and p.upper <= cutoff
        ]
    dropped = moved = 0
    for partition in expired:
        after = 0
        while True:
            async with engine.begin() as conn:
                kept = await conn.run_sync(move_out_batch, partition, now, after, batch)
            moved += len(kept)
            if len(kept) < batch:
                break
            after = kept[-1]
        try:
            async with engine.begin() as conn:
                dropped += await conn.run_sync(detach_and_drop, partition)
        except DBAPIError as exc:
            if not busy(exc):
                raise
            log.warning(
                "partition %s not dropped: locks busy; next pass",
                partition.name,
                extra={"event": "partition_busy", "partition": partition.name},
            )
    return Retired(dropped, moved)


def busy(exc: DBAPIError) -> bool:
    return getattr(exc.orig, "sqlstate", None) in _BUSY


def _take_turn(conn: Connection) -> bool:
    conn.execute(text(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'"))
    return bool(
        conn.execute(
            text("SELECT pg_try_advisory_xact_lock(:key)"), {"key": MAINTENANCE_LOCK}
        ).scalar_one()
    )


def _utc(at: datetime | None) -> datetime | None:
    return None if at is None else at.astimezone(UTC)
