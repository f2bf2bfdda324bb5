"""The conformance kit (intentledger.testing.conformance) run for the Stripe
adapter, on both databases, with events built as Stripe sends them and signed
by the official `stripe` SDK."""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import stripe
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.signatures import STRIPE_TOLERANCE_SECONDS
from intentledger.providers.stripe import (
    INTENT_STATUSES,
    REFERENCE_KEY,
    REFUND_STATUSES,
    StripeWebhooks,
    lookup_word,
    refund_lookup_word,
)
from intentledger.testing import conformance
from intentledger.testing.conformance import EventAbout

RETIRED, CURRENT = "whsec_conformance_retired", "whsec_conformance_current"


def sign(body: bytes, secret: str, at: int) -> Mapping[str, str]:
    header = stripe.WebhookSignature.generate_signature_header(body.decode(), secret, at)
    return {"Stripe-Signature": header}


def stripe_event(event_id: str, kind: str, item: dict[str, Any], created: int) -> bytes:
    event = {
        "id": event_id,
        "object": "event",
        "type": kind,
        "created": created,
        "data": {"object": item},
    }
    return json.dumps(event).encode()


def event(about: EventAbout) -> bytes:
    metadata = {REFERENCE_KEY: about.reference}
    if about.object_kind == "payment":
        status = "succeeded" if about.final else "processing"
        intent = {
            "id": "pi_" + secrets.token_hex(12),
            "object": "payment_intent",
            "status": status,
            "metadata": metadata,
        }
        return stripe_event(about.event_id, f"payment_intent.{status}", intent, about.created)
    assert about.object_kind == "refund"
    refund = {
        "id": "re_" + secrets.token_hex(12),
        "object": "refund",
        "status": "succeeded" if about.final else "pending",
        "metadata": metadata,
    }
    return stripe_event(about.event_id, "refund.updated", refund, about.created)


WEBHOOKS = conformance.Webhooks(
    provider="stripe",
    reader=StripeWebhooks((RETIRED, CURRENT)),
    secrets=(RETIRED, CURRENT),
    sign=sign,
    event=event,
    object_kinds=frozenset({"payment", "refund"}),
    tolerance=timedelta(seconds=STRIPE_TOLERANCE_SECONDS),
)


async def test_a_payment_event_settles_no_refund_and_a_refund_event_no_payment(
    engine: AsyncEngine,
) -> None:
    await conformance.check_kind(engine, WEBHOOKS)


async def test_stripes_webhooks_verify_rotate_and_deduplicate(engine: AsyncEngine) -> None:
    await conformance.check_webhook_verification(engine, WEBHOOKS)


def read_signed(body: bytes) -> str | None:
    now = datetime.now(UTC)
    header = sign(body, CURRENT, int(now.timestamp()))["Stripe-Signature"]
    return WEBHOOKS.reader.read(body, {"stripe-signature": header}, now).status


# A declined intent carries its error: requires_payment_method then means failed.
DECLINED = {"last_payment_error": {"code": "card_declined"}}
INTENT_WORDS = {status: known.lookup_word for status, known in INTENT_STATUSES.items()}
REFUND_WORDS = {status: known.lookup_word for status, known in REFUND_STATUSES.items()}


def intent_event_in(status: str) -> str | None:
    intent = {"id": "pi_1", "object": "payment_intent", "status": status, **DECLINED}
    return read_signed(stripe_event("evt_1", "payment_intent.succeeded", intent, 0))


def refund_event_in(status: str) -> str | None:
    refund = {"id": "re_1", "object": "refund", "status": status}
    return read_signed(stripe_event("evt_1", "refund.updated", refund, 0))


def test_no_status_stripe_does_not_name_is_an_outcome() -> None:
    conformance.check_status_mapping(
        lambda status: lookup_word({"status": status, **DECLINED}), INTENT_WORDS
    )
    conformance.check_status_mapping(
        lambda status: refund_lookup_word({"status": status}), REFUND_WORDS
    )
    conformance.check_status_mapping(intent_event_in, INTENT_WORDS)
    conformance.check_status_mapping(refund_event_in, REFUND_WORDS)
