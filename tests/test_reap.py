"""Record retention (decision 0018): `reap` removes only what it may, on both
databases. A hypothesis property over ledgers of every state, flag, age, refund
and outbox mix: an operation is reaped exactly when domain/reaping.may_reap
says so, a reaped one loses only its bulky rows, and every other row is
untouched — an unresolved, a flagged and a refunding operation older than the
retention all survive.

On PostgreSQL a reaped operation's provider answers go when their month's
partition passes the retention (store/partitions.py, tests/test_partitions.py):
here, those of the operations two retentions old, not those of the operations
about one retention old, whose month ends after the cutoff."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.reaping import ReapFacts, may_reap
from intentledger.domain.states import FINAL, State
from intentledger.engine.reaper import Reaper
from intentledger.store import tables
from tests.support import INTENTLEDGER

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
RETENTION = timedelta(days=400)
CUTOFF = NOW - RETENTION
DETAIL = {"status": 200, "body": {"id": "ch_1", "iban": "****3000"}}


@dataclass(frozen=True)
class Planned:
    state: State
    duplicate: bool
    contradicted: bool
    age: timedelta
    # Each refund's state, whether it still has outbox work (an audit to come),
    # and whether it is flagged (a duplicate or a contradiction of its own).
    refunds: tuple[tuple[State, bool, bool], ...]
    pending_outbox: bool
    done_outbox: int


planned = st.builds(
    Planned,
    state=st.sampled_from(list(State)),
    duplicate=st.booleans(),
    contradicted=st.booleans(),
    age=st.sampled_from([RETENTION - timedelta(seconds=1), RETENTION, RETENTION * 2]),
    refunds=st.lists(
        st.tuples(st.sampled_from(list(State)), st.booleans(), st.booleans()), max_size=2
    ).map(tuple),
    pending_outbox=st.booleans(),
    done_outbox=st.integers(0, 2),
)


async def clear(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        for table in (
            tables.outbox,
            tables.observation_details,
            tables.observations,
            tables.operations,
        ):
            await conn.execute(delete(table))


def answers_dropped_by_then(engine: AsyncEngine, at: datetime) -> bool:
    """Whether a reaped operation's answers written at `at` are gone after a
    pass at NOW: at once on SQLite; on PostgreSQL once their UTC month ended
    at or before the cutoff (computed here apart from the code under test)."""
    if engine.dialect.name != "postgresql":
        return True
    next_month = datetime(at.year + at.month // 12, at.month % 12 + 1, 1, tzinfo=UTC)
    return next_month <= CUTOFF


async def add(
    engine: AsyncEngine,
    operation_id: str,
    state: State,
    age: timedelta,
    *,
    duplicate: bool = False,
    contradicted: bool = False,
    parent: str | None = None,
    pending_outbox: bool = False,
    done_outbox: int = 1,
) -> None:
    at = NOW - age
    async with engine.begin() as conn:
        await conn.execute(
            insert(tables.operations).values(
                operation_id=operation_id,
                idempotency_key=f"k-{operation_id}",
                state=state.value,
                request_context={"route": "POST /v1/payments", "body": {"amount": 990}},
                next_action="none",
                actor="dora",
                route="POST /v1/payments",
                kind="refund" if parent else "payment",
                request_hash="0" * 64,
                provider="sandbox",
                amount=990,
                currency="EUR",
                version=1,
                created_at=at,
                updated_at=at,
                duplicate_detected=duplicate,
                outcome_contradicted=contradicted,
                parent_operation_id=parent,
            )
        )
        answered = await conn.execute(
            insert(tables.observations).values(
                operation_id=operation_id,
                actor="dora",
                at=at,
                kind="submit_result",
                source="test",
            )
        )
        await conn.execute(
            insert(tables.observation_details).values(
                observation_id=answered.inserted_primary_key[0],
                retention_bucket=at,
                actor="dora",
                detail=DETAIL,
            )
        )
        # A detail-less answer has no answer row: nothing to remove, nor count.
        await conn.execute(
            insert(tables.observations).values(
                operation_id=operation_id,
                actor="dora",
                at=at,
                kind="lookup_result",
                source="test",
            )
        )
        for _ in range(done_outbox):
            await conn.execute(
                insert(tables.outbox).values(
                    operation_id=operation_id,
                    actor="dora",
                    kind="submit",
                    due_at=at,
                    deliveries=1,
                    done_at=at,
                    created_at=at,
                )
            )
        if pending_outbox:
            await conn.execute(
                insert(tables.outbox).values(
                    operation_id=operation_id,
                    actor="dora",
                    kind="audit",
                    due_at=NOW,
                    deliveries=0,
                    created_at=at,
                )
            )


async def mark_reaped(engine: AsyncEngine, operation_id: str, at: datetime) -> None:
    """Stamp `operation_id` reaped at `at`, giving up the answers it has now, as a
    reap would (store/reaping.py)."""
    async with engine.begin() as conn:
        last = (
            await conn.execute(
                select(func.coalesce(func.max(tables.observations.c.id), 0)).where(
                    tables.observations.c.operation_id == operation_id
                )
            )
        ).scalar_one()
        await conn.execute(
            update(tables.operations)
            .where(tables.operations.c.operation_id == operation_id)
            .values(reaped_at=at, reaped_through_observation=last)
        )


async def state_of(engine: AsyncEngine, operation_id: str) -> dict[str, Any]:
    async with engine.connect() as conn:
        op = (
            await conn.execute(
                select(tables.operations).where(tables.operations.c.operation_id == operation_id)
            )
        ).one()
        read = tables.observations_with_detail
        details = (
            await conn.execute(
                select(read.c.detail).where(read.c.operation_id == operation_id).order_by(read.c.id)
            )
        ).scalars()
        done = (
            await conn.execute(
                select(func.count())
                .select_from(tables.outbox)
                .where(
                    tables.outbox.c.operation_id == operation_id,
                    tables.outbox.c.done_at.is_not(None),
                )
            )
        ).scalar_one()
        pending = (
            await conn.execute(
                select(func.count())
                .select_from(tables.outbox)
                .where(
                    tables.outbox.c.operation_id == operation_id, tables.outbox.c.done_at.is_(None)
                )
            )
        ).scalar_one()
    return {
        "reaped_at": op.reaped_at,
        "body": op.request_context["body"],
        "marker": op.request_context.get("body_reaped_at"),
        "details": list(details),
        "done": done,
        "pending": pending,
        "state": op.state,
        "version": op.version,
    }


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ledger=st.lists(planned, min_size=1, max_size=6))
async def test_reap_removes_exactly_what_it_may_and_nothing_else(
    engine: AsyncEngine, ledger: list[Planned]
) -> None:
    await clear(engine)
    expected: dict[str, bool] = {}
    ages: dict[str, timedelta] = {}
    for n, plan in enumerate(ledger):
        payment = f"op_{n}"
        ages[payment] = plan.age
        await add(
            engine,
            payment,
            plan.state,
            plan.age,
            duplicate=plan.duplicate,
            contradicted=plan.contradicted,
            pending_outbox=plan.pending_outbox,
            done_outbox=plan.done_outbox,
        )
        for m, (refund_state, verifying, flagged) in enumerate(plan.refunds):
            await add(
                engine,
                f"op_{n}_r{m}",
                refund_state,
                plan.age,
                parent=payment,
                pending_outbox=verifying,
                contradicted=flagged,
            )
            ages[f"op_{n}_r{m}"] = plan.age
            expected[f"op_{n}_r{m}"] = may_reap(
                ReapFacts(
                    refund_state,
                    False,
                    flagged,
                    NOW - plan.age,
                    0,
                    int(verifying),
                    False,
                    parent_flagged=plan.duplicate or plan.contradicted,
                ),
                CUTOFF,
            )
        open_refunds = sum(
            1 for s, verifying, flagged in plan.refunds if s not in FINAL or verifying or flagged
        )
        expected[payment] = may_reap(
            ReapFacts(
                plan.state,
                plan.duplicate,
                plan.contradicted,
                NOW - plan.age,
                open_refunds,
                int(plan.pending_outbox),
                False,
            ),
            CUTOFF,
        )
    before = {op: await state_of(engine, op) for op in expected}
    dropped_months = {op: answers_dropped_by_then(engine, NOW - age) for op, age in ages.items()}

    # Batches of two: several transactions for one pass, as at scale.
    done = await Reaper(engine, lambda: NOW, RETENTION, batch=2).reap()

    assert done.operations == sum(expected.values())
    if engine.dialect.name == "postgresql":
        # Row by row nothing; by partition the one month past the cutoff, after
        # every answer of an operation not reaped was moved out of it.
        assert done.observation_details == 0
        assert done.detail_partitions == int(any(dropped_months.values()))
        assert done.details_moved_out == sum(
            1 for op, gone in dropped_months.items() if gone and not expected[op]
        )
    else:
        assert done.observation_details == sum(expected.values())
        assert (done.detail_partitions, done.details_moved_out) == (0, 0)
    for op, reapable in expected.items():
        after = await state_of(engine, op)
        if reapable:
            assert after["reaped_at"] == NOW
            assert (after["body"], after["marker"]) == ({}, NOW.isoformat())
            kept = [None, None] if dropped_months[op] else [DETAIL, None]
            assert after["details"] == kept and after["done"] == 0
            assert (after["state"], after["version"], after["pending"]) == (
                before[op]["state"],
                before[op]["version"],
                0,
            )
        else:
            assert after == before[op], op
    # A second pass finds nothing more: reaping is done once, and what was moved
    # out of a dropped month is in the current one.
    again = await Reaper(engine, lambda: NOW, RETENTION, batch=2).reap()
    assert (again.operations, again.detail_partitions, again.details_moved_out) == (0, 0, 0)


async def test_the_unresolved_the_flagged_and_the_refunding_survive_however_old(
    engine: AsyncEngine,
) -> None:
    old = RETENTION * 3
    await add(engine, "op_unknown", State.UNKNOWN, old)
    await add(engine, "op_review", State.MANUAL_REVIEW, old)
    await add(engine, "op_duplicate", State.OUTCOME_KNOWN, old, duplicate=True)
    await add(engine, "op_contradicted", State.CANCELLED, old, contradicted=True)
    await add(engine, "op_refunding", State.OUTCOME_KNOWN, old)
    await add(engine, "op_refund", State.UNKNOWN, old, parent="op_refunding")
    # A refund a person settled as failed, whose audit has not looked yet.
    await add(engine, "op_verifying", State.OUTCOME_KNOWN, old)
    await add(
        engine,
        "op_verifying_r",
        State.OUTCOME_KNOWN,
        old,
        parent="op_verifying",
        pending_outbox=True,
    )
    # A settled refund of a flagged payment: a person may need its answers.
    await add(engine, "op_duplicate_r", State.OUTCOME_KNOWN, old, parent="op_duplicate")
    # A payment whose settled refund is flagged: a person looking at the refund
    # needs the payment's answers too.
    await add(engine, "op_disputed", State.OUTCOME_KNOWN, old)
    await add(
        engine, "op_disputed_r", State.OUTCOME_KNOWN, old, parent="op_disputed", contradicted=True
    )
    await add(engine, "op_audited", State.OUTCOME_KNOWN, old, pending_outbox=True)
    await add(engine, "op_recent", State.OUTCOME_KNOWN, RETENTION - timedelta(minutes=1))
    await add(engine, "op_settled", State.OUTCOME_KNOWN, old)
    done = await Reaper(engine, lambda: NOW, RETENTION).reap()
    if engine.dialect.name == "postgresql":
        # The month three retentions back dropped, the twelve survivors' answers
        # moved out of it first.
        assert (done.operations, done.observation_details, done.outbox_rows) == (1, 0, 1)
        assert (done.detail_partitions, done.details_moved_out) == (1, 12)
    else:
        assert (done.operations, done.observation_details, done.outbox_rows) == (1, 1, 1)
    settled = await state_of(engine, "op_settled")
    assert settled["reaped_at"] == NOW and settled["details"] == [None, None]
    for survivor in (
        "op_unknown",
        "op_review",
        "op_duplicate",
        "op_contradicted",
        "op_refunding",
        "op_refund",
        "op_audited",
        "op_recent",
        "op_verifying",
        "op_verifying_r",
        "op_duplicate_r",
        "op_disputed",
        "op_disputed_r",
    ):
        kept = await state_of(engine, survivor)
        assert kept["reaped_at"] is None and kept["details"] == [DETAIL, None], survivor
        assert kept["body"] == {"amount": 990}, survivor


def test_reap_on_the_command_line_reports_what_it_removed(
    sqlite_template: Any, tmp_path: Any
) -> None:
    import asyncio
    import shutil

    from intentledger.store.database import create_ledger_engine

    path = tmp_path / "reap.db"
    shutil.copy(sqlite_template, path)
    url = f"sqlite:///{path}"
    engine = create_ledger_engine(url)
    real_now = datetime.now(UTC)

    async def fill() -> None:
        for n in range(3):
            await add(engine, f"op_{n}", State.OUTCOME_KNOWN, RETENTION * 2 + (NOW - real_now))
        await add(engine, "op_open", State.UNKNOWN, RETENTION * 2 + (NOW - real_now))
        await engine.dispose()

    asyncio.run(fill())
    done = subprocess.run(
        [*INTENTLEDGER, "reap", "--database-url", url, "--batch", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == (
        "reaped 3 operation(s) settled over 400d ago: 3 observation detail(s) cleared, "
        "3 done outbox row(s) deleted"
    )
    refused = subprocess.run(
        [*INTENTLEDGER, "reap", "--database-url", url, "--record-retention", "1d"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2 and "record_retention must be at least" in refused.stderr


async def test_a_running_worker_reaps_on_its_schedule(engine: AsyncEngine) -> None:
    import asyncio

    from intentledger.engine.worker import run_worker
    from tests.test_recovery_model import ControlledClock, SimulatedProvider, build_worker

    clock = ControlledClock(NOW)
    worker = build_worker(engine, SimulatedProvider(clock), clock)
    worker.reaper = Reaper(engine, clock, RETENTION)
    await add(engine, "op_old", State.OUTCOME_KNOWN, RETENTION * 2)
    stop = asyncio.Event()
    running = asyncio.create_task(
        run_worker(
            worker,
            stop,
            concurrency=1,
            poll_interval=timedelta(milliseconds=20),
            sweep_interval=timedelta(hours=1),
            reap_interval=timedelta(milliseconds=50),
        )
    )
    try:
        for _ in range(100):
            if (await state_of(engine, "op_old"))["reaped_at"] is not None:
                break
            await asyncio.sleep(0.02)
    finally:
        stop.set()
        await running
    assert (await state_of(engine, "op_old"))["reaped_at"] == NOW


async def test_a_refund_committed_after_selection_keeps_its_payment(
    engine: AsyncEngine, monkeypatch: Any
) -> None:
    """The re-check in store/reaping.reap_batch: on PostgreSQL the candidates
    are judged on the statement's snapshot and locked after it, so a refund
    accepted under the payment's lock can commit in between without touching
    the payment's row. Here the choice is made before the refund and the lock
    taken after it; the batch judges the payment again and keeps it."""
    from intentledger.store import reaping

    await add(engine, "op_paid", State.OUTCOME_KNOWN, RETENTION * 2)
    async with engine.connect() as conn:
        stale = await reaping.lock_candidates(conn, CUTOFF, 10)
        await conn.rollback()
    assert [row.operation_id for row in stale] == ["op_paid"]
    await add(engine, "op_paid_r", State.ACCEPTED, timedelta(0), parent="op_paid")
    before = await state_of(engine, "op_paid")

    async def chosen_before_the_refund(conn: Any, cutoff: datetime, limit: int) -> list[Any]:
        ids = [row.operation_id for row in stale]
        await conn.execute(
            select(tables.operations.c.operation_id)
            .where(tables.operations.c.operation_id.in_(ids))
            .with_for_update()
        )
        return stale

    monkeypatch.setattr(reaping, "lock_candidates", chosen_before_the_refund)
    done = await Reaper(engine, lambda: NOW, RETENTION).reap()
    assert done.operations == 0
    assert await state_of(engine, "op_paid") == before
