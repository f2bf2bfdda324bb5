"""Refund intake: the reverse money movement, under the payment's lock.

A refund is an intent like a payment (idempotency record, operation, outbox row
in one transaction, before any provider work), and from there goes the
payment's way: leased dispatch, SUBMITTING before I/O, UNKNOWN on an ambiguous
answer, reconciliation by our reference, the safety review, the evidence
funnel. What is its own is the check at intake: under the payment's row lock,
the amount asked must fit what is still refundable, counting every refund whose
outcome is not a known failure as taken (domain/refunds.py). Two requests for
the last of a payment's money cannot both pass: the second waits for the
first's lock, and then counts it.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.canonical import request_hash
from intentledger.domain.evidence import recorded_executions
from intentledger.domain.refunds import (
    DuplicateProblem,
    RefundProblem,
    ask_refund,
    captured_by_charge,
    duplicate_problem,
    of_charge,
    refund_totals,
)
from intentledger.domain.states import NextAction
from intentledger.engine import changes
from intentledger.engine.clock import Clock
from intentledger.engine.intake import (
    IntakeResult,
    Intent,
    accept,
    operation_values,
    write_accepted,
)
from intentledger.engine.operator import (
    ActionNotAllowed,
    OperationNotFound,
    OperatorAction,
    require_text,
)
from intentledger.engine.refusal import Refusal
from intentledger.store.ledger import Ledger

REFUND_ROUTE = "POST /v1/payments/{id}/refunds"


class RefundRefused(Refusal):
    """A refund the payment does not allow; nothing is written for it."""


async def accept_refund(
    engine: AsyncEngine, clock: Clock, intent: Intent, payment_id: str
) -> IntakeResult:
    """Make the refund durable (or find the original request's)."""

    async def take_refundable(ledger: Ledger, now: datetime, values: dict[str, Any]) -> None:
        payment = await ledger.lock_operation(payment_id)
        if payment is None or payment.actor != intent.actor or payment.kind != "payment":
            raise RefundRefused(404, "payment-not-found", f"no payment {payment_id!r}")
        if payment.provider != intent.provider:
            raise RefundRefused(
                422,
                "provider-mismatch",
                f"payment {payment_id} was made through {payment.provider}; this service "
                f"sends to {intent.provider}",
            )
        ask = ask_refund(payment, await ledger.refunds_of(payment_id), intent.body.get("amount"))
        amount, totals = ask.amount, ask.totals
        if ask.problem is RefundProblem.NOT_REFUNDABLE:
            raise RefundRefused(
                422,
                ask.problem,
                f"payment {payment_id} is {payment.state}"
                + (f" ({payment.outcome})" if payment.outcome else "")
                + ": only a payment known succeeded, with its charge known, can be refunded",
            )
        if ask.problem is RefundProblem.NOTHING_LEFT:
            raise RefundRefused(
                422,
                ask.problem,
                f"payment {payment_id} has nothing left to refund: "
                f"{totals.taken} of {payment.amount} is refunded or held by refunds in flight",
            )
        if ask.problem is RefundProblem.EXCEEDS_REFUNDABLE:
            raise RefundRefused(
                422,
                ask.problem,
                f"{amount} exceeds the {totals.refundable} still refundable on payment "
                f"{payment_id} ({totals.taken} of {payment.amount} is refunded or held by "
                "refunds whose outcome is not a known failure)",
            )
        body = {**intent.body, "amount": amount}
        values.update(
            amount=amount,
            currency=payment.currency,
            # Its books are the payment's mandate's: a refund that moves money
            # frees the limit it took (store/ledger.py, rebook).
            mandate_id=payment.mandate_id,
            parent_operation_id=payment_id,
            request_context={
                **values["request_context"],
                "body": body,
                "charge": payment.provider_reference,
            },
        )

    return await accept(engine, clock, intent, prepare=take_refundable)


# -- remedies a person starts -------------------------------------------------------------------

DUPLICATE_ROUTE = "POST /v1/ops/operations/{id}/refund-duplicate"


async def refund_duplicate(
    ledger: Ledger, now: datetime, action: OperatorAction, charge: str
) -> str:
    """Refund one executed charge of a payment flagged `duplicate_detected`
    that is not the one the ledger settled on: the extra money a new-key
    request took. The refund is an operation like any other, for the payment's
    actor; the decision on the payment records who asked for it and why. The
    flag clears when every extra charge is refunded (`after_refund_settled`)."""
    reason = require_text(action.reason, "the reason")
    payment = await ledger.lock_operation(action.operation_id)
    if payment is None or payment.kind != "payment":
        raise OperationNotFound(action.operation_id)
    executed = recorded_executions(
        payment.executed_references, payment.outcome, payment.provider_reference
    )
    problem = duplicate_problem(
        bool(payment.duplicate_detected), payment.provider_reference, charge, executed
    )
    if problem is DuplicateProblem.NOT_FLAGGED:
        raise ActionNotAllowed(f"{payment.operation_id} is not flagged duplicate_detected")
    if problem is DuplicateProblem.NO_SETTLED_CHARGE:
        raise ActionNotAllowed(
            f"{payment.operation_id} names no settled charge: resolve its outcome first, so "
            "the charge it keeps is known before any other is refunded"
        )
    if problem is DuplicateProblem.SETTLED_CHARGE:
        raise ActionNotAllowed(
            f"refusing to refund {charge}: it is the charge the ledger settled the payment on; "
            "refund a duplicate, or use POST /v1/payments/{id}/refunds for the payment itself"
        )
    if problem is DuplicateProblem.NOT_EXECUTED:
        raise ActionNotAllowed(
            f"{charge} is not an executed charge of {payment.operation_id} "
            f"(executed: {', '.join(sorted(executed))})"
        )
    refunds = await ledger.refunds_of(payment.operation_id)
    totals = refund_totals(captured_by_charge(payment, charge), of_charge(refunds, charge))
    if totals.refundable <= 0:
        raise ActionNotAllowed(
            f"{charge} is already refunded, or a refund of it is in flight "
            f"({totals.taken} of {payment.amount} taken)"
        )
    body = {
        "payment_id": payment.operation_id,
        "amount": totals.refundable,
        "reason": f"duplicate charge {charge}: {reason}",
    }
    intent = Intent(
        actor=payment.actor,
        route=DUPLICATE_ROUTE,
        idempotency_key=f"refund-duplicate:{charge}:{len(refunds) + 1}",
        request_hash=request_hash(payment.actor, DUPLICATE_ROUTE, body),
        body=body,
        provider=payment.provider,
        kind="refund",
    )
    values = operation_values(intent, now)
    values.update(
        amount=totals.refundable,
        currency=payment.currency,
        mandate_id=payment.mandate_id,
        parent_operation_id=payment.operation_id,
        request_context={
            **values["request_context"],
            "charge": charge,
            "remedies_duplicate": True,
            "by": action.by,
        },
    )
    await changes.decide(
        ledger,
        operation_id=payment.operation_id,
        actor=payment.actor,
        at=now,
        rule="operator_refund_duplicate",
        inputs={
            **action.recorded_by(),
            "reason": reason,
            "charge": charge,
            "settled_charge": payment.provider_reference,
            "executed": sorted(executed),
            "refund_operation_id": values["operation_id"],
            "amount": totals.refundable,
        },
        next_action=NextAction.OPERATOR,
        reason=f"{action.by} refunds duplicate charge {charge}: {reason}",
        source=f"operator:{action.by}",
    )
    # A person's remedy, not a request: no key of its own to claim (the
    # operator's request, when keyed, claimed the operator's key).
    accepted = f"refund of duplicate {charge}"
    await write_accepted(ledger, values, f"operator:{action.by}", accepted, now)
    return f"refund {values['operation_id']} of duplicate charge {charge} accepted"
