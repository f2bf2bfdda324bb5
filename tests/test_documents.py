"""An operation's document takes shortcuts on intake's path (docs/benchmarks.md
step 38); each must write what the general rule writes."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from intentledger.documents import operation_document
from intentledger.domain.refunds import payment_refund_totals
from intentledger.domain.states import Outcome, State
from intentledger.engine.intake import Intent, operation_values

BODY = {"amount": 1250, "currency": "EUR", "payment_method": "pm_ok"}
NOW = datetime(2026, 12, 4, 18, 0, 0, 123456, tzinfo=UTC)


def payment_values() -> dict[str, object]:
    intent = Intent("shop", "POST /v1/payments", "k-1", "0" * 64, BODY, "sandbox")
    return operation_values(intent, NOW)


def test_a_new_intents_one_instant_is_written_for_both_fields() -> None:
    document = operation_document(payment_values())
    assert document["created_at"] == document["updated_at"] == "2026-12-04T18:00:00.123456Z"


def test_an_equal_instant_in_another_zone_is_written_in_its_own() -> None:
    values = payment_values()
    values["updated_at"] = NOW.astimezone(timezone(timedelta(hours=1)))
    document = operation_document(values)
    assert document["created_at"] == "2026-12-04T18:00:00.123456Z"
    assert document["updated_at"] == "2026-12-04T19:00:00.123456+01:00"


@pytest.mark.parametrize("state", list(State))
@pytest.mark.parametrize("outcome", [None, *Outcome])
@pytest.mark.parametrize("reference", [None, "ch_1"])
def test_a_payment_without_refunds_has_the_totals_of_none(
    state: State, outcome: Outcome | None, reference: str | None
) -> None:
    values = {**payment_values(), "state": state, "outcome": outcome}
    values["provider_reference"] = reference
    totals = payment_refund_totals(values, ())
    document = operation_document(values)
    assert (document["amount_refunded"], document["amount_refundable"]) == (
        totals.refunded,
        totals.refundable,
    )
