"""Room for a new provider key: money held for every key that may still execute.

A new-key request — approved by a person or ordered by a safety rule — is a
second possible execution beside every key already live. It is allowed only
when the mandate (a payment's) or the refunded charge (a refund's) has room for
all of them at once, and from the decision on the operation holds one more
key (`operations.live_keys`), so nothing accepted meanwhile can take that room.

Called with the operation (and its mandate) locked; a refund's payment is
locked after them, the order every writer of a refund's payment keeps.
"""

from __future__ import annotations

from intentledger.domain.evidence import live_keys, room_after_a_new_key
from intentledger.domain.mandates import unheld
from intentledger.domain.refunds import captured_by_charge, refund_totals, view_of
from intentledger.domain.states import State
from intentledger.engine.changes import share_of
from intentledger.engine.evidence import facts_of
from intentledger.store.ledger import Ledger
from intentledger.store.records import OperationRecord


async def room_for_a_new_key(ledger: Ledger, operation: OperationRecord) -> tuple[int, str | None]:
    """The live keys counting the new one, and why it does not fit (None: it does)."""
    facts = await facts_of(ledger, operation)
    keys = live_keys(facts.attempts, facts.authorised_keys) + 1
    if operation.kind == "refund":
        return keys, await _refund_room(ledger, operation, keys)
    if operation.mandate_id is not None:
        return keys, await _mandate_room(ledger, operation, keys)
    return keys, None


async def _mandate_room(ledger: Ledger, payment: OperationRecord, keys: int) -> str | None:
    assert payment.mandate_id is not None, "asked only of a payment under a mandate"
    mandate = await ledger.get_mandate(payment.mandate_id)
    assert mandate is not None, "a payment names its mandate"
    state = State(payment.state)
    before = share_of(payment, state)
    after = share_of(payment, state, {"live_keys": keys})
    free = unheld(mandate.total_limit, mandate.reserved, mandate.spent)
    left = room_after_a_new_key(free, before, after)
    if left >= 0:
        return None
    return (
        f"a new request for {payment.operation_id} could charge {payment.amount} again beside "
        f"{keys - 1} key(s) that may still execute: mandate {payment.mandate_id} has "
        f"{free} of its total_limit {mandate.total_limit} free, {-left} short; resolve the "
        "payment (or others under the mandate) first"
    )


async def _refund_room(ledger: Ledger, refund: OperationRecord, keys: int) -> str | None:
    assert refund.parent_operation_id is not None, "a refund names its payment"
    payment = await ledger.get_operation(refund.parent_operation_id, for_update=True)
    assert payment is not None, "a refund's payment exists"
    charge = refund.request_context.get("charge")
    views = [
        view_of(r, live_keys=keys) if r.operation_id == refund.operation_id else view_of(r)
        for r in await ledger.refunds_of(payment.operation_id)
        if r.request_context.get("charge") == charge
    ]
    captured = captured_by_charge(payment, charge)
    totals = refund_totals(captured, views)
    if totals.taken <= captured:
        return None
    return (
        f"a new request for refund {refund.operation_id} could refund {refund.amount} again "
        f"beside {keys - 1} key(s) that may still execute: with it, {totals.taken} of the "
        f"{captured} charge {charge} took would be refunded or held; resolve the refund, or "
        "the others, first"
    )


__all__ = ["room_for_a_new_key"]
