"""The conformance kit (intentledger.testing.conformance) run for the sandbox
adapter, on both databases: what a plug-in's own tests would look like."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta

from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.signatures import STRIPE_TOLERANCE_SECONDS, stripe_signature_header
from intentledger.providers.sandbox.webhooks import (
    EVENT_STATUS,
    SandboxWebhookReader,
    charge_event,
)
from intentledger.providers.sandbox_client import seen_in_listing
from intentledger.testing import conformance
from intentledger.testing.conformance import EventAbout

SECRET = "whsec_sandbox_conformance"


def sign(body: bytes, secret: str, at: int) -> Mapping[str, str]:
    return {"Stripe-Signature": stripe_signature_header(body, secret, at)}


def event(about: EventAbout) -> bytes:
    assert about.object_kind == "payment", "the sandbox's events are about charges only"
    status = "succeeded" if about.final else "pending"
    charge_id = "ch_" + about.event_id.removeprefix("evt_kit_")
    body = charge_event(f"charge.{status}", charge_id, about.reference, status, about.created)
    body["id"] = about.event_id
    return json.dumps(body).encode()


WEBHOOKS = conformance.Webhooks(
    provider="sandbox",
    reader=SandboxWebhookReader(SECRET),
    secrets=(SECRET,),
    sign=sign,
    event=event,
    object_kinds=frozenset({"payment"}),
    tolerance=timedelta(seconds=STRIPE_TOLERANCE_SECONDS),
)


async def test_a_charge_event_settles_no_refund_and_no_card(engine: AsyncEngine) -> None:
    await conformance.check_kind(engine, WEBHOOKS)


async def test_the_sandboxs_webhooks_verify_and_deduplicate(engine: AsyncEngine) -> None:
    await conformance.check_webhook_verification(engine, WEBHOOKS)


def charge_event_in(status: str) -> str | None:
    """The reader's word for a signed charge event whose charge is in `status`."""
    body = json.dumps(charge_event("charge.updated", "ch_1", "op_x", status, 0)).encode()
    now = datetime.now(UTC)
    signed = sign(body, SECRET, int(now.timestamp()))
    return WEBHOOKS.reader.read(body, {"stripe-signature": signed["Stripe-Signature"]}, now).status


def test_no_status_the_sandbox_does_not_name_is_an_outcome() -> None:
    conformance.check_status_mapping(charge_event_in, EVENT_STATUS)
    for kind in ("payment", "refund"):
        conformance.check_status_mapping(
            lambda status, kind=kind: seen_in_listing({"id": "x", "status": status}, kind).status,
            EVENT_STATUS,
        )
