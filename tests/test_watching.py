"""Never stop watching a key that may still move money: one regression per rule.

Each story runs the real engine on SQLite and PostgreSQL against the watching
model's scripted, Stripe-shaped provider (tests/test_watching_model.py), and
each failed on the main of 3 December: the audit stopped at a charge still
processing, looked inside the search's lag and stopped, approved a new key the
mandate had no room for, and freed a refund a person called failed while the
provider still showed it pending.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest
from alembic import command
from sqlalchemy import MetaData, Table, func, insert, select, text, update
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.canonical import request_hash
from intentledger.domain.evidence import AUDIT_LOOKS
from intentledger.domain.retention import sandbox_policy
from intentledger.domain.states import NextAction, Outcome, State
from intentledger.engine import mandates, operator, refunds
from intentledger.engine.intake import Intent, accept
from intentledger.engine.operator import NoRoomForANewKey, OperatorAction
from intentledger.store.database import create_sync_engine
from intentledger.store.ledger import Ledger
from intentledger.store.migrate import alembic_config, upgrade
from intentledger.store.tables import attempts, decisions
from tests.conftest import Databases
from tests.test_partitions import AT, _fresh_at, _settled_payment
from tests.test_recovery_model import ControlledClock, build_worker
from tests.test_watching_model import RULES, ScriptedProvider

ROUTE = "POST /v1/payments"
AMOUNT = 500
SECOND = timedelta(seconds=1)
TABLE_NAMES = ("mandates", "operations", "attempts", "outbox", "decisions")


class Story:
    def __init__(self, engine: AsyncEngine, lag: timedelta = timedelta(seconds=45)) -> None:
        self.engine = engine
        self.clock = ControlledClock()
        self.provider = ScriptedProvider(self.clock)
        # The stories' minutes, not the model's hour: its lookups start its server lazily.
        self.provider.lag = lag
        self.worker = build_worker(engine, self.provider, self.clock, RULES)  # type: ignore[arg-type]

    async def pay(self, key: str, mandate_id: str | None = None) -> str:
        body: dict[str, Any] = {
            "amount": AMOUNT,
            "currency": "EUR",
            "payment_method": "pm_model",
            "metadata": {},
        }
        if mandate_id is not None:
            body["mandate_id"] = mandate_id
        intent = Intent("alice", ROUTE, key, request_hash("alice", ROUTE, body), body, "sandbox")
        return (await accept(self.engine, self.clock, intent)).operation_id

    async def refund(self, payment_id: str, key: str) -> str:
        body = {"payment_id": payment_id}
        route = refunds.REFUND_ROUTE
        intent = Intent(
            "alice", route, key, request_hash("alice", route, body), body, "sandbox", "refund"
        )
        result = await refunds.accept_refund(self.engine, self.clock, intent, payment_id)
        return result.operation_id

    async def drain(self, submit: str = "succeed") -> None:
        self.provider.submit_mode = submit
        await self.worker.drain()

    async def later(self, delta: timedelta, submit: str = "succeed") -> None:
        self.clock.advance(delta)
        await self.drain(submit)

    async def operation(self, operation_id: str) -> Any:
        async with self.engine.connect() as conn:
            return await Ledger(conn).get_operation(operation_id)

    async def act(self, action: operator.Action) -> str:
        done, _ = await operator.perform(self.engine, self.clock, action)
        return done

    async def escalate(self, operation_id: str) -> None:
        action = OperatorAction(operation_id, "olive", "taking a look")
        await self.act(lambda ledger, now: operator.escalate(ledger, now, action))

    async def approve(self, operation_id: str) -> str:
        action = OperatorAction(operation_id, "olive", "customer asked to try again")

        def approve(ledger: Ledger, now: datetime) -> Any:
            policy = sandbox_policy(timedelta(hours=24))
            return operator.approve_resubmission(ledger, now, action, lambda _p: policy)

        return await self.act(approve)

    async def resolve(self, operation_id: str, outcome: Outcome) -> None:
        action = OperatorAction(operation_id, "olive", "read the dashboard")
        await self.act(lambda ledger, now: operator.resolve(ledger, now, action, outcome))

    async def count(self, table: Any, operation_id: str) -> int:
        async with self.engine.connect() as conn:
            query = select(func.count()).where(table.c.operation_id == operation_id)
            return int((await conn.execute(query)).scalar_one())


async def test_a_second_charge_still_processing_at_the_audit_is_flagged_when_it_succeeds(
    engine: AsyncEngine,
) -> None:
    story = Story(engine)
    op_id = await story.pay("pay-1")
    await story.drain("lose_after")  # pi_1 processing, its answer lost
    await story.escalate(op_id)
    await story.approve(op_id)
    await story.drain("succeed")  # the new key: pi_2 succeeded, answered
    op = await story.operation(op_id)
    assert (op.state, op.outcome, op.watch) == (State.OUTCOME_KNOWN, Outcome.SUCCEEDED, "watching")
    first, second = story.provider.objects
    # The audit looks past the search's lag: pi_1 is there, still processing.
    await story.later(timedelta(minutes=1))
    op = await story.operation(op_id)
    assert first.status == "processing" and op.watch == "watching", "stopped at a charge not final"
    first.status = "succeeded"  # ... and then it succeeds, with no webhook
    for _ in range(3):
        await story.later(timedelta(minutes=5))
    op = await story.operation(op_id)
    assert op.duplicate_detected  # on the work queue by its flag
    assert sorted(op.executed_references) == [first.id, second.id]
    assert op.watch == "quiet"


async def test_an_audit_inside_the_lag_after_a_new_key_keeps_looking_and_finds_the_charge(
    engine: AsyncEngine,
) -> None:
    # A search that lags two minutes: longer than the audit's first wait (30 s).
    story = Story(engine, lag=timedelta(minutes=2))
    op_id = await story.pay("pay-1")
    await story.drain("lose_after_succeed")  # pi_1 executed, its answer lost
    await story.escalate(op_id)
    await story.approve(op_id)
    await story.drain("succeed")  # pi_2 executed and answered: settled on it
    await story.later(31 * SECOND)  # the audit: pi_2 by id, pi_1 not in the search yet
    op = await story.operation(op_id)
    assert not op.duplicate_detected and op.watch == "watching", "stopped inside the lag"
    for _ in range(3):
        await story.later(timedelta(minutes=2))
    op = await story.operation(op_id)
    assert op.duplicate_detected, "two charges, never flagged"
    assert op.watch == "quiet"


async def test_a_new_key_under_a_mandate_with_no_room_is_refused_and_nothing_is_sent(
    engine: AsyncEngine,
) -> None:
    story = Story(engine)
    keyed = mandates.Keyed("alice", mandates.CREATE_ROUTE, "md", "h")
    limits = {"currency": "EUR", "max_amount": AMOUNT, "total_limit": 2 * AMOUNT}
    mandate, _ = await mandates.create_mandate(engine, story.clock, keyed, limits)
    lost = await story.pay("pay-1", mandate.mandate_id)
    await story.drain("lose_after")  # may still execute
    await story.pay("pay-2", mandate.mandate_id)  # takes the rest of the limit
    await story.escalate(lost)
    sent = len(story.provider.objects)
    with pytest.raises(NoRoomForANewKey) as refused:
        await story.approve(lost)
    assert refused.value.status == 409 and "total_limit" in refused.value.detail
    await story.drain("succeed")
    assert len([o for o in story.provider.of(lost)]) == 1, "a new key was sent"
    assert len(story.provider.objects) == sent + 1  # only pay-2's first attempt
    assert await story.count(attempts, lost) == 1
    op = await story.operation(lost)
    assert (op.state, op.next_action, op.live_keys) == (State.MANUAL_REVIEW, "operator", 1)
    async with engine.connect() as conn:
        rules = [
            r.rule
            for r in await conn.execute(
                select(decisions.c.rule).where(decisions.c.operation_id == lost)
            )
        ]
    assert "operator_approved_new_request" not in rules


async def test_a_refund_a_person_calls_failed_while_the_provider_shows_it_pending_stays_held(
    engine: AsyncEngine,
) -> None:
    story = Story(engine)
    payment = await story.pay("pay-1")
    await story.drain("succeed")
    refund = await story.refund(payment, "refund-1")
    await story.drain("lose_after")  # the refund is pending at the provider, answer lost
    await story.resolve(refund, Outcome.FAILED)
    # Every look shows the refund pending: past the budget a person is told,
    # the amount stays held, and the looks go on.
    for _ in range(AUDIT_LOOKS + 2):
        await story.later(timedelta(hours=7))
    op = await story.operation(refund)
    assert (op.state, op.outcome) == (State.OUTCOME_KNOWN, Outcome.FAILED)
    assert (op.watch, op.next_action) == ("provider_not_final", NextAction.OPERATOR)
    with pytest.raises(refunds.RefundRefused) as refused:
        await story.refund(payment, "refund-2")
    assert refused.value.slug == "nothing-to-refund"
    # The provider pays it out after all: the person's "failed" is contradicted,
    # and the money was never offered twice.
    story.provider.objects[-1].status = "succeeded"
    await story.later(timedelta(hours=7))
    op = await story.operation(refund)
    assert op.outcome_contradicted and op.watch == "quiet"
    with pytest.raises(refunds.RefundRefused):
        await story.refund(payment, "refund-3")


def test_migration_0017_holds_every_live_key_and_gives_it_back_on_downgrade(
    backend: str, databases: Databases
) -> None:
    """Operations with a verification look due become watched, unresolved and
    watched ones count every distinct key they sent as live, and each mandate's
    `reserved` moves by its payments' new shares less their old ones."""
    url = databases.create(backend)
    _fresh_at(url, "0016")
    engine = create_sync_engine(url)
    with engine.begin() as conn:
        table = {n: Table(n, MetaData(), autoload_with=conn) for n in TABLE_NAMES}
        conn.execute(
            insert(table["mandates"]).values(
                mandate_id="md",
                actor="dora",
                currency="EUR",
                max_amount=AMOUNT,
                total_limit=10 * AMOUNT,
                reserved=2 * AMOUNT,  # the two unresolved payments', by 0016's rule
                spent=AMOUNT,  # the plain success's
                status="active",
                version=1,
                created_at=AT,
                updated_at=AT,
            )
        )
        for operation_id, state, outcome, keys, audit_due in (
            ("op_two_keys", "UNKNOWN", None, 2, False),  # +1 key held
            ("op_said_failed", "OUTCOME_KNOWN", "failed", 1, True),  # +1: watched
            ("op_plain", "OUTCOME_KNOWN", "succeeded", 1, False),  # unchanged
            ("op_approved", "MANUAL_REVIEW", None, 1, False),  # +1: approved, not sent
        ):
            conn.execute(
                insert(table["operations"])
                .values(
                    **_settled_payment(operation_id),
                    amount=AMOUNT,
                    currency="EUR",
                    mandate_id="md",
                )
                .values(
                    state=state,
                    outcome=outcome,
                    provider_reference="pi_plain" if outcome == "succeeded" else None,
                )
            )
            for number in range(1, keys + 1):
                conn.execute(
                    insert(table["attempts"]).values(
                        operation_id=operation_id,
                        number=number,
                        provider_idempotency_key=f"{operation_id}:{number}",
                        submitted_at=AT,
                        relation="original",
                        source="t",
                    )
                )
            if operation_id == "op_approved":
                conn.execute(
                    insert(table["decisions"]).values(
                        operation_id=operation_id,
                        at=AT,
                        rule="operator_approved_new_request",
                        inputs={"provider_idempotency_key": "op_approved:2"},
                        next_action="resubmit",
                        reason="approved",
                        source="operator:olive",
                    )
                )
                conn.execute(
                    update(table["operations"])
                    .where(table["operations"].c.operation_id == operation_id)
                    .values(next_action="resubmit")
                )
            if audit_due:
                conn.execute(
                    insert(table["outbox"]).values(
                        operation_id=operation_id,
                        kind="audit",
                        due_at=AT,
                        deliveries=0,
                        created_at=AT,
                    )
                )

    def books() -> tuple[int, int]:
        with engine.connect() as conn:
            row = conn.execute(text("SELECT reserved, spent FROM mandates")).one()
        return int(row.reserved), int(row.spent)

    upgrade(url)
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT operation_id, watch, live_keys FROM operations"))
        recorded = {r.operation_id: (r.watch, r.live_keys) for r in rows}
    assert recorded == {
        "op_two_keys": (None, 2),
        "op_said_failed": ("watching", 1),
        "op_plain": (None, 0),
        "op_approved": (None, 2),
    }
    assert books() == (5 * AMOUNT, AMOUNT)
    command.downgrade(alembic_config(url), "0016")
    assert books() == (2 * AMOUNT, AMOUNT)
    upgrade(url)
    assert books() == (5 * AMOUNT, AMOUNT)
    engine.dispose()


async def test_a_resolution_before_the_approved_key_is_sent_holds_one_key(
    engine: AsyncEngine,
) -> None:
    """A person approves a new key, then resolves the payment before it is sent:
    the key will never be sent, so only attempt 1's key stays held. (The
    resolution's decision is planned beside the funnel's effect; the funnel must
    read it as the latest, as it read it once it was written first.)"""
    story = Story(engine)
    keyed = mandates.Keyed("alice", mandates.CREATE_ROUTE, "md", "h")
    limits = {"currency": "EUR", "max_amount": AMOUNT, "total_limit": 4 * AMOUNT}
    mandate, _ = await mandates.create_mandate(engine, story.clock, keyed, limits)
    op_id = await story.pay("pay-1", mandate.mandate_id)
    await story.drain("lose_after")  # attempt 1 may have executed
    await story.escalate(op_id)
    await story.approve(op_id)  # key 2 authorised, not sent yet
    op = await story.operation(op_id)
    assert (op.next_action, op.live_keys) == (NextAction.RESUBMIT, 2)
    async with engine.connect() as conn:
        books_before = (await conn.execute(text("SELECT reserved, spent FROM mandates"))).one()
    assert tuple(books_before) == (2 * AMOUNT, 0)
    await story.resolve(op_id, Outcome.FAILED)
    op = await story.operation(op_id)
    assert op.state == State.OUTCOME_KNOWN
    assert op.live_keys == 1
    async with engine.connect() as conn:
        books_after = (await conn.execute(text("SELECT reserved, spent FROM mandates"))).one()
    assert tuple(books_after) == (AMOUNT, 0)
