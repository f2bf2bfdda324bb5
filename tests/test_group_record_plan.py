"""A group record plans from the operations as their pre-submits left them.

On PostgreSQL a group of first attempts' answers is settled with no read of
its operations: each change is planned from the record the pre-submit
committed and written only where the operation is still at that version; if
one moved on, nothing of the group is kept and it is planned again from the
rows read under their locks (`engine/settlement_queue.py`, `record_together`).
On SQLite, and for any group with a mandate, it is always the plan under
locks. What these tests hold it to, on both databases:

- the record a pre-submit hands on is the row as it committed it;
- a plain group sends no read, and a group with a mandate reads under locks;
- an operation that moved on between its pre-submit and its group's record
  is settled by nothing of the group, and the others are settled once;
- whatever answers arrive and whatever the reference path recorded before
  the group (an answer lost, a success, a pending one), the ledger ends
  exactly as it ends when the same story is planned under locks (hypothesis).
"""

from __future__ import annotations

import ast
import asyncio
import itertools
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

import intentledger
from intentledger.domain.states import NextAction, State
from intentledger.domain.transport import Classification, ProviderAnswer, Transport, Verdict
from intentledger.engine import changes
from intentledger.engine.batch_dispatch import pre_submit
from intentledger.engine.dispatcher import Dispatcher
from intentledger.engine.settlement_queue import (
    Prepared,
    Sent,
    answered_now,
    record_group,
    record_together,
)
from intentledger.store.batches import BatchLedger
from intentledger.store.database import create_ledger_engine
from intentledger.store.ledger import Ledger
from intentledger.store.records import OperationRecord
from intentledger.store.tables import (
    attempts,
    merchant_events,
    observations,
    operations,
    outbox,
    transitions,
)
from tests.conftest import BACKENDS, Databases, dispose
from tests.support import counting
from tests.test_group_news import mandate, pay
from tests.test_merchant_webhooks_engine import add_endpoint
from tests.test_recovery_model import Scene

LEASE = timedelta(minutes=5)
_stories = itertools.count()


def answer(kind: str, reference: str) -> ProviderAnswer:
    """A provider's answer of each kind the group record meets."""
    if kind == "lost":
        return ProviderAnswer(Transport.NO_RESPONSE, error_class="aiohttp.SocketTimeoutError")
    verdict, status = {
        "succeeded": (Verdict.SUCCEEDED, 200),
        "declined": (Verdict.FAILED, 402),
        "pending": (Verdict.PENDING, 202),
        "not_executed": (Verdict.NOT_EXECUTED, 400),
    }[kind]
    return ProviderAnswer(
        Transport.RESPONSE,
        status=status,
        # A refusal names no charge, as the sandbox's does not.
        provider_reference=reference if verdict in (Verdict.SUCCEEDED, Verdict.PENDING) else None,
        detail={"id": reference, "status": kind},
        mapped=Classification(verdict, kind),
    )


def replanned() -> float:
    return REGISTRY.get_sample_value("intentledger_group_records_replanned_total") or 0.0


async def presubmitted(scene: Scene, operation_ids: Sequence[str]) -> list[Prepared]:
    """Claim every due row, pre-submit the first attempts of `operation_ids`
    (rows an earlier story left due stay leased and untouched)."""
    wanted = set(operation_ids)
    async with scene.engine.begin() as conn:
        claimed = await BatchLedger(conn).claim_outbox_rows(
            scene.clock(), LEASE, scene.worker.worker_id, 10_000
        )
    prepared, others = await pre_submit(
        scene.worker.dispatcher, [row for row in claimed if row.operation_id in wanted]
    )
    assert not others
    by_id = {item.row.operation_id: item for item in prepared}
    return [by_id[operation_id] for operation_id in operation_ids]


async def test_a_pre_submit_hands_on_the_row_as_it_committed_it(engine: AsyncEngine) -> None:
    scene = Scene(engine)
    under = await mandate(scene, "ana", "plan-mandate")
    made = [
        await pay(scene, "ana", "plan-plain"),
        await pay(scene, "ana", "plan-under", mandate_id=under),
    ]
    for item in await presubmitted(scene, made):
        async with engine.connect() as conn:
            row = (
                await conn.execute(
                    select(operations).where(operations.c.operation_id == item.row.operation_id)
                )
            ).one()
        assert item.operation == OperationRecord.of(row)
        assert item.operation.state == "SUBMITTING"
        assert item.version == row.version


async def test_a_plain_group_sends_no_read_and_one_under_a_mandate_reads_under_locks(
    engine: AsyncEngine,
) -> None:
    scene = Scene(engine)

    async def record(operation_ids: list[str]) -> list[str]:
        prepared = await presubmitted(scene, operation_ids)
        sent = [
            Sent(item, answer("succeeded", f"ch_{n}"), answered_now())
            for n, item in enumerate(prepared)
        ]
        statements, stop = counting(engine)
        try:
            assert len(await record_together(scene.worker.dispatcher, sent)) == len(sent)
        finally:
            stop()
        return statements

    before = replanned()
    plain = await record([await pay(scene, "bo", f"plain-{n}") for n in range(3)])
    under = await mandate(scene, "bo", "reads-mandate")
    held = await record([await pay(scene, "bo", f"held-{n}", mandate_id=under) for n in range(3)])
    if engine.dialect.name == "postgresql":
        # The settlement's one statement, and the read of who listens for its news.
        assert len(plain) == 2 and not reads_operations(plain), plain
    else:
        assert reads_operations(plain), plain
    assert reads_operations(held), held
    assert replanned() == before


def reads_operations(statements: list[str]) -> list[str]:
    return [
        s
        for s in statements
        if s.lstrip().upper().startswith("SELECT") and "FROM OPERATIONS" in s.upper()
    ]


async def test_an_operation_that_moved_on_is_settled_by_nothing_of_its_group(
    engine: AsyncEngine,
) -> None:
    scene = Scene(engine)
    dispatcher = scene.worker.dispatcher
    made = [await pay(scene, "cy", f"moved-{n}") for n in range(3)]
    prepared = await presubmitted(scene, made)
    # The middle one's answer was recorded first by the reference path (lost:
    # UNKNOWN), as a second answer or a webhook would move it on.
    moved = prepared[1]
    await dispatcher.record(moved.row, moved.submission, answer("lost", "-"))
    async with engine.connect() as conn:
        as_moved = await Ledger(conn).get_operation(moved.row.operation_id)
    before = replanned()
    sent = [
        Sent(item, answer("succeeded", f"ch_{n}"), answered_now())
        for n, item in enumerate(prepared)
    ]
    settled = await record_together(dispatcher, sent)

    assert settled == {id(sent[0]), id(sent[2])}
    assert replanned() - before == (1 if engine.dialect.name == "postgresql" else 0)
    async with engine.connect() as conn:
        ledger = Ledger(conn)
        assert await ledger.get_operation(moved.row.operation_id) == as_moved
        for operation_id in made:
            kinds = (
                (
                    await conn.execute(
                        select(observations.c.kind)
                        .where(observations.c.operation_id == operation_id)
                        .order_by(observations.c.id)
                    )
                )
                .scalars()
                .all()
            )
            # One submit result each: the rolled-back first plan left none.
            assert kinds == ["submit_result"], (operation_id, kinds)
        for item in (prepared[0], prepared[2]):
            operation = await ledger.get_operation(item.row.operation_id)
            assert operation is not None
            assert (operation.state, operation.outcome) == ("OUTCOME_KNOWN", "succeeded")
            assert operation.version == item.version + 1


# -- the ledger ends as the plan under locks leaves it ----------------------------------------

ANSWERS = ("succeeded", "declined", "lost", "pending", "not_executed")
# The answers a group settles itself; the others go to the reference path.
PLAIN = ("succeeded", "declined")
# What the reference path recorded for the operation before its group's record.
EARLIER = (None, None, "lost", "succeeded", "pending")

GroupRecord = Callable[[Dispatcher, Sequence[Sent]], Awaitable[set[int]]]


async def under_locks(dispatcher: Dispatcher, sent: Sequence[Sent]) -> set[int]:
    return await record_group(dispatcher, sent, read_under_lock=True)


async def story(
    scene: Scene, plan: Sequence[tuple[str, str | None]], group_record: GroupRecord
) -> list[tuple[Any, ...]]:
    """Pre-submit one payment per step of `plan`; record each step's earlier
    answer by the reference path; hand the group record the answers, and the
    reference path those it did not settle (as the settlement queue does).
    What the ledger holds of each payment, without its ids and keys."""
    actor = f"story-{next(_stories)}"
    # A merchant who hears of every change: the news is part of the ending.
    await add_endpoint(scene.engine, scene.clock, actor, "http://127.0.0.1:9/story")
    made = [await pay(scene, actor, f"{actor}-{n}") for n in range(len(plan))]
    prepared = await presubmitted(scene, made)
    dispatcher = scene.worker.dispatcher
    for item, (_, earlier) in zip(prepared, plan, strict=True):
        if earlier is not None:
            await dispatcher.record(item.row, item.submission, answer(earlier, "ch_earlier"))
    # Whether each operation moved on: an earlier answer that changed nothing
    # of the record (a pending one, say) leaves its version as it was.
    versions = [(await scene.operation(item.row.operation_id)).version for item in prepared]
    sent = [
        Sent(item, answer(kind, f"ch_{n}"), answered_now())
        for n, (item, (kind, _)) in enumerate(zip(prepared, plan, strict=True))
    ]
    before = replanned()
    settled = await group_record(dispatcher, sent)
    if group_record is record_together and scene.engine.dialect.name == "postgresql":
        # Planned from the pre-submits' records, and again under locks only
        # when one that moved on had an answer that settles it plainly.
        moved_on = any(
            version != item.version and kind in PLAIN
            for version, item, (kind, _) in zip(versions, prepared, plan, strict=True)
        )
        assert replanned() - before == (1 if moved_on else 0)
    for item in sent:
        if id(item) not in settled:
            await dispatcher.record(item.row, item.submission, item.answer)
    return [await ledger_of(scene.engine, operation_id, actor) for operation_id in made]


async def ledger_of(engine: AsyncEngine, operation_id: str, actor: str) -> tuple[Any, ...]:
    """What the ledger holds of a payment of `actor`'s, without its ids and keys."""

    async def rows(table: Any, columns: Sequence[str], order: Sequence[str]) -> list[Any]:
        """`columns` of the operation's rows of `table`, in `order`."""
        key = table.c.object_id if table is merchant_events else table.c.operation_id
        query = select(*(table.c[c] for c in columns)).where(key == operation_id)
        if table is outbox:
            query = query.where(outbox.c.done_at.is_(None))
        found = await conn.execute(query.order_by(*(table.c[c] for c in order)))
        return [tuple(row) for row in found]

    async with engine.connect() as conn:
        operation = await Ledger(conn).get_operation(operation_id)
        assert operation is not None
        seen = await rows(
            observations,
            ("kind", "verdict", "attempt_number", "provider_reference", "reason", "at"),
            ("id",),
        )
        moved = await rows(
            transitions,
            ("from_state", "to_state", "next_action", "reason", "source", "at"),
            ("id",),
        )
        tried = await rows(attempts, ("number", "relation", "submitted_at"), ("number",))
        news = await rows(merchant_events, ("type",), ("created_at", "event_id"))
        pending = await rows(outbox, ("kind",), ("id",))
    record = operation.as_dict()
    for name in ("operation_id", "idempotency_key", "actor", "request_hash", "request_context"):
        del record[name]
    return (
        record,
        seen,
        [(*r[:4], r[4].replace(actor, "<actor>"), r[5]) for r in moved],
        tried,
        sorted(news),
        pending,
    )


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    plan=st.lists(
        st.tuples(st.sampled_from(ANSWERS), st.sampled_from(EARLIER)), min_size=1, max_size=5
    )
)
async def test_a_group_record_ends_as_the_plan_under_locks_ends(
    engine: AsyncEngine, plan: list[tuple[str, str | None]]
) -> None:
    scene = Scene(engine)
    assert await story(scene, plan, record_together) == await story(scene, plan, under_locks)


@pytest.fixture
async def pg(databases: Databases) -> AsyncIterator[AsyncEngine]:
    """A fresh PostgreSQL ledger: SQLite's one writer leaves no group waiting
    on another's lock, and its groups are always planned under locks."""
    if "postgresql" not in BACKENDS:
        pytest.skip("PostgreSQL is not in INTENTLEDGER_TEST_BACKENDS")
    engine = create_ledger_engine(databases.create("postgresql"))
    yield engine
    await dispose(engine)


async def test_an_operation_moved_on_while_the_group_waits_for_its_lock_is_not_written(
    pg: AsyncEngine,
) -> None:
    """Another writer holds one operation's lock when the group's statement
    comes to it, and moves it on before letting go: the statement, which read
    the row before the lock was free, sees the version the writer left and
    changes nothing (PostgreSQL re-checks its condition on the newest row)."""
    scene = Scene(pg)
    made = [await pay(scene, "dee", f"waits-{n}") for n in range(3)]
    prepared = await presubmitted(scene, made)
    before = replanned()
    sent = [
        Sent(item, answer("succeeded", f"ch_{n}"), answered_now())
        for n, item in enumerate(prepared)
    ]
    async with pg.connect() as other:
        writer = await other.begin()
        ledger = Ledger(other)
        held = await ledger.lock_operation(made[1])
        assert held is not None
        recording = asyncio.create_task(record_together(scene.worker.dispatcher, sent))
        await asyncio.sleep(0.5)  # the group's statement is waiting on the lock
        assert not recording.done()
        await changes.transition(
            ledger,
            held,
            State.UNKNOWN,
            now=scene.clock(),
            next_action=NextAction.RECONCILE,
            reason="moved on by another writer",
            source="test",
        )
        await writer.commit()
    settled = await recording

    assert settled == {id(sent[0]), id(sent[2])}
    assert replanned() - before == 1
    states = [(await scene.operation(op)).state for op in made]
    assert states == ["OUTCOME_KNOWN", "UNKNOWN", "OUTCOME_KNOWN"]


async def test_the_group_statement_takes_its_operations_locks_in_key_order(
    pg: AsyncEngine,
) -> None:
    """Another writer holds the middle key of a group of three: the group's
    statement, waiting for it, holds the lowest key's lock and not yet the
    highest's, although the highest was made first (a statement that took
    its rows as they lie on disk would have locked it)."""
    scene = Scene(pg)
    made: list[str] = []
    chosen = None
    while chosen is None and len(made) < 30:  # ids are random: a few make one
        made.append(await pay(scene, "fay", f"order-{len(made)}"))
        chosen = _made_before_the_middle(made)
    assert chosen is not None
    low, middle, high = sorted(chosen)
    prepared = await presubmitted(scene, [high, low, middle])
    sent = [
        Sent(item, answer("succeeded", f"ch_{n}"), answered_now())
        for n, item in enumerate(prepared)
    ]
    async with pg.connect() as other:
        await other.begin()
        assert await Ledger(other).lock_operation(middle) is not None
        recording = asyncio.create_task(record_together(scene.worker.dispatcher, sent))
        await asyncio.sleep(0.5)  # the group's statement is waiting on the middle key
        assert not recording.done()
        assert await held_by_another(pg, low)
        assert not await held_by_another(pg, high)
        await other.rollback()
    assert len(await recording) == 3


def _made_before_the_middle(made: list[str]) -> list[str] | None:
    """Three of `made` whose highest key was made before their middle one."""
    for high in made:
        for middle in made[made.index(high) + 1 :]:
            lower = [key for key in made if key < middle and key != high]
            if middle < high and lower:
                return [lower[0], middle, high]
    return None


async def held_by_another(engine: AsyncEngine, operation_id: str) -> bool:
    async with engine.connect() as conn, conn.begin():
        found = await conn.execute(
            select(operations.c.operation_id)
            .where(operations.c.operation_id == operation_id)
            .with_for_update(skip_locked=True)
        )
        return found.first() is None


# Every statement that writes `operations`, by the function it is in: each of
# these but retention's writes the values `changes.plan` made, which move the
# version. A group record planned without a read relies on that (the same
# version is the same row): a writer added here must move the version too.
OPERATION_WRITERS = {
    ("store/ledger.py", "write_operation_change"),
    ("store/batches.py", "_write_stepwise"),
    ("store/batches.py", "_changes_sql"),
    # Record retention: only settled operations, which no group record writes.
    ("store/reaping.py", "_reap"),
}
_WRITES_OPERATIONS = re.compile(
    r"\bupdate\(\s*(tables\.)?operations\b|\bUPDATE\s+operations\b|\boperations\.update\(",
    re.IGNORECASE,
)


def test_every_writer_of_an_operation_is_one_that_moves_its_version() -> None:
    source = Path(intentledger.__file__).parent
    found: set[tuple[str, str]] = set()
    for path in source.rglob("*.py"):
        name = path.relative_to(source).as_posix()
        if name.startswith("store/migrations/"):
            continue  # run before any worker of their version starts
        text = path.read_text()
        functions = [
            node
            for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        ]
        for match in _WRITES_OPERATIONS.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            inside = [f for f in functions if f.lineno <= line <= (f.end_lineno or f.lineno)]
            innermost = max(inside, key=lambda f: f.lineno).name if inside else "<module>"
            found.add((name, innermost))
    assert found == OPERATION_WRITERS
