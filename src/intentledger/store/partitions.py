"""The partitions of the provider answers on PostgreSQL (decision 0018).

`observation_details` is range-partitioned by `retention_bucket`, in
partitions as wide as the record retention calls for (a month, a day, an hour
or a minute: domain/widths.py) plus a DEFAULT one, so an insert never fails
for want of a partition. Retention then drops a partition whole instead of
deleting its rows one by one (no bloat, no vacuum debt); SQLite keeps bounded
deletes (store/reaping.py).

- `ensure_partitions` keeps the width's current cell of time and the next
  AHEAD ready, and gives any cell the default partition caught (an answer
  stamped outside every partition: a clock far off, a pass late) a partition
  of its own, moving its rows there, so the default stays near empty. Where
  partitions of another width (a retention since changed) cover part of that
  time, the new ones fit around them. `migrate` and every reap pass call it.
- `retire_expired` drops each partition whose upper bound is at or before the
  retention cutoff, whatever its width. First it moves out, to the current
  partition, every answer that must outlive it
  (domain/reaping.outlives_its_partition: its operation not reaped, or the
  answer written after the reap), in bounded batches; then, in one short
  transaction, it locks the partition against writes, moves out what must
  outlive it that arrived since (an answer stamped a retention behind by a
  stalled writer), and detaches and drops it.

The drop relies only on `operations.reaped_through_observation` (the last
answer the reap gave up), which reaping sets under the operation's lock after
judging it again on a fresh snapshot
(store/reaping.reap_batch) and never clears. So nothing a concurrent writer
does between the move-out and the drop — a refund accepted, a flag raised,
late evidence — can make an answer the drop takes needed again: a reaped
operation's answers were given up when it was reaped (as SQLite deletes them
then), and an answer of an operation not reaped is moved out, by the batches
or by the drop's own last look.

Attaching a partition locks the parent table only against other schema
changes, and the default partition exclusively; detaching and dropping lock
the parent exclusively. Each such transaction is short, waits at most
LOCK_TIMEOUT for its locks (`SET LOCAL`: a payment's statements queue behind
a waiting lock, so retention must never wait long) and, if it cannot have
them, gives up until the next pass. Processes take turns through a
transaction-scoped advisory lock, taken by every transaction that makes,
moves out of or drops a partition: no session state, so it holds behind a
transaction-mode pooler.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import Connection, and_, or_, select, text, update
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.widths import SPAN_NAME_PATTERN, Width, floor, span_name, step, width_for
from intentledger.store.tables import observation_details, observations, operations

log = logging.getLogger(__name__)

PARENT = observation_details.name
DEFAULT_PARTITION = f"{PARENT}_default"
# The current width's cell of time and this many after it always have their
# partition (a retention's partitions are at most a quarter of it wide,
# domain/widths.py).
AHEAD = 3
# How long a partition change waits for its locks before trying next pass.
LOCK_TIMEOUT = "500ms"
# pg_try_advisory_xact_lock's key for partition changes: one process at a time.
MAINTENANCE_LOCK = 0x18_0B5E_DE7A
# lock_not_available (lock_timeout), deadlock_detected: try again next pass.
_BUSY = {"55P03", "40P01"}
_PARTITION_NAME = re.compile(rf"{PARENT}_({SPAN_NAME_PATTERN}|default)")


@dataclass(frozen=True)
class Partition:
    name: str
    # Its range [lower, upper); both None for the default partition.
    lower: datetime | None
    upper: datetime | None


@dataclass(frozen=True)
class Retired:
    partitions_dropped: int = 0
    details_moved_out: int = 0


def is_partition_name(name: str | None) -> bool:
    """A partition's name: Alembic compares the declared tables only."""
    return name is not None and _PARTITION_NAME.fullmatch(name) is not None


def partition_name(lower: datetime) -> str:
    return f"{PARENT}_{span_name(lower)}"


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
    """The partitions, oldest first, the default last."""
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


def ensure_partitions(
    conn: Connection, now: datetime, retention: timedelta | None = None, ahead: int = AHEAD
) -> list[str]:
    """Create the partitions of the width `retention` calls for
    (domain/widths.py; a month when none is given) that cover the width's cell
    of `now` and the `ahead` after it, and every cell the default partition
    holds rows of (moving those rows in); the names created, oldest first.
    Where a partition of another width already covers part of that time the
    new ones fit around it. Nothing if another process is at it."""
    if not partitioned(conn) or not _take_turn(conn):
        return []
    width = Width.MONTH if retention is None else width_for(retention)
    spans = [(p.lower, p.upper) for p in list_partitions(conn) if p.lower and p.upper]
    caught = conn.execute(
        text(
            f"SELECT DISTINCT date_trunc(:unit, retention_bucket, 'UTC') FROM {DEFAULT_PARTITION}"
        ),
        {"unit": width.value},
    ).scalars()
    wanted = [(floor(now, width), step(floor(now, width), width, ahead + 1))]
    wanted += [(floor(at, width), step(floor(at, width), width)) for at in caught]
    made: list[tuple[datetime, datetime]] = []
    for start, end in wanted:
        made += _fill(spans, start, end, width)
    created = []
    for lower, upper in sorted(made):
        _create(conn, lower, upper)
        created.append(partition_name(lower))
    return created


def _fill(
    spans: list[tuple[datetime, datetime]], start: datetime, end: datetime, width: Width
) -> list[tuple[datetime, datetime]]:
    """The ranges of `width`'s grid that cover [start, end) where no span in
    `spans` does, cut short where one begins; added to `spans`."""
    made = []
    at = start
    while at < end:
        covering = [upper for lower, upper in spans if lower <= at < upper]
        if covering:
            at = covering[0]
            continue
        upper = min([step(floor(at, width), width)] + [lower for lower, _ in spans if lower > at])
        spans.append((at, upper))
        made.append((at, upper))
        at = upper
    return made


def _create(conn: Connection, lower: datetime, upper: datetime) -> None:
    # Made apart and attached, rather than CREATE ... PARTITION OF: attaching
    # locks the parent only against other schema changes, so payments go on
    # writing answers meanwhile; and the default partition's rows of the range
    # must move in before it can have a partition.
    name = partition_name(lower)
    conn.execute(text(f"CREATE TABLE {name} (LIKE {PARENT} INCLUDING DEFAULTS)"))
    # First, so that no answer of the range can reach the default partition
    # between the move and the attach (which would then refuse).
    conn.execute(text(f"LOCK TABLE {DEFAULT_PARTITION} IN ACCESS EXCLUSIVE MODE"))
    # The parent's columns as the database has them: `migrate` makes partitions
    # at any revision it is asked for, whose columns may not be tables.py's.
    columns = ", ".join(
        conn.execute(
            text(
                "SELECT attname FROM pg_attribute WHERE attrelid = to_regclass(:parent) "
                "AND attnum > 0 AND NOT attisdropped ORDER BY attnum"
            ),
            {"parent": PARENT},
        ).scalars()
    )
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
    conn: Connection, partition: Partition, now: datetime, after: int, limit: int | None
) -> list[int] | None:
    """Move up to `limit` answers (all, if None) that must outlive `partition`
    (ids above `after`, in id order) to the partition of `now`; their
    observation ids. None if another process has the turn: two move-outs of
    one partition at once would make one of them fail (a row it waited for
    moved to another partition under it)."""
    if not _take_turn(conn):
        return None
    return _move_out(conn, partition, now, after, limit)


def _move_out(
    conn: Connection, partition: Partition, now: datetime, after: int, limit: int | None
) -> list[int]:
    assert partition.lower is not None and partition.upper is not None
    details = observation_details.c
    in_range = and_(
        details.retention_bucket >= partition.lower, details.retention_bucket < partition.upper
    )
    # domain/reaping.outlives_its_partition, as SQL.
    through = operations.c.reaped_through_observation
    outlives = or_(through.is_(None), observations.c.id > through)
    kept = list(
        conn.execute(
            select(details.observation_id)
            .select_from(
                observation_details.join(
                    observations, observations.c.id == details.observation_id
                ).join(operations, operations.c.operation_id == observations.c.operation_id)
            )
            .where(in_range, details.observation_id > after, outlives)
            .order_by(details.observation_id)
            .limit(limit)
        ).scalars()
    )
    if kept:
        # Through the parent, so PostgreSQL moves each row to its new partition.
        conn.execute(
            update(observation_details)
            .where(in_range, details.observation_id.in_(kept))
            .values(retention_bucket=now)
        )
    return kept


def detach_and_drop(conn: Connection, partition: Partition, now: datetime) -> tuple[bool, int]:
    """Detach and drop `partition` if it is still attached as it was listed;
    whether it was dropped, and how many answers that must outlive it arrived
    after the move-out (and were moved out now, before the drop).

    The batched move-out ran in earlier transactions; an answer written into
    the partition since (stamped with an instant in it by a writer whose clock
    or whose wait put it a retention behind) would otherwise go with it. So
    the partition is first locked against writes (SHARE: readers go on), and
    what must outlive it is moved out once more, all of it, in this
    transaction. No payment writes there, but one that would (an answer
    stamped a retention behind) waits for that lock while holding its own on
    the parent table, which the detach needs to itself: the detach then waits
    on the writer, and gives up at LOCK_TIMEOUT, before PostgreSQL's deadlock
    check (`deadlock_timeout`, 1 s by default) could pick the payment's
    transaction instead; the writer goes on, and the next pass moves its
    answer out."""
    if not _take_turn(conn):
        return False, 0
    if partition not in list_partitions(conn):
        return False, 0
    conn.execute(text(f"LOCK TABLE {partition.name} IN SHARE MODE"))
    late = _move_out(conn, partition, now, 0, None)
    conn.execute(text(f"ALTER TABLE {PARENT} DETACH PARTITION {partition.name}"))
    conn.execute(text(f"DROP TABLE {partition.name}"))
    return True, len(late)


async def ensure_ahead(engine: AsyncEngine, now: datetime, retention: timedelta) -> list[str]:
    """ensure_partitions in its own transaction; nothing if the locks are busy."""
    try:
        async with engine.begin() as conn:
            return await conn.run_sync(ensure_partitions, now, retention)
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
    """Drop every partition that ends at or before `cutoff`, whatever its
    width, once what must outlive it is moved out. A partition whose locks are
    busy, or that another process is working on, stays for the next pass (its
    moved-out rows stay moved)."""
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
            if kept is None:
                # Another process is retiring or making partitions: its turn.
                return Retired(dropped, moved)
            moved += len(kept)
            if len(kept) < batch:
                break
            after = kept[-1]
        try:
            async with engine.begin() as conn:
                gone, late = await conn.run_sync(detach_and_drop, partition, now)
            dropped += gone
            moved += late
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
