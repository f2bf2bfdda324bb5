"""What a refund's own changes mean for its payment: a duplicate flag that can
come down.

Called with the refund (and its mandate) locked; the payment's row is locked
after them, the order every writer of a refund's payment keeps.
"""

from __future__ import annotations

from datetime import datetime

from intentledger.domain.refunds import duplicates_of, unrefunded_duplicates
from intentledger.domain.states import NextAction
from intentledger.domain.watching import settled_next_action
from intentledger.engine import changes
from intentledger.store.ledger import Ledger
from intentledger.store.records import OperationRecord


async def after_refund_settled(
    ledger: Ledger, refund: OperationRecord, now: datetime, source: str
) -> None:
    """A refund of a duplicate settled: once every extra charge of its payment
    is refunded, the payment's duplicate flag clears, with the decision saying so."""
    if not refund.request_context.get("remedies_duplicate"):
        return
    assert refund.parent_operation_id is not None, "a refund names its payment"
    payment = await ledger.get_operation(refund.parent_operation_id, for_update=True)
    if payment is None or not payment.duplicate_detected:
        return
    if unrefunded_duplicates(payment, await ledger.refunds_of(payment.operation_id)):
        return
    extras = duplicates_of(payment)
    planned = changes.Writes(now)
    planned.decide(
        operation_id=payment.operation_id,
        actor=payment.actor,
        at=now,
        rule="duplicate_refunded",
        inputs={"refunded_charges": sorted(extras), "refund_operation_id": refund.operation_id},
        next_action=NextAction.NONE,
        reason=f"every duplicate charge is refunded ({', '.join(sorted(extras))})",
        source=source,
    )
    # A contradiction still flagged, or a provider not final, still needs a person.
    still = settled_next_action(False, payment.outcome_contradicted, payment.watch)
    planned.change(
        changes.plan(payment, None, now=now, duplicate_detected=False, next_action=still)
    )
    await planned.save(ledger)
