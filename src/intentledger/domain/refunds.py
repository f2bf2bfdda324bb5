"""Refunds: how much of a payment is refunded, and how much may still be. Pure.

A refund is a money movement whose answer can be lost, like the payment it
reverses, so the rule is the mandate's: an amount is *taken* the moment a
refund is accepted, and stays taken while the refund's outcome is unknown or
in review. Only the provider's final word that it did not happen (a refund
settled failed, or cancelled, with no execution ever seen) gives it back. And
the provider's evidence is the truth for the books: every refund object it
showed executed counts as refunded, whatever the ledger's outcome says.

    refundable = captured - taken,   taken = sum over refunds of
        amount x max(executions seen, keys sent)   while the outcome is not final,
        amount x executions seen                   final, once any execution is known,
        amount                                     settled failed, the audit still to look,
        0                                          final, and nothing ever executed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from intentledger.domain.evidence import Share, executions, recorded_executions
from intentledger.domain.states import FINAL, Outcome, State


@dataclass(frozen=True)
class RefundView:
    """What the totals need of one refund operation."""

    amount: int
    state: State
    outcome: Outcome | None
    executed: frozenset[str]
    # Provider keys sent (each could have executed) and, for a refund a person
    # settled failed, whether the provider is still to be asked (the audit).
    keys: int = 1
    verifying: bool = False


@dataclass(frozen=True)
class RefundTotals:
    # Known to have moved back to the customer (the provider's evidence).
    refunded: int
    # Refunded, or held by a refund whose outcome is not (yet) a known failure.
    taken: int
    refundable: int


def taken_by(refund: RefundView) -> int:
    seen = executions(refund.state, refund.outcome, refund.executed)
    if refund.state not in FINAL:
        # Every key sent may have executed until evidence says otherwise.
        return refund.amount * max(seen, refund.keys, 1)
    if seen:
        return refund.amount * seen
    # Settled failed with nothing seen: given back, once the provider agrees
    # (a person's "failed" is checked by the audit before the money is free).
    return refund.amount if refund.verifying else 0


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


def view_of(refund: Any, extra_keys: int = 0) -> RefundView:
    """`refund` as `Ledger.refunds_of` reads it (with `keys` and `verifying`);
    `extra_keys`: keys about to be sent on top."""
    outcome = _field(refund, "outcome")
    return RefundView(
        amount=_field(refund, "amount"),
        state=State(_field(refund, "state")),
        outcome=Outcome(outcome) if outcome else None,
        executed=recorded_executions(
            _field(refund, "executed_references"), outcome, _field(refund, "provider_reference")
        ),
        # Keys sent, or approved and not yet sent (a person's new-key request).
        keys=max(
            _optional(refund, "keys") or 1,
            (_field(refund, "request_context") or {}).get("keys_approved", 1),
        )
        + extra_keys,
        verifying=bool(_optional(refund, "verifying")),
    )


def _optional(record: Any, name: str) -> Any:
    if isinstance(record, Mapping):
        return record.get(name)
    return getattr(record, name, None)


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
    charge = _field(payment, "provider_reference")
    against = [r for r in refunds if _field(r, "request_context").get("charge") == charge]
    return refund_totals(captured_by(payment), (view_of(r) for r in against))
