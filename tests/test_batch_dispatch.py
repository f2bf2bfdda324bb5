"""Batched first attempts write what one-by-one delivery writes, on both databases.

The one-at-a-time dispatcher is the reference; a batch must leave every
operation with the same story (state, attempts, observations, transitions,
decisions, outbox rows, provider requests) and hand anything unusual to it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.engine import mandates
from intentledger.engine.batch_dispatch import deliver_submits
from intentledger.engine.worker import Worker
from intentledger.store.batches import BatchLedger
from intentledger.store.ledger import Ledger
from intentledger.store.tables import (
    attempts,
    decisions,
    observation_details,
    observations,
    observations_with_detail,
    outbox,
    transitions,
)
from tests.test_dispatch import (
    MovableClock,
    accept,
    make_worker,
    operation,
    rows,
    sandbox_charges,
    sandbox_submits,
)
from tests.test_mandate_money import books, pay

SCENARIOS = (
    "pm_ok",
    "pm_declined",
    "pm_timeout_after_execute",
    "pm_timeout_before_execute",
    "pm_unavailable",
    "pm_rate_limited",
)


# Differ between any two operations: their ids and instants, and what names them
# (the `detail` of an answer is the provider's charge, ids and instants included).
UNCOMPARED = {
    "id",
    "operation_id",
    "at",
    "submitted_at",
    "retry_after_at",
    "provider_reference",
    "detail",
}


def columns(row: Any, operation_id: str) -> dict[str, Any]:
    """A row's columns but the uncompared; the operation's id cut out of the rest."""
    return {
        name: value.removeprefix(operation_id) if isinstance(value, str) else value
        for name, value in row._mapping.items()
        if name not in UNCOMPARED
    }


async def detail_rows(engine: AsyncEngine, operation_id: str) -> list[bool]:
    """Per observation, whether it has a provider answer row (the join reads a
    missing one as None, as it reads a JSON null)."""
    async with engine.connect() as conn:
        result = await conn.execute(
            select(observation_details.c.observation_id.is_not(None))
            .select_from(
                observations.outerjoin(
                    observation_details, observation_details.c.observation_id == observations.c.id
                )
            )
            .where(observations.c.operation_id == operation_id)
            .order_by(observations.c.id)
        )
        return list(result.scalars())


TIMERS = ("aiohttp.SocketTimeoutError", "builtins.TimeoutError")


def _timer(error_class: str | None) -> str | None:
    return "a timeout" if error_class in TIMERS else error_class


def _timers_in(text: str | None) -> str | None:
    for timer in TIMERS:
        text = text.replace(timer, "a timeout") if text else text
    return text


async def story(engine: AsyncEngine, sandbox: str, operation_id: str) -> dict[str, Any]:
    """Everything a reviewer would read about an operation, minus ids and times."""
    op = await operation(engine, operation_id)
    return {
        "operation": (
            op.state,
            op.outcome,
            op.next_action,
            op.provider_reference is not None,
            op.first_attempt_at is not None,
            op.duplicate_detected,
            op.version,
        ),
        "attempts": [columns(a, operation_id) for a in await rows(engine, attempts, operation_id)],
        "observations": [
            {
                **columns(o, operation_id),
                # Which timer names a withheld answer (httpx's read timeout, or the
                # whole call's deadline a little later) depends on the machine's
                # load, not on the path that recorded it.
                "error_class": _timer(o.error_class),
                "reason": _timers_in(o.reason),
                "has_provider_reference": o.provider_reference is not None,
                "has_retry_after_at": o.retry_after_at is not None,
                "detail": sorted(o.detail) if isinstance(o.detail, dict) else o.detail,
            }
            for o in await rows(engine, observations_with_detail, operation_id)
        ],
        "observation_detail_rows": await detail_rows(engine, operation_id),
        "transitions": [
            columns(t, operation_id)
            for t in await rows(engine, transitions, operation_id)
            if "next check" not in t.reason  # UNKNOWN's reason names a time
        ],
        "decisions": [(d.rule, d.next_action) for d in await rows(engine, decisions, operation_id)],
        "outbox": [
            (r.kind, r.done_at is not None) for r in await rows(engine, outbox, operation_id)
        ],
        "provider_submits": len(sandbox_submits(sandbox, operation_id)),
        "provider_charges": len(sandbox_charges(sandbox, operation_id)),
    }


async def deliver_in_one_batch(worker: Worker, expected: int) -> None:
    assert await worker.deliver_batch(limit=100) == expected


async def test_a_batch_writes_what_one_by_one_delivery_writes(
    engine: AsyncEngine, sandbox: str
) -> None:
    clock = MovableClock()
    one_by_one = {m: await accept(engine, clock, m, key=f"single-{m}") for m in SCENARIOS}
    await make_worker(engine, sandbox, clock, timeout=0.5, worker="w").drain()
    batched = {m: await accept(engine, clock, m, key=f"batched-{m}") for m in SCENARIOS}
    # Answers are grouped by arrival: a window longer than the slowest call
    # (0.5 s) makes the group whatever the machine's pace.
    together = make_worker(
        engine, sandbox, clock, timeout=0.5, worker="w", record_window=timedelta(seconds=2)
    )
    await deliver_in_one_batch(together, 6)

    for method in SCENARIOS:
        reference = await story(engine, sandbox, one_by_one[method])
        assert await story(engine, sandbox, batched[method]) == reference, method
    # And it was a batch: one pre-submit transaction, one record transaction
    # for the answers that settle.
    submitted = {
        a.submitted_at for op in batched.values() for a in await rows(engine, attempts, op)
    }
    assert len(submitted) == 1
    settled = {(await rows(engine, observations, batched[m]))[0].at for m in SCENARIOS[:2]}
    assert len(settled) == 1
    # The scenarios cover every way a first answer goes.
    states = {(await operation(engine, op_id)).state for op_id in batched.values()}
    assert states == {"OUTCOME_KNOWN", "UNKNOWN", "ACCEPTED"}


async def test_a_batch_hands_a_resumed_submitting_to_the_reference_path(
    engine: AsyncEngine, sandbox: str
) -> None:
    clock = MovableClock()
    resumed = await accept(engine, clock, "pm_ok", key="resumed")
    first = make_worker(engine, sandbox, clock, lease=timedelta(seconds=30), worker="first")
    async with engine.begin() as conn:
        row = await Ledger(conn).claim_outbox_row(clock(), timedelta(seconds=30), "first")
    assert row is not None and await first.dispatcher._pre_submit(row) is not None  # then dies
    plain = await accept(engine, clock, "pm_ok", key="plain")

    clock.advance(timedelta(seconds=31))
    await deliver_in_one_batch(make_worker(engine, sandbox, clock, worker="second"), 2)
    op = await operation(engine, resumed)
    assert (op.state, op.next_action) == ("UNKNOWN", "reconcile")
    assert sandbox_submits(sandbox, resumed) == []  # never called again
    assert [o.kind for o in await rows(engine, observations, resumed)] == ["resumed_submitting"]
    assert (await operation(engine, plain)).outcome == "succeeded"


async def test_a_batch_settles_mandate_reservations(engine: AsyncEngine, sandbox: str) -> None:
    clock = MovableClock()
    keyed = mandates.Keyed("ana", mandates.CREATE_ROUTE, "md", "h")
    md, _ = await mandates.create_mandate(
        engine, clock, keyed, {"currency": "EUR", "max_amount": 1000, "total_limit": 10_000}
    )
    await pay(engine, clock, md.mandate_id, "pm_ok", 100)
    await pay(engine, clock, md.mandate_id, "pm_declined", 200)
    lost = await pay(engine, clock, md.mandate_id, "pm_timeout_after_execute", 400)
    assert await books(engine, md.mandate_id) == (700, 0)
    await deliver_in_one_batch(make_worker(engine, sandbox, clock, timeout=0.3), 3)
    assert (await operation(engine, lost)).state == "UNKNOWN"
    assert await books(engine, md.mandate_id) == (400, 100)  # the unknown stays held


async def test_a_suspended_mandate_cancels_instead_of_sending(
    engine: AsyncEngine, sandbox: str
) -> None:
    clock = MovableClock()
    keyed = mandates.Keyed("ana", mandates.CREATE_ROUTE, "md", "h")
    md, _ = await mandates.create_mandate(
        engine, clock, keyed, {"currency": "EUR", "max_amount": 1000, "total_limit": 10_000}
    )
    op_id = await pay(engine, clock, md.mandate_id, "pm_ok", 100)
    worker = make_worker(engine, sandbox, clock, worker="w")
    async with engine.begin() as conn:
        claimed = await BatchLedger(conn).claim_outbox_rows(clock(), timedelta(minutes=5), "w", 10)
    assert [r.operation_id for r in claimed] == [op_id]
    # Suspended between the claim and the pre-submit: the payment is cancelled
    # by the suspension, and the batch must not send it.
    change = mandates.Keyed("ana", "POST /v1/mandates/{id}/suspend", "s", "h")
    await mandates.change_status(engine, clock, change, md.mandate_id, "suspend")
    await deliver_submits(worker.dispatcher, claimed)
    assert (await operation(engine, op_id)).state == "CANCELLED"
    assert sandbox_submits(sandbox, op_id) == []
    assert await books(engine, md.mandate_id) == (0, 0)


async def test_claims_take_the_earliest_due_rows_up_to_the_limit(engine: AsyncEngine) -> None:
    clock = MovableClock()
    created = [await accept(engine, clock, "pm_ok", key=f"k{i}") for i in range(5)]
    async with engine.begin() as conn:
        first = await BatchLedger(conn).claim_outbox_rows(clock(), timedelta(minutes=5), "a", 3)
    async with engine.begin() as conn:
        second = await BatchLedger(conn).claim_outbox_rows(clock(), timedelta(minutes=5), "b", 3)
    assert [r.operation_id for r in first] == created[:3]
    assert [r.operation_id for r in second] == created[3:]
    async with engine.connect() as conn:
        leased = (await conn.execute(select(outbox.c.lease_owner, outbox.c.deliveries))).all()
    assert sorted(leased) == [("a", 1)] * 3 + [("b", 1)] * 2


async def test_a_batch_of_a_success_and_a_decline_settles_as_one_shape_of_rows(
    engine: AsyncEngine, sandbox: str, monkeypatch: Any
) -> None:
    """A success sets columns a decline does not (the reference it adopts, the
    executions, the live keys): the batch still writes one set of columns, so
    PostgreSQL settles it in one statement (`changes.alike`)."""
    shapes: list[list[tuple[str, ...]]] = []
    write = BatchLedger._write_changes

    async def spy(self: BatchLedger, writes: Any, *args: Any, **kwargs: Any) -> None:
        shapes.append(sorted({tuple(w.values) for w in writes}))
        await write(self, writes, *args, **kwargs)

    monkeypatch.setattr(BatchLedger, "_write_changes", spy)
    clock = MovableClock()
    ok = await accept(engine, clock, "pm_ok", key="ok")
    declined = await accept(engine, clock, "pm_declined", key="declined")
    window = timedelta(seconds=1)  # both answers in one group, however far apart they arrive
    await deliver_in_one_batch(
        make_worker(engine, sandbox, clock, worker="w", record_window=window), 2
    )
    begin, settle = shapes
    assert len(begin) == 1 and len(settle) == 1, shapes
    async with engine.connect() as conn:
        ledger = Ledger(conn)
        succeeded, failed = await ledger.get_operation(ok), await ledger.get_operation(declined)
    assert succeeded is not None and failed is not None
    assert (succeeded.outcome, failed.outcome) == ("succeeded", "failed")
    assert succeeded.executed_references == [succeeded.provider_reference]
    assert (failed.provider_reference, failed.executed_references, failed.live_keys) == (
        None,
        None,
        0,
    )
