"""A batch's pre-submit and record writes, as one statement each on PostgreSQL,
write exactly what the stepwise statements write (the path SQLite takes).

Both paths get the same instant, worker and answers, each for its own pair of
operations; every row they leave must match column for column but for ids and
what names the operation. On SQLite both sides are the stepwise path.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import event, select
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.canonical import request_hash
from intentledger.domain.dispatch_plan import AttemptPlan
from intentledger.domain.states import NextAction, State
from intentledger.engine import changes, intake, mandates
from intentledger.engine.dispatcher import begin_attempt
from intentledger.engine.intake import Intent
from intentledger.store.batches import BatchLedger
from intentledger.store.tables import (
    attempts,
    observation_details,
    observations,
    observations_with_detail,
    operations,
    outbox,
    transitions,
)
from tests.test_dispatch import ROUTE, MovableClock, accept

SOURCE = "worker:test"
# What differs between two operations accepted one after the other.
NAMING = {"id", "operation_id", "idempotency_key", "created_at", "provider_idempotency_key"}


def answer(operation_id: str, detail: dict[str, Any] | None) -> dict[str, Any]:
    """A success's observation row (of an operation `accept` made: alice's);
    `detail` None is what an empty body leaves."""
    return {
        "operation_id": operation_id,
        "actor": "alice",
        "at": NOW,
        "kind": "submit_result",
        "source": SOURCE,
        "attempt_number": 1,
        "transport": "response",
        "error_class": None,
        "http_status": 200,
        "verdict": "succeeded",
        "reason": "provider answered 200",
        "provider_reference": f"ch_{operation_id[-6:]}",
        "retry_after_raw": None,
        "retry_after_at": None,
        "retry_after_problem": None,
        "detail": detail,
    }


NOW = datetime(2026, 11, 30, 9, 0, 0, 123456, tzinfo=UTC)
DETAILS = (None, {"id": "ch_1", "amount": 500, "note": "café"})


async def write(
    ledger: BatchLedger,
    one_statement: bool,
    planned: list[changes.OperationChange],
    *,
    unlocked: bool = False,
    **rows: Any,
) -> int | None:
    writes = [change.rows for change in planned]
    if one_statement:
        return await ledger._write_in_one_statement(
            writes,
            NOW,
            rows.get("attempt_rows", ()),
            rows.get("observation_rows", ()),
            rows.get("done_outbox_rows", ()),
            unlocked,
        )
    return await ledger._write_stepwise(
        {tuple(writes[0].values): writes},
        NOW,
        rows.get("attempt_rows", ()),
        rows.get("observation_rows", ()),
        rows.get("done_outbox_rows", ()),
    )


async def submit_and_settle(engine: AsyncEngine, ids: list[str], one_statement: bool) -> None:
    async with engine.begin() as conn:
        ledger = BatchLedger(conn)
        locked = list((await ledger.lock(ids)).operations.values())
        begun = [
            begin_attempt(op, AttemptPlan(1, f"{op.operation_id}:1", None), None, NOW, SOURCE)
            for op in locked
        ]
        written = await write(
            ledger,
            one_statement,
            [change for _, change in begun],
            attempt_rows=[attempt for attempt, _ in begun],
        )
        assert written == len(ids)
    async with engine.begin() as conn:
        ledger = BatchLedger(conn)
        submitting = (await ledger.lock(ids)).operations
        row_ids = {
            row.operation_id: row.id
            for row in await conn.execute(
                select(outbox.c.operation_id, outbox.c.id).where(outbox.c.operation_id.in_(ids))
            )
        }
        settled = await write(
            ledger,
            one_statement,
            # As a group record planned without a read sends it: the
            # operations locked first (again, here) by the statement itself.
            unlocked=one_statement,
            planned=[
                changes.plan(
                    submitting[operation_id],
                    State.OUTCOME_KNOWN,
                    now=NOW,
                    next_action=NextAction.NONE,
                    reason="provider answered 200",
                    source=SOURCE,
                    outcome="succeeded",
                    last_observed_at=NOW,
                    retry_after_at=None,
                    executed_references=[f"ch_{operation_id[-6:]}"],
                    provider_reference=f"ch_{operation_id[-6:]}",
                    live_keys=1,
                )
                for operation_id in ids
            ],
            observation_rows=[
                answer(operation_id, detail)
                for operation_id, detail in zip(ids, DETAILS, strict=True)
            ],
            done_outbox_rows=[row_ids[operation_id] for operation_id in ids],
        )
        assert settled in (len(ids), None)  # None: SQLite reports no executemany count


def comparable(value: Any, operation_id: str) -> Any:
    """A column's value with what differs between the two operations taken out:
    their ids, and the instants of their intake (everything after is NOW)."""
    if isinstance(value, str):
        return value.replace(operation_id[-6:], "")
    if isinstance(value, list):
        return [comparable(item, operation_id) for item in value]
    if isinstance(value, datetime) and value != NOW:
        return "the intake's instant"
    return value


async def written(engine: AsyncEngine, operation_id: str) -> dict[str, Any]:
    """Every row of the operation, its naming columns left out, and whether each
    observation has a provider answer row (the join reads a missing one as None)."""
    found: dict[str, Any] = {}
    async with engine.connect() as conn:
        for table in (operations, attempts, observations_with_detail, transitions, outbox):
            result = await conn.execute(select(table).where(table.c.operation_id == operation_id))
            found[table.name] = sorted(
                (
                    {
                        name: comparable(value, operation_id)
                        for name, value in row._mapping.items()
                        if name not in NAMING
                    }
                    for row in result
                ),
                key=repr,
            )
        answered = await conn.execute(
            select(observation_details.c.observation_id.is_not(None))
            .select_from(
                observations.outerjoin(
                    observation_details, observation_details.c.observation_id == observations.c.id
                )
            )
            .where(observations.c.operation_id == operation_id)
        )
        found["has_detail_row"] = list(answered.scalars())
    return found


async def test_one_statement_writes_what_the_stepwise_statements_write(
    engine: AsyncEngine,
) -> None:
    clock = MovableClock()
    stepwise = [await accept(engine, clock, "pm_ok") for _ in DETAILS]
    single = [await accept(engine, clock, "pm_ok") for _ in DETAILS]
    await submit_and_settle(engine, stepwise, one_statement=False)
    await submit_and_settle(engine, single, one_statement=engine.dialect.name == "postgresql")

    for reference, candidate, detail in zip(stepwise, single, DETAILS, strict=True):
        expected = await written(engine, reference)
        assert expected["operations"][0]["state"] == "OUTCOME_KNOWN"
        # An answer row only for an answer, and it reads back as written.
        assert expected["has_detail_row"] == [detail is not None]
        assert expected["observations_with_detail"][0]["detail"] == detail
        assert expected["outbox"][0]["done_at"] == NOW
        assert await written(engine, candidate) == expected


async def test_a_batch_without_a_mandate_is_locked_in_one_statement(engine: AsyncEngine) -> None:
    """`BatchLedger.lock` locks operations none of which has a mandate in one
    statement; a batch with one under a mandate locks the mandate too, first."""
    clock = MovableClock()
    plain = [await accept(engine, clock, "pm_ok") for _ in range(2)]
    keyed = mandates.Keyed("alice", mandates.CREATE_ROUTE, "md-lock", "h-lock")
    mandate, _ = await mandates.create_mandate(
        engine, clock, keyed, {"currency": "EUR", "max_amount": 1000, "total_limit": 10_000}
    )
    body = {
        "amount": 10,
        "currency": "EUR",
        "payment_method": "pm_ok",
        "metadata": {},
        "mandate_id": mandate.mandate_id,
    }
    intent = Intent("alice", ROUTE, "lock-p", request_hash("alice", ROUTE, body), body, "sandbox")
    under_mandate = str((await intake.accept(engine, clock, intent)).operation["operation_id"])

    sent: list[str] = []

    def count(*args: Any) -> None:
        # Not SQLite's BEGIN, which the engine sends itself (store/database.py).
        if not args[2].startswith("BEGIN"):
            sent.append(args[2])

    event.listen(engine.sync_engine, "before_cursor_execute", count)
    try:
        async with engine.begin() as conn:
            alone = await BatchLedger(conn).lock(plain)
        statements_alone = len(sent)
        async with engine.begin() as conn:
            mixed = await BatchLedger(conn).lock([*plain, under_mandate])
    finally:
        event.remove(engine.sync_engine, "before_cursor_execute", count)
    assert sorted(alone.operations) == sorted(plain) and alone.mandates == {}
    assert statements_alone == 1
    assert sorted(mixed.operations) == sorted([*plain, under_mandate])
    assert list(mixed.mandates) == [mandate.mandate_id]
    assert "mandates" in sent[-2] and sent[-1].lstrip().startswith("SELECT operations.")
