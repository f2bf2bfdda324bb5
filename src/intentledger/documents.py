"""The JSON shapes of ledger records, as the HTTP contract and the merchant webhooks show them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from intentledger.domain.evidence import recorded_executions
from intentledger.domain.refunds import captured_by, payment_refund_totals
from intentledger.domain.states import State
from intentledger.store.intake import ACCEPT_GROUP_COLUMNS
from intentledger.store.records import (
    AttemptRecord,
    CardRecord,
    MandateRecord,
    ObservationWithDetailRecord,
    OperationRecord,
    TimelineRecord,
)

OPERATION_FIELDS = (
    "operation_id",
    "idempotency_key",
    "state",
    "request_context",
    "first_attempt_at",
    "last_observed_at",
    "retry_after_at",
    "reconciliation_status",
    "key_age_at_decision",
    "provider_retention_note",
    "next_action",
    "actor",
    "route",
    "kind",
    "request_hash",
    "provider",
    "provider_reference",
    "outcome",
    "amount",
    "currency",
    "mandate_id",
    "version",
    "created_at",
    "updated_at",
    "duplicate_detected",
    "outcome_contradicted",
)


# Values JSON carries as they are, told by their exact type: most of a
# document's fields, and cheaper to tell than by the checks below.
_AS_THEY_ARE = frozenset({str, int, bool, type(None)})


def json_value(value: Any) -> Any:
    if type(value) in _AS_THEY_ARE:
        return value
    if isinstance(value, datetime):
        return value.isoformat().replace("+00:00", "Z")
    if isinstance(value, timedelta):
        return value.total_seconds()
    return value


def _mapping(row: OperationRecord | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(row, OperationRecord):
        return row.as_dict()
    return row


def _operation_fields(values: Mapping[str, Any]) -> dict[str, Any]:
    # A loop, not json_value per field: most fields are plain values, and
    # telling them here saves a call each on every intake answer.
    fields = {}
    # A new intent's created_at and updated_at are one object: written once.
    # By identity, not equality: equal instants in other zones write differently.
    last_instant: object = None
    last_written: Any = None
    for name in OPERATION_FIELDS:
        value = values.get(name)
        if type(value) in _AS_THEY_ARE:
            fields[name] = value
        elif value is last_instant:
            fields[name] = last_written
        else:
            last_instant, last_written = value, json_value(value)
            fields[name] = last_written
    return fields


def operation_document(
    operation: OperationRecord | Mapping[str, Any],
    attempts: Sequence[AttemptRecord] = (),
    submit_results: Sequence[ObservationWithDetailRecord] = (),
    refunds: Sequence[OperationRecord] = (),
) -> dict[str, Any]:
    """The public representation; a payment's `refunds` give its refunded and
    refundable amounts (none given: none made yet)."""
    values = _mapping(operation)
    document = {"id": values["operation_id"]}
    document.update(_operation_fields(values))
    if values["kind"] == "payment" and not refunds:
        # What the totals below come to with no refunds, without building them:
        # every accepted intent's answer is such a payment (docs/benchmarks.md step 38).
        document["amount_refunded"] = 0
        document["amount_refundable"] = max(captured_by(values), 0)
    elif values["kind"] == "payment":
        totals = payment_refund_totals(values, refunds)
        document["amount_refunded"] = totals.refunded
        document["amount_refundable"] = totals.refundable
    elif values["kind"] == "refund":
        document["payment_id"] = values.get("parent_operation_id")
        document["refunded_charge"] = values["request_context"].get("charge")
    # Every provider reference the evidence showed executed (two: a duplicate).
    document["executed_references"] = sorted(
        recorded_executions(
            values.get("executed_references"),
            values.get("outcome"),
            values.get("provider_reference"),
        )
    )
    results = {r.attempt_number: r for r in submit_results}
    document["attempts"] = [attempt_document(a, results.get(a.number)) for a in attempts]
    return document


# What `engine.intake.operation_values` gives a new intent: the columns intake's
# writer reads (a test holds the two together). Values with any other field (a
# refund's parent, evidence, a decision's times), or without one of these,
# take `operation_document`.
_NEW_INTENT_FIELDS = frozenset(ACCEPT_GROUP_COLUMNS)


def new_payment_document(values: Mapping[str, Any]) -> dict[str, Any] | None:
    """`operation_document(values)` for a payment intake has just accepted, its
    two instants left as the one UTC `datetime` they are, for orjson to write
    with `OPT_UTC_Z` as `json_value` writes them (`api/app.py: AcceptedIntent`):
    every other field is written as it is, so no field is told by its type.
    None for any other values, which take `operation_document`.
    tests/test_intake_json.py holds the two answers equal."""
    now = values.get("created_at")
    if not (
        type(now) is datetime
        and now.tzinfo is UTC
        and values.get("updated_at") is now
        and values.get("kind") == "payment"
        and values.get("state") == State.ACCEPTED
        and values.keys() == _NEW_INTENT_FIELDS
    ):
        return None
    operation_id = values["operation_id"]
    return {
        "id": operation_id,
        "operation_id": operation_id,
        "idempotency_key": values["idempotency_key"],
        "state": values["state"],
        "request_context": values["request_context"],
        "first_attempt_at": None,
        "last_observed_at": None,
        "retry_after_at": None,
        "reconciliation_status": None,
        "key_age_at_decision": None,
        "provider_retention_note": None,
        "next_action": values["next_action"],
        "actor": values["actor"],
        "route": values["route"],
        "kind": "payment",
        "request_hash": values["request_hash"],
        "provider": values["provider"],
        "provider_reference": None,
        "outcome": None,
        "amount": values["amount"],
        "currency": values["currency"],
        "mandate_id": values.get("mandate_id"),
        "version": values["version"],
        "created_at": now,
        "updated_at": now,
        "duplicate_detected": values["duplicate_detected"],
        "outcome_contradicted": values["outcome_contradicted"],
        # Accepted, nothing captured: what `operation_document` works out.
        "amount_refunded": 0,
        "amount_refundable": 0,
        "executed_references": [],
        "attempts": [],
    }


def attempt_document(
    attempt: AttemptRecord, result: ObservationWithDetailRecord | None
) -> dict[str, Any]:
    return {
        "number": attempt.number,
        "provider_idempotency_key": attempt.provider_idempotency_key,
        "submitted_at": json_value(attempt.submitted_at),
        "relation": attempt.relation,
        "resubmission_of": attempt.resubmission_of,
        "decision_id": attempt.decision_id,
        # Attempts are append-only; their result is the observation recorded for them.
        "transport_result": None if result is None else result.transport,
        "http_status": None if result is None else result.http_status,
        "verdict": None if result is None else result.verdict,
        "provider_reference": None if result is None else result.provider_reference,
    }


def mandate_document(mandate: MandateRecord) -> dict[str, Any]:
    return {
        "id": mandate.mandate_id,
        "status": mandate.status,
        "currency": mandate.currency,
        "max_amount": mandate.max_amount,
        "total_limit": mandate.total_limit,
        "reserved": mandate.reserved,
        "spent": mandate.spent,
        # Counts changes, as an operation's does: a receiver drops an older event by it.
        "version": mandate.version,
        "created_at": json_value(mandate.created_at),
        "updated_at": json_value(mandate.updated_at),
    }


def card_document(card: CardRecord) -> dict[str, Any]:
    return {
        "id": card.card_id,
        "label": card.label,
        "status": card.status,
        "indeterminate": card.indeterminate,
        "pending_operation_id": card.pending_operation_id,
        "provider_card_id": card.provider_card_id,
        "version": card.version,
        "created_at": json_value(card.created_at),
        "updated_at": json_value(card.updated_at),
    }


_EVENT_ORDER = {"observation": 0, "decision": 1, "transition": 2}


def event_documents(tagged: Sequence[tuple[str, TimelineRecord]]) -> list[dict[str, Any]]:
    """Transitions, observations and decisions in time order. Within one
    instant, what was seen comes before what was decided and what changed."""
    ordered = sorted(tagged, key=lambda item: (item[1].at, _EVENT_ORDER[item[0]], item[1].id))
    events = []
    for kind, row in ordered:
        fields = {k: json_value(v) for k, v in row.as_dict().items() if k != "operation_id"}
        events.append({"type": kind, **fields})
    return events
