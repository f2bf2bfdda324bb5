"""The provider answers' month partitions on PostgreSQL (decision 0018,
store/partitions.py): made ahead of time, a default that catches any instant,
a month past the retention dropped whole once what must outlive it is moved
out, a busy lock waited on only briefly; and migration 0014 up and down on a
database with answers in it, on both databases."""

from __future__ import annotations

import asyncio
import itertools
import os
import secrets
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from alembic import command
from sqlalchemy import MetaData, Table, insert, inspect, null, select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.states import State
from intentledger.engine.reaper import Reaper
from intentledger.store import tables
from intentledger.store.database import create_ledger_engine, create_sync_engine
from intentledger.store.ledger import Ledger
from intentledger.store.migrate import alembic_config, upgrade
from intentledger.store.partitions import (
    LOCK_TIMEOUT,
    Partition,
    detach_and_drop,
    ensure_partitions,
    list_partitions,
    move_out_batch,
    retire_expired,
)
from tests.conftest import BACKENDS, PG_ENV, Databases, _pg_admin, _with_database
from tests.test_reap import CUTOFF, DETAIL, NOW, RETENTION, add, mark_reaped, state_of


@pytest.fixture
async def pg(databases: Databases) -> AsyncIterator[AsyncEngine]:
    """A fresh PostgreSQL ledger: the partitions are PostgreSQL's alone."""
    if "postgresql" not in BACKENDS:
        pytest.skip("PostgreSQL is not in INTENTLEDGER_TEST_BACKENDS")
    engine = create_ledger_engine(databases.create("postgresql"))
    yield engine
    await engine.dispose()


def month(year: int, number: int) -> datetime:
    return datetime(year, number, 1, tzinfo=UTC)


async def partitions(engine: AsyncEngine) -> list[Partition]:
    async with engine.connect() as conn:
        return await conn.run_sync(list_partitions)


async def months_of(engine: AsyncEngine) -> set[datetime]:
    return {p.lower for p in await partitions(engine) if p.lower is not None}


async def ensure(
    engine: AsyncEngine, now: datetime, retention: timedelta | None = None
) -> list[str]:
    async with engine.begin() as conn:
        return await conn.run_sync(ensure_partitions, now, retention)


async def answer(engine: AsyncEngine, operation_id: str, at: datetime) -> int:
    """An observation of `operation_id` at `at`, with a provider answer."""
    async with engine.begin() as conn:
        return await Ledger(conn).add_observation(
            operation_id=operation_id,
            actor="dora",
            at=at,
            kind="lookup_result",
            source="test",
            detail=DETAIL,
        )


async def home_of(engine: AsyncEngine, observation_id: int) -> str | None:
    """The partition an answer lies in; None if it is gone."""
    async with engine.connect() as conn:
        return (
            await conn.execute(
                text(
                    "SELECT tableoid::regclass::text FROM observation_details "
                    "WHERE observation_id = :id"
                ),
                {"id": observation_id},
            )
        ).scalar_one_or_none()


async def test_migrate_makes_the_months_ahead_and_a_default_that_catches_any_instant(
    pg: AsyncEngine,
) -> None:
    now = datetime.now(UTC)
    this_month = month(now.year, now.month)
    listed = await partitions(pg)
    assert listed[-1] == Partition("observation_details_default", None, None)
    # The template was migrated moments ago: this month and the three after it.
    assert await ensure(pg, now) == []
    ahead, start = set(), this_month
    for _ in range(4):
        ahead.add(start)
        start = (start + timedelta(days=32)).replace(day=1)
    assert ahead <= await months_of(pg)
    for p in listed[:-1]:
        assert p.lower is not None and p.upper is not None
        assert p.name == f"observation_details_{p.lower:%Y_%m}"
        assert (p.lower.day, p.lower.hour, p.upper.day) == (1, 0, 1)

    # A pass months later makes what it lacks, once.
    later = await ensure(pg, datetime(2031, 11, 15, tzinfo=UTC))
    assert later == [f"observation_details_2031_{m:02d}" for m in (11, 12)] + [
        "observation_details_2032_01",
        "observation_details_2032_02",
    ]
    assert await ensure(pg, datetime(2031, 11, 15, tzinfo=UTC)) == []

    # An instant in no month's partition lands in the default: never refused.
    await add(pg, "op_far", State.OUTCOME_KNOWN, NOW - now)  # written now
    past = await answer(pg, "op_far", datetime(1990, 3, 3, 12, tzinfo=UTC))
    future = await answer(pg, "op_far", datetime(2100, 1, 15, tzinfo=UTC))
    assert await home_of(pg, past) == await home_of(pg, future) == "observation_details_default"
    # The next pass gives each such month a partition and moves its rows in.
    made = await ensure(pg, now)
    assert made == ["observation_details_1990_03", "observation_details_2100_01"]
    assert await home_of(pg, past) == "observation_details_1990_03"
    assert await home_of(pg, future) == "observation_details_2100_01"
    async with pg.connect() as conn:
        left = await conn.execute(text("SELECT count(*) FROM observation_details_default"))
        assert left.scalar_one() == 0


async def test_a_month_past_the_retention_is_dropped_once_what_must_outlive_it_moved_out(
    pg: AsyncEngine,
) -> None:
    old = RETENTION * 2  # 2024-09-21: its month ended long before the cutoff
    await add(pg, "op_settled", State.OUTCOME_KNOWN, old)
    await add(pg, "op_unknown", State.UNKNOWN, old)
    await add(pg, "op_refunded", State.OUTCOME_KNOWN, old)
    await add(pg, "op_refunded_r", State.ACCEPTED, old, parent="op_refunded")
    # Reaped long ago, then late evidence: the late answer stays, as on SQLite.
    await add(pg, "op_late", State.OUTCOME_KNOWN, RETENTION * 3)
    await mark_reaped(pg, "op_late", NOW - old - timedelta(days=1))
    late = await answer(pg, "op_late", NOW - old)
    # Settled a day before the cutoff, in a month that ends after it: reaped,
    # its answers kept until their month is past the retention too.
    await add(pg, "op_recent", State.OUTCOME_KNOWN, RETENTION + timedelta(days=1))

    done = await Reaper(pg, lambda: NOW, RETENTION, batch=2).reap()

    # op_settled and op_recent reaped; the months of 2023-08 (op_late's first
    # answers) and 2024-09 dropped, after op_unknown's, op_refunded's, its
    # refund's and op_late's late answer were moved out.
    assert (done.operations, done.detail_partitions, done.details_moved_out) == (2, 2, 4)
    remaining = await months_of(pg)
    assert month(2024, 9) not in remaining and month(2023, 8) not in remaining
    assert month(2025, 10) in remaining and month(2026, 11) in remaining
    assert all(p.upper is None or p.upper > CUTOFF for p in await partitions(pg))
    assert (await state_of(pg, "op_settled"))["details"] == [None, None]
    assert (await state_of(pg, "op_late"))["details"] == [None, None, DETAIL]
    assert await home_of(pg, late) == "observation_details_2026_11"
    for kept in ("op_unknown", "op_refunded", "op_refunded_r", "op_recent"):
        assert (await state_of(pg, kept))["details"] == [DETAIL, None], kept
    assert (await state_of(pg, "op_recent"))["reaped_at"] == NOW
    async with pg.connect() as conn:
        buckets = await conn.execute(
            select(tables.operations.c.operation_id, tables.observation_details.c.retention_bucket)
            .select_from(
                tables.observation_details.join(
                    tables.observations,
                    tables.observations.c.id == tables.observation_details.c.observation_id,
                ).join(
                    tables.operations,
                    tables.operations.c.operation_id == tables.observations.c.operation_id,
                )
            )
            .where(tables.operations.c.operation_id.in_(["op_unknown", "op_refunded_r"]))
        )
        # Moved to the month of the pass, to be looked at again a retention later.
        assert {at for _, at in buckets} == {NOW}

    # Nothing left to drop; the moved answers wait in the current month.
    again = await Reaper(pg, lambda: NOW, RETENTION, batch=2).reap()
    assert (again.detail_partitions, again.details_moved_out) == (0, 0)


async def test_an_operation_not_yet_reaped_keeps_its_answers_whatever_comes_before_the_drop(
    pg: AsyncEngine,
) -> None:
    """The race the row path re-checks for (store/reaping.reap_batch): a refund
    accepted between the move-out and the drop. The drop asks only whether the
    operation was reaped, which a refund cannot undo and only reaping (under
    the operation's lock) can do; so a payment not reaped when its answers were
    looked at keeps them, and a reaped one gave them up when it was reaped."""
    await add(pg, "op_paid", State.OUTCOME_KNOWN, RETENTION * 2)
    await add(pg, "op_reaped", State.OUTCOME_KNOWN, RETENTION * 2)
    await mark_reaped(pg, "op_reaped", NOW - timedelta(days=1))
    await ensure(pg, NOW)
    [expired] = [p for p in await partitions(pg) if p.lower == month(2024, 9)]
    async with pg.begin() as conn:
        moved = await conn.run_sync(move_out_batch, expired, NOW, 0, 100)
    assert len(moved) == 1  # op_paid's answer; op_reaped's stays to go
    # Both payments get a refund now, before the drop.
    await add(pg, "op_paid_r", State.ACCEPTED, timedelta(0), parent="op_paid")
    await add(pg, "op_reaped_r", State.ACCEPTED, timedelta(0), parent="op_reaped")
    async with pg.begin() as conn:
        assert await conn.run_sync(detach_and_drop, expired, NOW) == (True, 0)
    assert (await state_of(pg, "op_paid"))["details"] == [DETAIL, None]
    assert (await state_of(pg, "op_reaped"))["details"] == [None, None]
    # And a partition already gone is not dropped twice.
    async with pg.begin() as conn:
        assert await conn.run_sync(detach_and_drop, expired, NOW) == (False, 0)


async def test_a_busy_partition_is_left_for_the_next_pass_without_stalling_payments(
    pg: AsyncEngine,
) -> None:
    await add(pg, "op_open", State.UNKNOWN, RETENTION * 2)
    await ensure(pg, NOW)
    assert month(2024, 9) in await months_of(pg)
    # A long reader of answers (a console page, a report) holds its lock.
    async with pg.connect() as reader:
        await reader.execute(select(tables.observation_details.c.observation_id).limit(1))
        started = time.monotonic()
        retired = await retire_expired(pg, NOW, CUTOFF, batch=100)
        waited = time.monotonic() - started
        # The move-out needs no lock a reader holds; the drop gave up.
        assert (retired.partitions_dropped, retired.details_moved_out) == (0, 1)
        assert month(2024, 9) in await months_of(pg)
        assert waited < 5, f"waited {waited:.1f}s behind a reader (lock_timeout {LOCK_TIMEOUT})"
        # Nothing waits behind a drop that gave up: answers are written as ever.
        await answer(pg, "op_open", NOW)
        await reader.rollback()
    retired = await retire_expired(pg, NOW, CUTOFF, batch=100)
    assert (retired.partitions_dropped, retired.details_moved_out) == (1, 0)
    assert (await state_of(pg, "op_open"))["details"] == [DETAIL, None, DETAIL]


# -- migration 0014 ------------------------------------------------------------

AT = datetime(2025, 3, 10, 8, 30, tzinfo=UTC)


def _fresh_at(url: str, revision: str) -> None:
    engine = create_sync_engine(url)
    with engine.begin() as conn:  # start from nothing
        for table in reversed(tables.metadata.sorted_tables):
            conn.execute(text(f"DROP TABLE {table.name}"))
        conn.execute(text("DROP TABLE alembic_version"))
    engine.dispose()
    upgrade(url, revision)


def _settled_payment(operation_id: str) -> dict[str, Any]:
    """An operation row of the columns every revision since 0013 has."""
    return {
        "operation_id": operation_id,
        "idempotency_key": f"k-{operation_id}",
        "state": "OUTCOME_KNOWN",
        "request_context": {"body": {}},
        "next_action": "none",
        "actor": "dora",
        "route": "POST /v1/payments",
        "kind": "payment",
        "request_hash": "0" * 64,
        "provider": "sandbox",
        "version": 1,
        "created_at": AT,
        "updated_at": AT,
    }


def _observation_rows(url: str) -> list[dict[str, Any]]:
    """The observations as stored, by whatever columns the schema has now."""
    engine = create_sync_engine(url)
    with engine.connect() as conn:
        observations = Table("observations", MetaData(), autoload_with=conn)
        rows = [dict(r._mapping) for r in conn.execute(select(observations).order_by("id"))]
    engine.dispose()
    return rows


def test_migration_0014_moves_the_answers_out_and_back(backend: str, databases: Databases) -> None:
    url = databases.create(backend)
    _fresh_at(url, "0013")
    engine = create_sync_engine(url)
    with engine.begin() as conn:
        conn.execute(insert(tables.operations).values(**_settled_payment("op_old")))
        observations = Table("observations", MetaData(), autoload_with=conn)
        base = {"operation_id": "op_old", "at": AT, "kind": "submit_result", "source": "t"}
        # An answer, a detail-less one (JSON null) and a reaped one (SQL NULL).
        conn.execute(insert(observations).values(**base, detail=DETAIL))
        conn.execute(insert(observations).values(**base, detail=None))
        conn.execute(insert(observations).values(**base, detail=null()))

    upgrade(url)
    assert ["detail" in row for row in _observation_rows(url)] == [False] * 3
    with engine.connect() as conn:
        details = tables.observation_details
        answers = conn.execute(select(details.c.retention_bucket, details.c.detail)).all()
        assert [tuple(a) for a in answers] == [(AT, DETAIL)]
        read = tables.observations_with_detail
        assert list(conn.execute(select(read.c.detail).order_by(read.c.id)).scalars()) == [
            DETAIL,
            None,
            None,
        ]
        if backend == "postgresql":
            home = conn.execute(text("SELECT tableoid::regclass::text FROM observation_details"))
            assert home.scalar_one() == "observation_details_2025_03"

    command.downgrade(alembic_config(url), "0013")
    assert [r["detail"] for r in _observation_rows(url)] == [DETAIL, None, None]
    with engine.connect() as conn:
        left = [n for n in inspect(conn).get_table_names() if n.startswith("observation_det")]
        assert left == []
    # And up again, as a database at 0013 with answers would go.
    upgrade(url)
    with engine.connect() as conn:
        read = tables.observations_with_detail
        assert list(conn.execute(select(read.c.detail).order_by(read.c.id)).scalars()) == [
            DETAIL,
            None,
            None,
        ]
    engine.dispose()


def test_migration_0016_gives_each_reaped_operation_the_last_answer_its_reap_saw(
    backend: str, databases: Databases
) -> None:
    """Before 0016 a reap gave up the answers at or before `reaped_at`; the new
    column says so by id, for the operations reaped already."""
    url = databases.create(backend)
    _fresh_at(url, "0015")
    engine = create_sync_engine(url)
    reaped_at = AT + timedelta(days=1)
    with engine.begin() as conn:
        operations = Table("operations", MetaData(), autoload_with=conn)
        observations = Table("observations", MetaData(), autoload_with=conn)
        for operation_id, reaped in (
            ("op_reaped", reaped_at),
            ("op_bare", reaped_at),
            ("op_kept", None),
        ):
            conn.execute(
                insert(operations).values(**_settled_payment(operation_id), reaped_at=reaped)
            )
        ids = {}
        for operation_id, at in (
            ("op_reaped", AT),
            ("op_kept", AT),
            ("op_reaped", reaped_at),  # at the reap: given up
            ("op_reaped", reaped_at + timedelta(seconds=1)),  # late evidence
        ):
            made = conn.execute(
                insert(observations).values(
                    operation_id=operation_id, at=at, kind="lookup_result", source="t"
                )
            )
            ids[(operation_id, at)] = made.inserted_primary_key[0]

    upgrade(url)
    with engine.connect() as conn:
        through = {
            operation_id: last
            for operation_id, last in conn.execute(
                select(
                    tables.operations.c.operation_id,
                    tables.operations.c.reaped_through_observation,
                )
            )
        }
    assert through == {"op_reaped": ids[("op_reaped", reaped_at)], "op_bare": 0, "op_kept": None}
    command.downgrade(alembic_config(url), "0015")
    with engine.connect() as conn:
        columns = {c["name"] for c in inspect(conn).get_columns("operations")}
    assert "reaped_through_observation" not in columns and "reaped_at" in columns
    upgrade(url)
    engine.dispose()


async def test_an_answer_written_after_the_reap_outlives_the_drop_whatever_instant_it_carries(
    pg: AsyncEngine,
) -> None:
    """A writer reads its clock before it waits for the operation's lock, maybe
    on a machine whose clock is behind: an answer written after the reap can
    carry an instant before the reap's, in a partition already past the
    retention. Told by its id, it came after the reap and is kept."""
    old = RETENTION * 2
    await add(pg, "op_settled", State.OUTCOME_KNOWN, old)
    first = await Reaper(pg, lambda: NOW, RETENTION).reap()
    assert (first.operations, first.detail_partitions) == (1, 1)
    assert (await state_of(pg, "op_settled"))["details"] == [None, None]
    # Stamped two retentions back, written now: the default partition takes it,
    # and the next pass gives its month a partition, past the retention, to drop.
    late = await answer(pg, "op_settled", NOW - old)
    again = await Reaper(pg, lambda: NOW, RETENTION).reap()
    assert (again.operations, again.detail_partitions, again.details_moved_out) == (0, 1, 1)
    assert await home_of(pg, late) == "observation_details_2026_11"
    assert (await state_of(pg, "op_settled"))["details"] == [None, None, DETAIL]


# -- review: races around the drop ----------------------------------------------


async def test_an_answer_written_into_a_partition_after_its_move_out_is_not_dropped(
    pg: AsyncEngine,
) -> None:
    """The batched move-out and the drop are separate transactions. An answer
    stamped with an instant in the partition but written after the move-out
    (a writer whose clock, or whose wait for a lock, put it a retention
    behind) must be moved out by the drop itself, which locks the partition
    against writes first."""
    await add(pg, "op_open", State.UNKNOWN, RETENTION * 2)
    await ensure(pg, NOW)
    [expired] = [p for p in await partitions(pg) if p.lower == month(2024, 9)]
    async with pg.begin() as conn:
        assert len(await conn.run_sync(move_out_batch, expired, NOW, 0, 100) or []) == 1
    assert expired.lower is not None
    stale = await answer(pg, "op_open", expired.lower + timedelta(days=3))
    assert await home_of(pg, stale) == expired.name
    async with pg.begin() as conn:
        assert await conn.run_sync(detach_and_drop, expired, NOW) == (True, 1)
    assert await home_of(pg, stale) == "observation_details_2026_11"
    assert (await state_of(pg, "op_open"))["details"] == [DETAIL, None, DETAIL]


async def test_two_processes_retiring_at_once_take_turns_instead_of_failing(
    pg: AsyncEngine,
) -> None:
    """Two workers' reap passes move out the same partition: the second
    waited on the first's rows and then failed (a row it waited for was moved
    to another partition: 40001), which a reap pass does not expect. The
    move-out takes the same turn as the partition changes."""
    for n in range(3):
        await add(pg, f"op_open_{n}", State.UNKNOWN, RETENTION * 2)
    await ensure(pg, NOW)
    [expired] = [p for p in await partitions(pg) if p.lower == month(2024, 9)]
    async with pg.connect() as first:
        await first.begin()
        assert len(await first.run_sync(move_out_batch, expired, NOW, 0, 100) or []) == 3

        async def second() -> Any:
            async with pg.begin() as conn:
                return await conn.run_sync(move_out_batch, expired, NOW, 0, 100)

        other = asyncio.ensure_future(second())
        await asyncio.sleep(1)
        await first.commit()
        assert await other is None  # not its turn: it leaves the partition alone
    retired = await retire_expired(pg, NOW, CUTOFF, batch=100)
    assert (retired.partitions_dropped, retired.details_moved_out) == (1, 0)
    for n in range(3):
        assert (await state_of(pg, f"op_open_{n}"))["details"] == [DETAIL, None]


# -- partitions as wide as the retention calls for -------------------------------

SHORT = timedelta(minutes=5)
T0 = datetime(2031, 6, 15, 12, 0, tzinfo=UTC)  # where no partition lies yet


def _no_overlap(listed: list[Partition]) -> None:
    spans = [p for p in listed if p.lower is not None]
    for before, after in itertools.pairwise(spans):
        assert before.upper is not None and after.lower is not None
        assert before.upper <= after.lower, (before, after)
    names = [p.name for p in spans]
    assert names == sorted(names)  # the names sort as the bounds do
    assert len(set(names)) == len(names)


async def test_a_retention_of_minutes_gets_minute_partitions_made_ahead_and_dropped(
    pg: AsyncEngine,
) -> None:
    made = await ensure(pg, T0 + timedelta(seconds=20), SHORT)
    assert made == [
        "observation_details_2031_06_15_12",
        "observation_details_2031_06_15_1201",
        "observation_details_2031_06_15_1202",
        "observation_details_2031_06_15_1203",
    ]
    listed = await partitions(pg)
    for p in listed:
        if p.name in made:
            assert p.lower is not None and p.upper is not None
            assert p.upper - p.lower == timedelta(minutes=1)
    _no_overlap(listed)

    # A settled payment and an unresolved one, answered in the first minute.
    await add(pg, "op_paid", State.OUTCOME_KNOWN, NOW - (T0 + timedelta(seconds=30)))
    await add(pg, "op_open", State.UNKNOWN, NOW - (T0 + timedelta(seconds=30)))
    later = T0 + timedelta(minutes=7)  # cutoff 12:02: the minutes 12:00 and 12:01 are past it
    # (and the months migrate made, years before)
    past = [p for p in await partitions(pg) if p.upper and p.upper <= later - SHORT]
    assert [p.name for p in past][-2:] == [
        "observation_details_2031_06_15_12",
        "observation_details_2031_06_15_1201",
    ]
    done = await Reaper(pg, lambda: later, SHORT, batch=10).reap()
    assert (done.operations, done.detail_partitions, done.details_moved_out) == (1, len(past), 1)
    names = {p.name for p in await partitions(pg)}
    assert not names & {"observation_details_2031_06_15_12", "observation_details_2031_06_15_1201"}
    # Made ahead from the pass's minute on; the answer kept is moved into it.
    assert {f"observation_details_2031_06_15_{m}" for m in (1207, 1208, 1209, 1210)} <= names
    assert (await state_of(pg, "op_paid"))["details"] == [None, None]
    assert (await state_of(pg, "op_open"))["details"] == [DETAIL, None]
    async with pg.connect() as conn:
        homes = await conn.execute(
            text(
                "SELECT tableoid::regclass::text FROM observation_details "
                "WHERE retention_bucket >= :t0"
            ),
            {"t0": T0},
        )
        assert list(homes.scalars()) == ["observation_details_2031_06_15_1207"]

    # An answer in a minute no partition covers waits in the default, and the
    # next pass gives that minute a partition.
    gap = await answer(pg, "op_open", T0 + timedelta(minutes=5, seconds=10))
    assert await home_of(pg, gap) == "observation_details_default"
    assert await ensure(pg, later, SHORT) == ["observation_details_2031_06_15_1205"]
    assert await home_of(pg, gap) == "observation_details_2031_06_15_1205"
    _no_overlap(await partitions(pg))


async def test_a_retention_changed_between_runs_makes_partitions_around_those_there_are(
    pg: AsyncEngine,
) -> None:
    # Minutes first (a short run), then the production retention: months,
    # fitted around the minutes that are still there, overlapping none.
    await ensure(pg, T0, SHORT)
    months = await ensure(pg, T0 + timedelta(minutes=1), RETENTION)
    assert months == [
        "observation_details_2031_06",  # 06-01 up to the first minute, 12:00
        "observation_details_2031_06_15_1204",  # the last minute's end to 07-01
        "observation_details_2031_07",
        "observation_details_2031_08",
        "observation_details_2031_09",
    ]
    listed = await partitions(pg)
    _no_overlap(listed)
    bounds = {p.name: (p.lower, p.upper) for p in listed}
    assert bounds["observation_details_2031_06"] == (datetime(2031, 6, 1, tzinfo=UTC), T0)
    assert bounds["observation_details_2031_06_15_1204"] == (
        T0 + timedelta(minutes=4),
        datetime(2031, 7, 1, tzinfo=UTC),
    )
    # And back to minutes: the months cover the time, nothing more is made
    # until they end; every instant still has exactly one partition.
    assert await ensure(pg, T0 + timedelta(minutes=2), SHORT) == []
    end = datetime(2031, 10, 1, tzinfo=UTC)
    assert await ensure(pg, end - timedelta(seconds=30), SHORT) == [
        "observation_details_2031_10",  # 10-01 00:00, a minute wide
        "observation_details_2031_10_01_0001",
        "observation_details_2031_10_01_0002",
    ]
    _no_overlap(await partitions(pg))
    # Retired by bounds, whatever the width: at a cutoff past the 1st of
    # October every partition of June to September goes.
    past = [p for p in await partitions(pg) if p.upper and p.upper <= end]
    assert len([p for p in past if p.lower and p.lower >= datetime(2031, 6, 1, tzinfo=UTC)]) == 9
    retired = await retire_expired(pg, end, end, batch=100)
    assert retired.partitions_dropped == len(past)
    left = await partitions(pg)
    assert all(p.upper is None or p.upper > end for p in left)
    assert "observation_details_2031_10" in {p.name for p in left}


async def test_a_fresh_ledger_migrated_with_a_retention_of_minutes_gets_minute_partitions() -> None:
    """The soak's ledger (chaos --retention 5m): nothing a month wide may cover
    the present, or no partition would be old enough to drop within the run."""
    if "postgresql" not in BACKENDS:
        pytest.skip("PostgreSQL is not in INTENTLEDGER_TEST_BACKENDS")
    name = "il_test_fresh_" + secrets.token_hex(4)
    _pg_admin(f"CREATE DATABASE {name}")
    try:
        url = _with_database(os.environ[PG_ENV], name)
        await asyncio.to_thread(upgrade, url, retention=timedelta(minutes=5))
        engine = create_ledger_engine(url)
        try:
            made = [p for p in await partitions(engine) if p.lower is not None]
        finally:
            await engine.dispose()
        assert made, "no partition made ahead"
        assert {p.upper - p.lower for p in made if p.upper} == {timedelta(minutes=1)}, made
        assert made[0].lower <= datetime.now(UTC) < made[-1].upper  # type: ignore[operator]
    finally:
        _pg_admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
