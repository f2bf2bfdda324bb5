"""Refunds through the real engine on both databases, with the simulated
provider of tests/test_recovery_model.py and the test's clock: the amount a
refund holds while its outcome is unknown, the books of a mandate, and what a
refund's own lost answer leads to."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.documents import operation_document
from intentledger.domain.canonical import request_hash
from intentledger.domain.states import Outcome, State
from intentledger.engine import changes
from intentledger.engine.intake import Intent
from intentledger.engine.refunds import REFUND_ROUTE, RefundRefused, accept_refund
from intentledger.store.ledger import Ledger
from tests.test_evidence_funnel import AMOUNT, books, make_mandate, pay_under
from tests.test_recovery_model import SECOND, Scene


async def refund(
    scene: Scene, payment_id: str, key: str, amount: int | None = None, actor: str = "alice"
) -> str:
    body: dict[str, Any] = {"payment_id": payment_id}
    if amount is not None:
        body["amount"] = amount
    intent = Intent(
        actor, REFUND_ROUTE, key, request_hash(actor, REFUND_ROUTE, body), body, "sandbox", "refund"
    )
    made = (await accept_refund(scene.engine, scene.clock, intent, payment_id)).operation
    return str(made["operation_id"] if isinstance(made, dict) else made.operation_id)


async def document(scene: Scene, operation_id: str) -> dict[str, Any]:
    async with scene.engine.connect() as conn:
        ledger = Ledger(conn)
        operation = await ledger.get_operation(operation_id)
        assert operation is not None
        return operation_document(operation, refunds=await ledger.refunds_of(operation_id))


async def paid(scene: Scene) -> str:
    """A payment of 500, settled succeeded."""
    op_id = await scene.accept()
    await scene.drain()
    assert (await scene.operation(op_id)).outcome == Outcome.SUCCEEDED
    return op_id


async def test_an_unknown_refund_holds_its_amount_until_evidence_settles_it(
    engine: AsyncEngine,
) -> None:
    scene = Scene(engine)
    payment = await paid(scene)
    scene.provider.submit_behaviour = "lose_after_execute"
    first = await refund(scene, payment, "r-1", 300)
    await scene.drain()
    assert (await scene.operation(first)).state == State.UNKNOWN
    held = await document(scene, payment)
    assert (held["amount_refunded"], held["amount_refundable"]) == (0, 200)

    # The 300 it holds cannot be used: 201 is too much, 200 fits.
    with pytest.raises(RefundRefused) as refused:
        await refund(scene, payment, "r-2", 201)
    assert refused.value.slug == "refund-exceeds-refundable"
    scene.provider.submit_behaviour = "ok"
    second = await refund(scene, payment, "r-3", 200)
    await scene.drain()
    assert (await scene.operation(second)).outcome == Outcome.SUCCEEDED
    with pytest.raises(RefundRefused) as nothing_left:
        await refund(scene, payment, "r-4")
    assert nothing_left.value.slug == "nothing-to-refund"

    # The lost one is found at the provider: refunded, once.
    scene.clock.advance(31 * SECOND)
    await scene.drain()
    settled = await scene.operation(first)
    assert (settled.state, settled.outcome) == (State.OUTCOME_KNOWN, Outcome.SUCCEEDED)
    assert len(scene.provider.charges_for(first)) == 1
    after = await document(scene, payment)
    assert (after["amount_refunded"], after["amount_refundable"]) == (500, 0)


async def test_a_refund_that_fails_gives_its_amount_back(engine: AsyncEngine) -> None:
    scene = Scene(engine)
    payment = await paid(scene)
    scene.provider.submit_behaviour = "decline"
    declined = await refund(scene, payment, "r-1")
    assert (await scene.operation(declined)).amount == 500, "omitted: all that remains"
    await scene.drain()
    assert (await scene.operation(declined)).outcome == Outcome.FAILED
    assert (await document(scene, payment))["amount_refundable"] == 500
    scene.provider.submit_behaviour = "ok"
    await refund(scene, payment, "r-2", 500)


async def test_a_refund_lost_before_execution_is_sent_again_with_the_same_key(
    engine: AsyncEngine,
) -> None:
    scene = Scene(engine)
    payment = await paid(scene)
    scene.provider.submit_behaviour = "not_connected"  # never reached the provider
    op_id = await refund(scene, payment, "r-1", 100)
    await scene.drain()
    assert (await scene.operation(op_id)).state == State.ACCEPTED
    scene.provider.submit_behaviour = "ok"
    scene.clock.advance(31 * SECOND)
    await scene.drain()
    assert (await scene.operation(op_id)).outcome == Outcome.SUCCEEDED
    keys = [a.provider_idempotency_key for a in await scene.attempts(op_id)]
    sent = [key for _, reference, key, _ in scene.provider.received if reference == op_id]
    assert len(set(keys)) == 1 and set(sent) == set(keys) and len(sent) == 2
    assert len(scene.provider.charges_for(op_id)) == 1


async def test_only_the_payers_succeeded_payment_can_be_refunded(engine: AsyncEngine) -> None:
    scene = Scene(engine)
    payment = await paid(scene)
    with pytest.raises(RefundRefused) as stranger:
        await refund(scene, payment, "r-1", 100, actor="mallory")
    assert stranger.value.status == 404
    scene.provider.submit_behaviour = "lose_after_execute"
    unknown = await scene.accept_with_key("unknown-payment")
    await scene.drain()
    with pytest.raises(RefundRefused) as not_known:
        await refund(scene, unknown, "r-2", 100)
    assert not_known.value.slug == "payment-not-refundable"
    # A refund is not a payment to refund.
    scene.provider.submit_behaviour = "ok"
    a_refund = await refund(scene, payment, "r-3", 100)
    await scene.drain()
    with pytest.raises(RefundRefused) as of_a_refund:
        await refund(scene, a_refund, "r-4", 10)
    assert of_a_refund.value.status == 404


async def test_an_equal_retry_replays_and_takes_nothing_more(engine: AsyncEngine) -> None:
    scene = Scene(engine)
    payment = await paid(scene)
    first = await refund(scene, payment, "r-1", 400)
    again = await refund(scene, payment, "r-1", 400)
    assert again == first
    assert (await document(scene, payment))["amount_refundable"] == 100


async def test_a_mandate_gets_its_limit_back_only_when_the_refund_succeeds(
    engine: AsyncEngine,
) -> None:
    scene = Scene(engine)
    mandate_id = await make_mandate(scene, total_limit=1000)
    payment = await pay_under(scene, mandate_id, "pay-1")
    await scene.drain()
    assert await books(scene, mandate_id) == (0, 500)
    scene.provider.submit_behaviour = "lose_after_execute"
    op_id = await refund(scene, payment, "r-1", 200, actor="ana")
    await scene.drain()
    assert (await scene.operation(op_id)).state == State.UNKNOWN
    assert await books(scene, mandate_id) == (0, 500), "nothing back while unknown"
    scene.clock.advance(31 * SECOND)
    await scene.drain()
    assert (await scene.operation(op_id)).outcome == Outcome.SUCCEEDED
    assert await books(scene, mandate_id) == (0, 300)
    # So a payment of 700 now fits the limit of 1000.
    scene.provider.submit_behaviour = "ok"
    await pay_under(scene, mandate_id, "pay-2", amount=700)


async def test_a_suspended_mandate_does_not_stop_a_refund(engine: AsyncEngine) -> None:
    from intentledger.engine import mandates

    scene = Scene(engine)
    mandate_id = await make_mandate(scene, total_limit=1000)
    payment = await pay_under(scene, mandate_id, "pay-1")
    await scene.drain()
    op_id = await refund(scene, payment, "r-1", 100, actor="ana")
    keyed = mandates.Keyed("ana", "POST /v1/mandates/{id}/suspend", "s-1", "h")
    await mandates.change_status(engine, scene.clock, keyed, mandate_id, "suspend")
    assert (await scene.operation(op_id)).state == State.ACCEPTED
    await scene.drain()
    assert (await scene.operation(op_id)).outcome == Outcome.SUCCEEDED
    assert await books(scene, mandate_id) == (0, 400)


async def test_a_contradiction_is_resolved_by_a_statement_with_its_evidence(
    engine: AsyncEngine,
) -> None:
    from sqlalchemy import select

    from intentledger.engine import operator
    from intentledger.engine.operator import OperatorAction
    from intentledger.store.tables import decisions
    from tests.test_evidence_funnel import claim, resolve

    scene = Scene(engine)
    mandate_id = await make_mandate(scene, total_limit=1000)
    op_id = await pay_under(scene, mandate_id, "pay-1")
    scene.provider.submit_behaviour = "lose_after_execute"
    await scene.drain()
    scene.clock.advance(31 * SECOND)
    row = await claim(scene, "reconcile")
    assert await scene.worker.reconciler._begin_check(row) is not None
    lookup = await scene.provider.lookup(op_id)
    await resolve(scene, op_id, Outcome.FAILED)
    await scene.worker.reconciler._record_check(row, lookup)
    assert (await scene.operation(op_id)).outcome_contradicted
    assert await books(scene, mandate_id) == (0, AMOUNT)

    statement = OperatorAction(op_id, "olive", "the provider's dashboard shows ch_0001 captured")
    await scene.act(lambda ledger, now: operator.resolve(ledger, now, statement, Outcome.SUCCEEDED))
    op = await scene.operation(op_id)
    assert (op.state, op.outcome, op.outcome_contradicted) == (
        State.OUTCOME_KNOWN,
        Outcome.SUCCEEDED,
        False,
    )
    assert op.next_action == "none"
    assert await books(scene, mandate_id) == (0, AMOUNT), (
        "the books followed the provider all along"
    )
    async with engine.connect() as conn:
        last = (
            await conn.execute(
                select(decisions)
                .where(decisions.c.operation_id == op_id)
                .order_by(decisions.c.id.desc())
                .limit(1)
            )
        ).one()
    assert last.rule == "operator_contradiction_resolution"
    assert last.inputs["evidence"] == statement.reason and last.inputs["outcome_before"] == "failed"
    # Resolved succeeded with no charge named: the one the provider showed is adopted,
    # so the payment can be refunded.
    assert op.provider_reference == scene.provider.charges[0].id
    assert (await document(scene, op_id))["amount_refundable"] == AMOUNT
    # A statement on a settled operation with no contradiction is refused.
    again = OperatorAction(op_id, "olive", "once more")
    with pytest.raises(operator.ActionNotAllowed):
        await scene.act(lambda ledger, now: operator.resolve(ledger, now, again, Outcome.FAILED))


async def test_a_settled_refund_is_news_for_the_payments_merchant(engine: AsyncEngine) -> None:
    from tests.test_merchant_webhooks_engine import add_endpoint, announced

    scene = Scene(engine)
    payment = await paid(scene)
    await add_endpoint(engine, scene.clock, "alice", "http://127.0.0.1:9/hooks")
    op_id = await refund(scene, payment, "r-1", 120)
    await scene.drain()
    [(kind, data)] = await announced(engine)
    assert kind == "operation.outcome_known"
    assert (data["id"], data["kind"], data["payment_id"]) == (op_id, "refund", payment)
    assert (data["outcome"], data["amount"]) == ("succeeded", 120)


async def test_a_refund_a_person_calls_failed_stays_held_until_the_provider_is_asked(
    engine: AsyncEngine,
) -> None:
    from datetime import timedelta

    from intentledger.domain.evidence import AUDIT_LOOKS
    from intentledger.engine import operator
    from intentledger.engine.operator import VERIFY_AFTER, OperatorAction

    scene = Scene(engine)
    payment = await paid(scene)
    scene.provider.submit_behaviour = "lose_before_execute"  # never executed
    op_id = await refund(scene, payment, "r-1", 300)
    await scene.drain()
    assert (await scene.operation(op_id)).state == State.UNKNOWN
    statement = OperatorAction(op_id, "olive", "the provider's dashboard shows no refund")
    await scene.act(lambda ledger, now: operator.resolve(ledger, now, statement, Outcome.FAILED))
    assert (await scene.operation(op_id)).outcome == Outcome.FAILED
    # The person's word is checked before the money is free again: the amount
    # stays held while the provider is still to be asked (its verification looks).
    assert (await document(scene, payment))["amount_refundable"] == 200
    scene.clock.advance(VERIFY_AFTER + SECOND)
    await scene.drain()  # the first look finds nothing; a listing may lag, so more follow
    assert (await document(scene, payment))["amount_refundable"] == 200
    for _ in range(AUDIT_LOOKS):
        scene.clock.advance(timedelta(days=1))
        await scene.drain()
    assert (await document(scene, payment))["amount_refundable"] == 500


async def test_a_new_key_for_a_refund_needs_room_for_both_executions(engine: AsyncEngine) -> None:
    from datetime import timedelta

    from intentledger.domain.evidence import AUDIT_LOOKS
    from intentledger.domain.retention import sandbox_policy
    from intentledger.engine import operator
    from intentledger.engine.operator import OperatorAction
    from intentledger.engine.refusal import Refusal

    scene = Scene(engine)
    payment = await paid(scene)
    scene.provider.submit_behaviour = "lose_before_execute"
    big = await refund(scene, payment, "r-1", 300)
    small = await refund(scene, payment, "r-2", 200)
    await scene.drain()
    scene.clock.advance(timedelta(hours=25))  # the keys are past the provider's retention
    scene.provider.lookup_behaviour = "truthful"
    await scene.drain()
    for op_id in (big, small):
        assert (await scene.operation(op_id)).state == State.MANUAL_REVIEW

    def approve(op_id: str) -> Any:
        action = OperatorAction(op_id, "olive", "nothing at the provider")
        policy = lambda _p: sandbox_policy(timedelta(hours=24))  # noqa: E731
        return lambda ledger, now: operator.approve_resubmission(ledger, now, action, policy)

    # 300 sent once and maybe again, beside 200 held: 800 of 500.
    with pytest.raises(Refusal, match="could refund 300 again"):
        await scene.act(approve(big))
    # The small one twice beside the big one held: 400 + 300 of 500, refused too ...
    with pytest.raises(Refusal, match="could refund 200 again"):
        await scene.act(approve(small))
    # ... but with the big one resolved failed (and the provider asked), 200 twice fits.
    statement = OperatorAction(big, "olive", "the provider has no such refund")
    await scene.act(lambda ledger, now: operator.resolve(ledger, now, statement, Outcome.FAILED))
    for _ in range(AUDIT_LOOKS + 1):  # until the provider has been asked enough
        scene.clock.advance(timedelta(days=1))
        await scene.drain()
    scene.provider.submit_behaviour = "ok"
    await scene.act(approve(small))
    # Approved, not yet sent: both executions are held already (2 x 200 of 500).
    with pytest.raises(RefundRefused, match="exceeds"):
        await refund(scene, payment, "r-3", 101)
    await scene.drain()
    assert (await scene.operation(small)).outcome == Outcome.SUCCEEDED
    assert len(scene.provider.charges_for(small)) == 1


async def test_a_contradiction_on_a_batch_settled_payment_keeps_its_charge_in_the_books(
    engine: AsyncEngine,
) -> None:
    from intentledger.engine import operator
    from intentledger.engine.operator import OperatorAction

    scene = Scene(engine)
    mandate_id = await make_mandate(scene, total_limit=1000)
    payment = await pay_under(scene, mandate_id, "pay-1")
    assert await scene.worker.deliver_batch(8) == 1  # the batched path
    settled = await scene.operation(payment)
    # The batch writes what the single path writes (engine/evidence.settlement).
    assert settled.outcome == Outcome.SUCCEEDED
    assert settled.executed_references == [settled.provider_reference]
    assert await books(scene, mandate_id) == (0, AMOUNT)
    # Stand-in for a provider event that contradicts the recorded success.
    async with engine.begin() as conn:
        ledger = Ledger(conn)
        locked = await ledger.lock_operation(payment)
        assert locked is not None
        await changes.update(ledger, locked, now=scene.clock(), outcome_contradicted=True)
    statement = OperatorAction(payment, "olive", "the provider's dashboard shows it failed")
    await scene.act(lambda ledger, now: operator.resolve(ledger, now, statement, Outcome.FAILED))
    op = await scene.operation(payment)
    assert (op.outcome, op.outcome_contradicted) == (Outcome.FAILED, False)
    assert op.executed_references == [settled.provider_reference]
    assert await books(scene, mandate_id) == (0, AMOUNT), "the charge the provider showed stays"
