"""The sandbox's webhooks: signed as Stripe signs them, sent as a real provider
sends them — late, twice, and out of order.

Only the `pm_webhook_late` scenario sends any (every other scenario sends none,
as a provider whose webhooks are lost would): its charge executes, its answer
is withheld, and `delay` later the sandbox POSTs a signed `charge.succeeded`
event to the target, then the very same event again (a redelivery), then an
older `charge.pending` event for the same charge (out of order). One attempt
each, like localstripe; a receiver that is down simply misses them.

The events are signed with the `Stripe-Signature` scheme (domain/signatures.py),
so the official `stripe` SDK's `Webhook.construct_event` accepts them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx

from intentledger.domain.signatures import stripe_signature_header, verify_stripe_signature
from intentledger.providers.base import UnreadableEvent, WebhookEvent, read_event_json

log = logging.getLogger(__name__)

WEBHOOK_METHOD = "pm_webhook_late"
# The statuses of the sandbox's charges and refunds, in its events and its
# listings, in the lookup's words.
EVENT_STATUS = {"succeeded": "succeeded", "failed": "failed", "pending": "processing"}


def status_word(status: object) -> str:
    """A sandbox status in the lookup's words; one the table does not name is
    marked unmapped, so it never reads as an outcome (a "canceled" would)."""
    return EVENT_STATUS.get(str(status), f"unmapped:{status}")


@dataclass
class SandboxWebhooks:
    url: str
    secret: str
    delay_seconds: float = 1.0
    # Sends in flight: kept so the event loop does not drop them.
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def after_charge(self, reference: str, charges: Callable[[str], list[Any]]) -> None:
        """Schedule the late, repeated, reordered events for `reference`'s charges."""
        task = asyncio.get_running_loop().create_task(self._send_later(reference, charges))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send_later(self, reference: str, charges: Callable[[str], list[Any]]) -> None:
        await asyncio.sleep(self.delay_seconds)
        async with httpx.AsyncClient(timeout=5) as client:
            for charge in charges(reference):
                now = int(time.time())
                succeeded = charge_event("charge.succeeded", charge.id, reference, "succeeded", now)
                pending = charge_event("charge.pending", charge.id, reference, "pending", now - 1)
                for event in (succeeded, succeeded, pending):
                    await self._post(client, event)

    async def _post(self, client: httpx.AsyncClient, event: dict[str, Any]) -> None:
        body, headers = self.signed(event)
        try:
            response = await client.post(self.url, content=body, headers=headers)
            log.info(
                "sandbox webhook %s %s -> %s", event["type"], event["id"], response.status_code
            )
        except httpx.HTTPError as exc:
            log.info("sandbox webhook %s %s not delivered: %s", event["type"], event["id"], exc)

    def signed(self, event: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
        body = json.dumps(event).encode()
        header = stripe_signature_header(body, self.secret, int(time.time()))
        return body, {"Content-Type": "application/json", "Stripe-Signature": header}


def charge_event(
    kind: str, charge_id: str, reference: str, status: str, created: int
) -> dict[str, Any]:
    return {
        "id": "evt_" + secrets.token_hex(8),
        "object": "event",
        "type": kind,
        "created": created,
        "data": {
            "object": {
                "id": charge_id,
                "object": "charge",
                "status": status,
                "reference": reference,
            }
        },
    }


@dataclass(frozen=True)
class SandboxWebhookReader:
    """Verifies and reads the sandbox's events (the sandbox adapter's reader)."""

    secret: str

    def read(self, body: bytes, headers: Mapping[str, str], now: datetime) -> WebhookEvent:
        signed = verify_stripe_signature(
            body, headers.get("stripe-signature"), [self.secret], int(now.timestamp())
        )
        event = read_event_json(body)
        if not isinstance(event, dict) or not isinstance(event.get("id"), str):
            raise UnreadableEvent("the body is not a sandbox event")
        data = event.get("data")
        charge = data.get("object") if isinstance(data, dict) else None
        charge = charge if isinstance(charge, dict) else {}
        status = charge.get("status")
        kind = str(event.get("type", ""))
        mapped = kind.startswith("charge.") and isinstance(charge.get("id"), str)
        return WebhookEvent(
            event_id=event["id"],
            type=kind,
            signed_at=datetime.fromtimestamp(signed, UTC),
            object_id=str(charge["id"]) if "id" in charge else None,
            reference=str(charge["reference"]) if "reference" in charge else None,
            status=status_word(status) if mapped else None,
            payload=event,
            object_kind="payment" if mapped else None,  # a charge's events only
        )
