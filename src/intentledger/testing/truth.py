"""The ledger judged against the provider's own truth: what every chaos run
counts, the kit's short one (intentledger.testing.chaos) and `intentledger
chaos`'s long one alike.

The truth is what the provider executed, read from the provider (or its fake),
never from the ledger. A violation is a count the ledger must keep at 0 in any
run, however hostile: money moved twice without a recorded decision, an
outcome the provider contradicts, a refund beyond its charge, an operation
lost, a resubmission nobody authorised.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection

from intentledger.domain.refunds import captured_by, refund_totals, view_of
from intentledger.store.judging import read_whole_ledger

FINAL = {"OUTCOME_KNOWN", "CANCELLED"}
# Rules under which a second execution is a deliberate, recorded new request.
NEW_REQUEST_RULES = ("operator_approved_new_request", "new_request_after_not_found")
VIOLATIONS = (
    "duplicates",
    "over_refunded",
    # The ledger's own refund books per charge: refunded or held beyond what the
    # charge took, or less than the provider refunded of it (a provider that
    # refuses over-refunds itself would hide the first from `over_refunded`).
    "ledger_over_refunded",
    "refunds_unaccounted",
    "lost",
    "contradictions",
    "unauthorised_resubmissions",
    "orphans",
    "cancelled_but_charged",
    "reused_key_accepted",
    "wrong_amounts",
)


@dataclass(frozen=True)
class Truth:
    """The provider's own record: executed writes per operation id (charges and
    refunds), and per charge what it took and what was refunded of it; per
    operation id, the amount (minor units) of each write it executed."""

    executed: Counter[str]
    captured: dict[str, int] = field(default_factory=dict)
    refunded: Counter[str] = field(default_factory=Counter)
    amounts: dict[str, list[int]] = field(default_factory=dict)


def judge_ledger(
    conn: Connection,
    truth: Truth,
    accepted: Collection[str],
    reused_key_accepted: int = 0,
) -> dict[str, Any]:
    """Compare the ledger behind `conn` with the provider's truth. `accepted`
    are the operations the ledger said it took (each must be found, settled or
    still watched); `reused_key_accepted` counts what the client saw accepted
    under a key reused with another body. Every name in VIOLATIONS is a count."""
    executed = truth.executed
    whole = read_whole_ledger(conn, NEW_REQUEST_RULES)
    ops, allowed, last_rule = whole.operations, whole.decided_under, whole.last_rule
    open_ops = [op for op in ops.values() if op.state not in FINAL]
    unresolved = Counter(op.state for op in open_ops)
    refund_books = _refund_books(ops)
    return {
        "duplicates": sum(1 for ref, n in executed.items() if n > 1 and n - 1 > allowed[ref]),
        # A charge refunded beyond what it took, at the provider (which, like
        # the sandbox and localstripe, need not refuse it).
        "over_refunded": sum(
            1
            for charge, refunded in truth.refunded.items()
            if refunded > truth.captured.get(charge, 0)
        ),
        "lost": sum(
            1
            for op_id in accepted
            if op_id not in ops
            or (ops[op_id].state not in FINAL and ops[op_id].next_action in (None, "none"))
        ),
        "contradictions": sum(
            1
            for op in ops.values()
            if op.kind in ("payment", "refund")
            and op.state == "OUTCOME_KNOWN"
            and (op.outcome == "succeeded") != (executed[op.operation_id] > 0)
        ),
        "unauthorised_resubmissions": sum(1 for a in whole.later_attempts if a.decision_id is None),
        "orphans": sum(n for ref, n in executed.items() if ref not in ops),
        "cancelled_but_charged": sum(
            1 for op in ops.values() if op.state == "CANCELLED" and executed[op.operation_id]
        ),
        "reused_key_accepted": reused_key_accepted,
        # A payment or refund the provider executed for another amount than
        # the ledger's: a customer charged or refunded what nobody asked.
        "wrong_amounts": sum(
            1
            for op_id, amounts in truth.amounts.items()
            if op_id in ops and any(amount != ops[op_id].amount for amount in amounts)
        ),
        "ledger_over_refunded": sum(
            1 for charge, (captured, taken) in refund_books.items() if taken > captured
        ),
        "refunds_unaccounted": sum(
            1
            for charge, refunded in truth.refunded.items()
            if refunded > refund_books.get(charge, (0, 0))[1]
        ),
        "settled_without_a_person": _settled_without_a_person(
            [ops[op_id] for op_id in accepted if op_id in ops], whole.asked_a_person
        ),
        "went_unknown": whole.went_unknown,
        "unresolved": sum(unresolved.values()),
        "unresolved_by_state": dict(sorted(unresolved.items())),
        "unresolved_next_action": dict(Counter(op.next_action for op in open_ops)),
        # What they wait for: the scenario each one played, and the rule that stopped it.
        "unresolved_by_scenario": dict(
            Counter(op.request_context["body"].get("payment_method", op.kind) for op in open_ops)
        ),
        "unresolved_by_last_rule": dict(
            Counter(last_rule.get(op.operation_id, "none") for op in open_ops)
        ),
    }


def violations_in(report: dict[str, Any]) -> dict[str, int]:
    """The violations a judged report counts, those above 0."""
    return {name: report[name] for name in VIOLATIONS if report[name]}


def _refund_books(ops: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Per refunded charge, what it took and what the ledger counts refunded or
    held against it (domain/refunds.py, as intake and the remedies count it)."""
    by_charge: dict[str, list[Any]] = {}
    for op in ops.values():
        if op.kind == "refund" and op.parent_operation_id in ops:
            by_charge.setdefault(op.request_context.get("charge"), []).append(op)
    books: dict[str, tuple[int, int]] = {}
    for charge, refunds in by_charge.items():
        payment = ops[refunds[0].parent_operation_id]
        captured = captured_by(payment) if charge == payment.provider_reference else payment.amount
        books[charge] = (captured, refund_totals(captured, map(view_of, refunds)).taken)
    return books


def _settled_without_a_person(accepted: list[Any], asked: set[str]) -> dict[str, Any]:
    """Per scenario (the payment method), the share of accepted payments
    settled by evidence or a same-key replay, never handed to a person
    (MANUAL_REVIEW, or an operator's action); and that share over every
    scenario but the sandbox's black hole, whose answers and lookups never come."""
    per: dict[str, list[int]] = {}
    for op in accepted:
        if op.kind != "payment":
            continue
        scenario = op.request_context["body"].get("payment_method", "?")
        alone = op.state in FINAL and op.operation_id not in asked
        counts = per.setdefault(scenario, [0, 0])
        counts[0] += alone
        counts[1] += 1
    but_black_hole = [c for s, c in per.items() if s != "pm_blackhole"]
    settled = sum(c[0] for c in but_black_hole)
    total = sum(c[1] for c in but_black_hole)
    return {
        "by_scenario": {s: round(c[0] / c[1], 4) for s, c in sorted(per.items())},
        "all_but_black_hole": round(settled / total, 4) if total else None,
    }
