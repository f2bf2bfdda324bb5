"""Provider webhooks: `POST /v1/provider-webhooks/{provider}`.

No bearer token: the provider proves itself by its signature, which the
adapter verifies over the raw body before anything is stored. A refused
signature stores nothing (it is counted, and logged); a verified event is
stored once and judged as evidence (engine/provider_events.py).
"""

from __future__ import annotations

import logging
from collections import Counter

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from intentledger.domain.signatures import SignatureRefused
from intentledger.engine.provider_events import receive
from intentledger.observability.metrics import WEBHOOKS_IN
from intentledger.providers.base import (
    BatchWebhookReader,
    UnreadableEvent,
    Webhooks,
    read_events,
)
from intentledger.web.problems import Problem

log = logging.getLogger(__name__)
router = APIRouter(tags=["webhooks"])
PROVIDER_WEBHOOKS = "/v1/provider-webhooks/"


@router.post(
    PROVIDER_WEBHOOKS + "{provider}",
    summary="A provider's webhook: verified by its signature, stored once, judged as evidence",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {
                    "schema": {
                        "type": "object",
                        "description": "The provider's event, exactly as it signed it",
                        "propertyNames": {"type": "string", "pattern": "^[^\\x00]*$"},
                        "additionalProperties": {"$ref": "#/components/schemas/NulFreeJson"},
                    }
                }
            },
        }
    },
)
async def provider_webhook(provider: str, request: Request) -> Response:
    readers: dict[str, Webhooks] = request.app.state.webhook_readers
    reader = readers.get(provider)
    if reader is None:
        raise Problem(
            404,
            "no-webhook-endpoint",
            "Not Found",
            f"webhooks of provider {provider!r} are not taken here (is its webhook secret set?)",
        )
    body = await request.body()
    clock = request.app.state.clock
    try:
        events = read_events(reader, body, request.headers, clock())
    except SignatureRefused as exc:
        rejected: Counter[str] = request.app.state.webhook_rejections
        rejected[provider] += 1
        # `provider` is one of the configured readers' names: a bounded label.
        WEBHOOKS_IN.labels(provider, "rejected").inc()
        log.warning(
            "provider %s webhook refused: %s",
            provider,
            exc,
            extra={"event": "webhook_in.rejected", "provider": provider},
        )
        raise Problem(400, "signature-refused", "Bad Request", str(exc)) from exc
    except UnreadableEvent as exc:
        WEBHOOKS_IN.labels(provider, "unreadable").inc()
        log.warning(
            "provider %s webhook verified but unreadable: %s",
            provider,
            exc,
            extra={"event": "webhook_in.unreadable", "provider": provider},
        )
        raise Problem(400, "unreadable-event", "Bad Request", str(exc)) from exc
    receipts = []
    for event in events:
        # Each event in its own transaction: a batch cut short by a crash is
        # resent whole, and what was stored finds its row.
        receipt = await receive(
            request.app.state.engine, clock, provider, event, request.app.state.recheck_backoff
        )
        # Counted once `receive` has committed the event (or found it stored).
        WEBHOOKS_IN.labels(provider, "duplicate" if receipt.duplicate else "verified").inc()
        receipts.append(receipt)
    if isinstance(reader, BatchWebhookReader):
        # The provider reads only its acknowledgement (Adyen: `[accepted]`).
        return PlainTextResponse(reader.acknowledgement)
    (receipt,) = receipts
    return JSONResponse(
        {
            "event_id": receipt.event_id,
            "disposition": receipt.disposition,
            "duplicate": receipt.duplicate,
            "operation_id": receipt.operation_id,
        }
    )
