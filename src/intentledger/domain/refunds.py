"""Refunds: how much of a payment is refunded, and how much may still be. Pure.

A refund is a money movement whose answer can be lost, like the payment it
reverses, so the rule is the mandate's (domain/watching.py): an amount is
*taken* the moment a refund is accepted, and stays taken once per provider key
that may still execute while the refund is unresolved or watched — a person's
"failed" frees nothing the provider still shows open. Only the end of watching
(the provider quiet, no execution shown) gives it back. And the provider's
evidence is the truth for the books: every refund object it showed executed
counts as refunded, whatever the ledger's outcome says.

    refundable = captured - taken,   taken = sum over refunds of
        amount x max(executions seen, live keys, 1)   while the outcome is not final,
        amount x max(executions seen, live keys)      settled, still watched,
        amount x executions seen                      settled, quiet.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from intentledger.domain.evidence import Share, executions, recorded_executions
from intentledger.domain.states import Outcome, State
from intentledger.domain.watching import held, is_watched


@dataclass(frozen=True)
class RefundView:
    """What the totals need of one refund operation."""

    amount: int
    state: State
    outcome: Outcome | None
    executed: frozenset[str]
    # Provider keys that may still execute, and whether the settled refund is
    # still watched (the provider not yet quiet).
    live_keys: int = 0
    watched: bool = False


@dataclass(frozen=True)
class RefundTotals:
    # Known to have moved back to the customer (the provider's evidence).
    refunded: int
    # Refunded, or held by a refund whose outcome is not (yet) a known failure.
    taken: int
    refundable: int


def taken_by(refund: RefundView) -> int:
    seen = executions(refund.state, refund.outcome, refund.executed)
    return refund.amount * held(refund.state, seen, refund.live_keys, refund.watched)


def refund_totals(captured: int, refunds: Iterable[RefundView]) -> RefundTotals:
    """`captured`: what the refunded charge took (0 for a payment not known succeeded)."""
    listed = list(refunds)
    refunded = sum(r.amount * executions(r.state, r.outcome, r.executed) for r in listed)
    taken = sum(taken_by(r) for r in listed)
    return RefundTotals(refunded=refunded, taken=taken, refundable=max(captured - taken, 0))


def refund_mandate_share(
    amount: int, state: State, outcome: Outcome | None, executed: frozenset[str]
) -> Share:
    """A refund's part of its payment's mandate: what it moved back is no longer
    spent (the limit is free again), and only once it moved: nothing is given
    back while its outcome is unknown."""
    return Share(reserved=0, spent=-amount * executions(state, outcome, executed))


# -- a payment's refunds, as the ledger records them (rows or mappings) ----------------------


def _field(record: Any, name: str) -> Any:
    # A just-accepted intent is a mapping without the fields nothing has set yet.
    return record.get(name) if isinstance(record, Mapping) else getattr(record, name)


def view_of(refund: Any, live_keys: int | None = None) -> RefundView:
    """`refund` as the ledger records it; `live_keys`: its count with a key about
    to be authorised (None: as recorded)."""
    outcome = _field(refund, "outcome")
    return RefundView(
        amount=_field(refund, "amount"),
        state=State(_field(refund, "state")),
        outcome=Outcome(outcome) if outcome else None,
        executed=recorded_executions(
            _field(refund, "executed_references"), outcome, _field(refund, "provider_reference")
        ),
        live_keys=(_field(refund, "live_keys") or 0) if live_keys is None else live_keys,
        watched=is_watched(_field(refund, "watch")),
    )


def captured_by(payment: Any) -> int:
    """What the payment's settled charge took: its amount once known succeeded
    with its charge named (a refund must name the charge it reverses)."""
    succeeded = (
        _field(payment, "state") == State.OUTCOME_KNOWN
        and _field(payment, "outcome") == Outcome.SUCCEEDED
    )
    return _field(payment, "amount") if succeeded and _field(payment, "provider_reference") else 0


def payment_refund_totals(payment: Any, refunds: Iterable[Any]) -> RefundTotals:
    """The payment's refunded and refundable amounts against its settled charge
    (refunds of another charge — a duplicate's — are not taken from it)."""
    settled_charge = _field(payment, "provider_reference")
    return refund_totals(captured_by(payment), of_charge(refunds, settled_charge))


def of_charge(refunds: Iterable[Any], charge: str | None) -> list[RefundView]:
    """The refunds (as the ledger records them) that reverse `charge`."""
    return [view_of(r) for r in refunds if _field(r, "request_context").get("charge") == charge]


def captured_by_charge(payment: Any, charge: str | None) -> int:
    """What `charge` took from the payment's customer: the settled charge's
    `captured_by`, or the payment's amount for a duplicate charge (it executed,
    so it took the amount)."""
    if charge == _field(payment, "provider_reference"):
        return captured_by(payment)
    return int(_field(payment, "amount"))


# -- what may be refunded -----------------------------------------------------------------------


class RefundProblem(StrEnum):
    """Why a refund is refused (the values are the problem types)."""

    NOT_REFUNDABLE = "payment-not-refundable"
    NOTHING_LEFT = "nothing-to-refund"
    EXCEEDS_REFUNDABLE = "refund-exceeds-refundable"


@dataclass(frozen=True)
class RefundAsk:
    """A refund asked of a payment: the amount it would take, the payment's
    totals before it, and why it may not be taken (None: it may)."""

    amount: int
    totals: RefundTotals
    problem: RefundProblem | None


def ask_refund(payment: Any, refunds: Iterable[Any], asked: int | None) -> RefundAsk:
    """A refund of `asked` (None: all that is still refundable) of the payment's
    settled charge, against its refunds so far."""
    totals = payment_refund_totals(payment, refunds)
    if captured_by(payment) == 0:
        return RefundAsk(0, totals, RefundProblem.NOT_REFUNDABLE)
    amount = totals.refundable if asked is None else asked
    if amount <= 0:
        return RefundAsk(amount, totals, RefundProblem.NOTHING_LEFT)
    if amount > totals.refundable:
        return RefundAsk(amount, totals, RefundProblem.EXCEEDS_REFUNDABLE)
    return RefundAsk(amount, totals, None)


class DuplicateProblem(StrEnum):
    """Why a charge may not be refunded as a duplicate of the payment's."""

    NOT_FLAGGED = "not-flagged"
    NO_SETTLED_CHARGE = "no-settled-charge"
    SETTLED_CHARGE = "settled-charge"
    NOT_EXECUTED = "not-executed"


def duplicate_problem(
    flagged: bool, settled_charge: str | None, charge: str, executed: frozenset[str]
) -> DuplicateProblem | None:
    """May `charge` be refunded as a duplicate? Only an executed charge of a
    payment flagged duplicate_detected that is not the one its books settled on,
    once that one is known (so the charge it keeps is known before any other is
    refunded)."""
    if not flagged:
        return DuplicateProblem.NOT_FLAGGED
    if settled_charge is None:
        return DuplicateProblem.NO_SETTLED_CHARGE
    if charge == settled_charge:
        return DuplicateProblem.SETTLED_CHARGE
    if charge not in executed:
        return DuplicateProblem.NOT_EXECUTED
    return None


def duplicates_of(payment: Any) -> frozenset[str]:
    """The payment's executed charges beyond the one its books settled on."""
    settled = _field(payment, "provider_reference")
    executed = recorded_executions(
        _field(payment, "executed_references"), _field(payment, "outcome"), settled
    )
    return executed - {settled}


def unrefunded_duplicates(payment: Any, refunds: Iterable[Any]) -> list[str]:
    """The payment's duplicate charges not yet wholly refunded: while any is
    left, its duplicate flag stays up."""
    listed = list(refunds)

    def wholly_refunded(charge: str) -> bool:
        took = captured_by_charge(payment, charge)
        return refund_totals(took, of_charge(listed, charge)).refunded >= took

    return sorted(charge for charge in duplicates_of(payment) if not wholly_refunded(charge))
