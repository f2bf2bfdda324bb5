"""Late evidence meets settled, reviewed and person-resolved operations (issue 12).

Each test is one defect a hostile review found, told through the real engine on
both databases with the simulated provider of tests/test_recovery_model.py:
every piece of evidence — a submit answer, a lookup, a person's statement —
goes through the one funnel (domain/evidence.py), and the ledger must flag
every disagreement with the provider, count executions instead of guessing,
and keep a mandate's books on the provider's side.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.documents import operation_document
from intentledger.domain.canonical import request_hash
from intentledger.domain.safety import SafetyRules
from intentledger.domain.states import NextAction, Outcome, State
from intentledger.engine import batch_dispatch, mandates, operator, provider_events
from intentledger.engine.intake import Intent, accept
from intentledger.engine.operator import OperatorAction
from intentledger.providers.base import WebhookEvent
from intentledger.store.batches import BatchLedger
from intentledger.store.ledger import Ledger
from intentledger.store.tables import decisions, outbox
from tests.test_recovery_model import (
    LEASE,
    OPERATOR,
    POLICY_FOR,
    REPLAY_BOUND,
    SECOND,
    STALE_SUBMITTING,
    WORKER_ID,
    Scene,
    build_worker,
)

ROUTE = "POST /v1/payments"
AMOUNT = 500


async def make_mandate(scene: Scene, total_limit: int = 1000) -> str:
    keyed = mandates.Keyed("ana", mandates.CREATE_ROUTE, "md-key", "md-hash")
    mandate, _ = await mandates.create_mandate(
        scene.engine,
        scene.clock,
        keyed,
        {"currency": "EUR", "max_amount": 1000, "total_limit": total_limit},
    )
    return str(mandate.mandate_id)


async def pay_under(scene: Scene, mandate_id: str, key: str, amount: int = AMOUNT) -> str:
    body = {
        "amount": amount,
        "currency": "EUR",
        "payment_method": "pm_model",
        "metadata": {},
        "mandate_id": mandate_id,
    }
    intent = Intent("ana", ROUTE, key, request_hash("ana", ROUTE, body), body, "sandbox")
    return str((await accept(scene.engine, scene.clock, intent)).operation["operation_id"])


async def books(scene: Scene, mandate_id: str) -> tuple[int, int]:
    async with scene.engine.connect() as conn:
        mandate = await Ledger(conn).get_mandate(mandate_id)
    assert mandate is not None
    return mandate.reserved, mandate.spent


async def claim(scene: Scene, kind: str) -> Any:
    """Lease the next due row, which must be of `kind`."""
    async with scene.engine.begin() as conn:
        row = await Ledger(conn).claim_outbox_row(scene.clock(), LEASE, WORKER_ID)
    assert row is not None and row.kind == kind, row
    return row


async def resolve(scene: Scene, op_id: str, outcome: Outcome) -> None:
    action = OperatorAction(op_id, OPERATOR, "the provider's dashboard says so")
    await scene.act(lambda ledger, now: operator.resolve(ledger, now, action, outcome))


async def pending(scene: Scene, op_id: str) -> list[str]:
    async with scene.engine.connect() as conn:
        rows = await conn.execute(
            select(outbox.c.kind).where(outbox.c.operation_id == op_id, outbox.c.done_at.is_(None))
        )
        return sorted(r.kind for r in rows)


async def test_a_lookup_success_in_flight_while_a_person_resolves_failed_is_flagged_and_booked(
    engine: AsyncEngine,
) -> None:
    scene = Scene(engine)
    mandate_id = await make_mandate(scene, total_limit=1000)
    op_id = await pay_under(scene, mandate_id, "pay-1")
    scene.provider.submit_behaviour = "lose_after_execute"  # executed, answer lost
    await scene.drain()
    assert (await scene.operation(op_id)).state == State.UNKNOWN
    assert await books(scene, mandate_id) == (AMOUNT, 0)

    scene.clock.advance(31 * SECOND)
    row = await claim(scene, "reconcile")
    assert await scene.worker.reconciler._begin_check(row) is not None
    lookup = await scene.provider.lookup(op_id)  # shows the charge ...
    await resolve(scene, op_id, Outcome.FAILED)  # ... while a person says "failed"
    # A person's "failed" frees nothing until the provider is quiet.
    assert await books(scene, mandate_id) == (AMOUNT, 0)
    await scene.worker.reconciler._record_check(row, lookup)

    op = await scene.operation(op_id)
    assert (op.state, op.outcome) == (State.OUTCOME_KNOWN, Outcome.FAILED)
    assert op.outcome_contradicted and op.next_action == NextAction.OPERATOR
    assert op.executed_references == [scene.provider.charges[0].id]
    # The provider's evidence is the truth for the books: the money moved.
    assert await books(scene, mandate_id) == (0, AMOUNT)
    # So the limit holds: 1000 less the 500 that moved leaves no room for 600.
    with pytest.raises(mandates.MandateRefusal) as refused:
        await pay_under(scene, mandate_id, "pay-2", amount=600)
    assert refused.value.slug == "mandate-limit"
    # The verification look the resolution scheduled sees the same charge: the
    # same evidence twice moves no money and raises nothing new.
    scene.clock.advance(timedelta(minutes=5))
    await scene.drain()
    assert await books(scene, mandate_id) == (0, AMOUNT)
    assert not (await scene.operation(op_id)).duplicate_detected


async def _answer_held_while_a_person_resolves(
    scene: Scene, behaviour: str, outcome: Outcome
) -> str:
    """Attempt 1 is sent; its answer is held while the sweeper makes the operation
    UNKNOWN and a person resolves it; then the answer arrives."""
    op_id = await scene.accept()
    row = await claim(scene, "submit")
    submission = await scene.worker.dispatcher._pre_submit(row)
    assert submission is not None
    scene.clock.advance(STALE_SUBMITTING + SECOND)
    assert await scene.worker.sweeper.sweep() == 1
    await resolve(scene, op_id, outcome)
    scene.provider.submit_behaviour = behaviour
    answer = await scene.provider.submit(submission.request)
    await scene.worker.dispatcher.record(row, submission, answer)
    return op_id


async def test_a_late_decline_after_a_person_said_succeeded_is_flagged(
    engine: AsyncEngine,
) -> None:
    scene = Scene(engine)
    op_id = await _answer_held_while_a_person_resolves(scene, "decline", Outcome.SUCCEEDED)
    op = await scene.operation(op_id)
    assert (op.state, op.outcome) == (State.OUTCOME_KNOWN, Outcome.SUCCEEDED)
    assert op.outcome_contradicted and op.next_action == NextAction.OPERATOR
    assert scene.provider.charges == []


async def test_a_late_success_after_a_person_said_succeeded_names_the_charge(
    engine: AsyncEngine,
) -> None:
    scene = Scene(engine)
    op_id = await _answer_held_while_a_person_resolves(scene, "ok", Outcome.SUCCEEDED)
    op = await scene.operation(op_id)
    [charge] = scene.provider.charges
    assert op.provider_reference == charge.id
    assert not op.duplicate_detected and not op.outcome_contradicted
    assert op.next_action == NextAction.NONE
    # The verification look finds the same one charge: still no duplicate.
    scene.clock.advance(timedelta(minutes=5))
    await scene.drain()
    op = await scene.operation(op_id)
    assert not op.duplicate_detected and op.executed_references == [charge.id]
    document = operation_document(op)
    assert (document["provider_reference"], document["executed_references"]) == (
        charge.id,
        [charge.id],
    )


async def next_timer(scene: Scene, op_id: str) -> None:
    """Move the clock to the operation's next due row and deliver what is due."""
    async with scene.engine.connect() as conn:
        due = (
            await conn.execute(
                select(outbox.c.due_at)
                .where(outbox.c.operation_id == op_id, outbox.c.done_at.is_(None))
                .order_by(outbox.c.due_at)
            )
        ).first()
    assert due is not None, "nothing is scheduled"
    scene.clock.now = max(scene.clock.now, due.due_at)
    await scene.drain()


async def test_a_lookup_that_says_requires_action_for_days_reaches_a_person(
    engine: AsyncEngine,
) -> None:
    scene = Scene(engine)
    mandate_id = await make_mandate(scene)
    op_id = await pay_under(scene, mandate_id, "pay-1")
    scene.provider.submit_behaviour = "lose_after_execute"
    scene.provider.lookup_behaviour = "requires_action"
    await scene.drain()
    for _ in range(40):  # every check falls due and says "requires_action"
        await next_timer(scene, op_id)
        if (await scene.operation(op_id)).state == State.MANUAL_REVIEW:
            break
    op = await scene.operation(op_id)
    assert (op.state, op.next_action) == (State.MANUAL_REVIEW, NextAction.OPERATOR)
    assert op.reconciliation_status == "processing"
    async with engine.connect() as conn:
        rules = [r.rule for r in await conn.execute(select(decisions.c.rule))]
    assert rules == ["checks_exhausted"]
    # The checks go on, the money stays held, and evidence still settles it.
    assert await pending(scene, op_id) == ["reconcile"]
    assert await books(scene, mandate_id) == (AMOUNT, 0)
    assert len(scene.provider.received) == 1, "a processing payment was sent again"
    scene.provider.lookup_behaviour = "truthful"
    scene.clock.advance(timedelta(hours=7))
    await scene.drain()
    op = await scene.operation(op_id)
    assert (op.state, op.outcome) == (State.OUTCOME_KNOWN, Outcome.SUCCEEDED)
    assert await books(scene, mandate_id) == (0, AMOUNT)


async def test_a_new_key_rule_counts_only_not_found_lookups_after_the_last_attempt(
    engine: AsyncEngine,
) -> None:
    scene = Scene(engine)
    rules = SafetyRules(
        allow_new_request=True, new_request_min_not_found=3, new_request_min_spread=SECOND
    )
    scene.worker = build_worker(engine, scene.provider, scene.clock, rules)
    op_id = await scene.accept()
    scene.provider.submit_behaviour = "lose_before_execute"
    scene.provider.lookup_behaviour = "lagging"
    await scene.drain()  # attempt 1 lost
    for _ in range(2):  # not found -> same-key replays while the key is young
        scene.clock.advance(timedelta(hours=1))
        await scene.drain()
    scene.clock.advance(REPLAY_BOUND)
    scene.provider.submit_behaviour = "lose_after_execute"
    while len(await scene.attempts(op_id)) < 4:  # three not-founds after attempt 3
        await next_timer(scene, op_id)
    attempts = await scene.attempts(op_id)
    assert attempts[-1].provider_idempotency_key == f"{op_id}:4"  # a new key, executed
    assert len(scene.provider.charges) == 1
    assert await scene.rules(op_id) == [
        "replay_within_retention",
        "replay_within_retention",
        "awaiting_not_found",
        "awaiting_not_found",
        "new_request_after_not_found",
    ]
    # Its answer was lost; the key ages past its bound; the next lookup times
    # out. The three old not-founds must not count for the new key.
    scene.provider.lookup_behaviour = "timeout"
    scene.provider.submit_behaviour = "ok"
    scene.clock.advance(REPLAY_BOUND + timedelta(minutes=1))
    await scene.drain()
    assert (await scene.rules(op_id))[-1] == "awaiting_not_found"
    while (await scene.operation(op_id)).state != State.MANUAL_REVIEW:
        await next_timer(scene, op_id)  # timeouts until the checks run out
    op = await scene.operation(op_id)
    assert op.next_action == NextAction.OPERATOR
    assert (await scene.rules(op_id))[-1] == "checks_exhausted"
    assert "new_request_after_not_found" not in (await scene.rules(op_id))[5:]
    assert len(await scene.attempts(op_id)) == 4
    assert len(scene.provider.charges) == 1, "old not-founds sent a second new key"


async def test_a_retry_after_of_zero_is_not_resent_at_once(engine: AsyncEngine) -> None:
    scene = Scene(engine)
    op_id = await scene.accept()
    scene.provider.submit_behaviour = "rate_limited_now"
    waits = []
    for _ in range(3):
        await scene.drain()
        op = await scene.operation(op_id)
        assert op.state == State.ACCEPTED
        waits.append(op.retry_after_at - scene.clock())
        scene.clock.now = op.retry_after_at
    assert waits == [SECOND, 2 * SECOND, 4 * SECOND]
    assert len(scene.provider.received) == 3
    # Each requeue's decision says which timing it applied, and what it weighed.
    async with engine.connect() as conn:
        timings = [
            d.inputs["timing"]
            for d in await conn.execute(select(decisions).order_by(decisions.c.id))
        ]
    assert len(timings) == 3
    assert all("Retry-After '0'" in t and "resend floor" in t for t in timings)


async def test_a_superseded_rows_delivery_leaves_the_live_attempt_alone(
    engine: AsyncEngine,
) -> None:
    scene = Scene(engine)
    op_id = await scene.accept()
    row = await claim(scene, "submit")
    assert await scene.worker.dispatcher._pre_submit(row) is not None  # attempt 1 in flight
    actor = (await scene.operation(op_id)).actor
    async with engine.begin() as conn:
        ledger = Ledger(conn)
        old = await ledger.add_decision(
            operation_id=op_id,
            actor=actor,
            at=scene.clock(),
            rule="non_execution_evidence",
            inputs={"provider_idempotency_key": f"{op_id}:1"},
            next_action=NextAction.SUBMIT,
            reason="an earlier decision, since superseded",
            source="test",
        )
        await ledger.enqueue(op_id, actor, "submit", scene.clock(), scene.clock(), decision_id=old)
    stale = await claim(scene, "submit")
    assert await scene.worker.dispatcher._pre_submit(stale) is None
    op = await scene.operation(op_id)
    assert op.state == State.SUBMITTING, "a superseded row marked a live attempt resumed"
    assert await pending(scene, op_id) == ["submit"]  # only the live row remains


async def test_a_failed_batch_record_records_the_answers_one_by_one(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    scene = Scene(engine)
    first = await scene.accept()
    second = await scene.accept_with_key("another")
    settle = BatchLedger.settle
    failures = []

    async def fail_once(self: BatchLedger, *args: Any, **kwargs: Any) -> None:
        if not failures:
            failures.append(1)
            raise RuntimeError("the batch's record transaction failed")
        await settle(self, *args, **kwargs)

    monkeypatch.setattr(BatchLedger, "settle", fail_once)
    async with engine.begin() as conn:
        rows = await BatchLedger(conn).claim_outbox_rows(scene.clock(), LEASE, WORKER_ID, 8)
    await batch_dispatch.deliver_submits(scene.worker.dispatcher, rows)
    assert failures == [1]
    for op_id in (first, second):
        op = await scene.operation(op_id)
        assert (op.state, op.outcome) == (State.OUTCOME_KNOWN, Outcome.SUCCEEDED), op_id
    assert len(scene.provider.charges) == 2


async def test_an_operators_approval_records_key_age_and_retention_policy(
    engine: AsyncEngine,
) -> None:
    scene = Scene(engine)
    op_id = await scene.accept()
    scene.provider.submit_behaviour = "lose_after_execute"
    scene.provider.lookup_behaviour = "lagging"
    await scene.drain()
    scene.clock.advance(timedelta(hours=25))
    await scene.drain()
    assert (await scene.operation(op_id)).state == State.MANUAL_REVIEW
    action = OperatorAction(op_id, OPERATOR, "the customer asked to try again")
    await scene.act(
        lambda ledger, now: operator.approve_resubmission(ledger, now, action, POLICY_FOR)
    )
    async with engine.connect() as conn:
        approval = (
            await conn.execute(
                select(decisions).where(decisions.c.rule == "operator_approved_new_request")
            )
        ).one()
    inputs = approval.inputs
    assert inputs["unresolved_attempt"] == 1 and inputs["previous_key"] == f"{op_id}:1"
    assert inputs["provider_idempotency_key"] == f"{op_id}:2"
    assert inputs["key_age_seconds"] == pytest.approx(timedelta(hours=25).total_seconds())
    assert inputs["policy"]["provider_api"] == "sandbox"
    assert inputs["policy"]["minimum_seconds"] == timedelta(hours=24).total_seconds()
    assert "sandbox" in inputs["provider_retention_note"]
    assert approval.key_age_at_decision == timedelta(hours=25)
    assert OPERATOR in approval.reason and "the customer asked" in approval.reason
    op = await scene.operation(op_id)
    assert op.key_age_at_decision == timedelta(hours=25)


@pytest.mark.parametrize(
    ("event_type", "status", "needs_person", "amount", "why"),
    [
        (
            "CHARGEBACK",
            None,
            True,
            (500, "EUR"),
            "CHARGEBACK: the provider moved money outside our writes",
        ),
        (
            "AUTHORISATION",
            "succeeded",
            False,
            (1, "EUR"),
            "succeeded for another amount: it names 1 EUR, the operation is for 500 EUR",
        ),
    ],
)
async def test_a_flagged_provider_event_logs_why_a_person_must_see_it(
    engine: AsyncEngine,
    caplog: pytest.LogCaptureFixture,
    event_type: str,
    status: str | None,
    needs_person: bool,
    amount: tuple[int, str],
    why: str,
) -> None:
    scene = Scene(engine)
    op_id = await scene.accept()  # 500 EUR at the sandbox
    event = WebhookEvent(
        event_id="evt_flagged",
        type=event_type,
        signed_at=scene.clock(),
        object_id="ch_1",
        reference=op_id,
        status=status,
        payload={},
        object_kind="payment",
        needs_person=needs_person,
        amount=amount,
    )
    with caplog.at_level(logging.WARNING, logger=provider_events.__name__):
        receipt = await provider_events.receive(
            engine, scene.clock, "sandbox", event, timedelta(seconds=30)
        )
    assert receipt.disposition == "flagged"
    (line,) = [r for r in caplog.records if getattr(r, "event", None) == "provider_event.flagged"]
    assert getattr(line, "reason", None) == why
    assert why in line.getMessage()
