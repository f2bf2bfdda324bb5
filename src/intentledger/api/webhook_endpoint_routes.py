"""Merchant webhook endpoints over HTTP: create (idempotent), list, read,
delete, and the deliveries made to one with every attempt."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from intentledger.api.bodies import read_json_object
from intentledger.api.schemas import MAX_ROW_ID
from intentledger.documents import json_value
from intentledger.domain.canonical import request_hash
from intentledger.domain.merchant_events import EVENT_TYPES
from intentledger.domain.webhook_targets import MAX_URL_LENGTH
from intentledger.engine import webhook_endpoints
from intentledger.engine.api_keys import Principal
from intentledger.engine.mandates import Keyed
from intentledger.engine.queries import (
    ListedDeliveryRecord,
    WebhookAttemptRecord,
    WebhookEndpointRecord,
)
from intentledger.web.auth import authenticate
from intentledger.web.problems import Problem, invalid_body_response
from intentledger.web.validation import valid_idempotency_key

router = APIRouter(prefix="/v1/webhook-endpoints", tags=["merchant webhooks"])
Authenticated = Annotated[Principal, Depends(authenticate)]
IdempotencyKey = Annotated[str | None, Header(alias="Idempotency-Key")]
EventType = Literal[
    "operation.outcome_known",
    "operation.unknown",
    "operation.manual_review",
    "operation.contradicted",
    "operation.duplicate_detected",
    "mandate.updated",
    "card.updated",
]
assert set(EventType.__args__) == set(EVENT_TYPES)  # type: ignore[attr-defined]


class EndpointRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    url: str = Field(
        min_length=1,
        max_length=MAX_URL_LENGTH,
        description="https on a public address (private targets only where the service "
        "allows them, for development)",
    )
    events: list[EventType] | None = Field(
        default=None,
        min_length=1,
        description="The event types to send; omitted: every type",
    )


def endpoint_document(
    endpoint: WebhookEndpointRecord, *, with_secret: bool = False
) -> dict[str, Any]:
    document: dict[str, Any] = {
        "id": endpoint.endpoint_id,
        "url": endpoint.url,
        "events": endpoint.events,
        "created_at": json_value(endpoint.created_at),
    }
    if endpoint.deleted_at is not None:
        document["deleted_at"] = json_value(endpoint.deleted_at)
    if with_secret:
        document["secret"] = endpoint.secret
    return document


def _not_found(endpoint_id: str) -> Problem:
    # Another actor's endpoint is indistinguishable from a missing one.
    return Problem(
        404, "webhook-endpoint-not-found", "Not Found", f"no webhook endpoint {endpoint_id!r}"
    )


@router.post(
    "",
    status_code=201,
    summary="Register a webhook endpoint (idempotent); its signing secret is in this answer only",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": EndpointRequest.model_json_schema()}},
        }
    },
)
async def create_endpoint(
    request: Request, principal: Authenticated, idempotency_key: IdempotencyKey = None
) -> JSONResponse:
    key = valid_idempotency_key(idempotency_key)
    raw = await read_json_object(request)
    try:
        parsed = EndpointRequest.model_validate(raw)
    except ValidationError as exc:
        return invalid_body_response(request.url.path, exc.errors())
    # Subscriptions as a set: the same types in another order are the same request.
    events: list[str] | None = None if parsed.events is None else sorted(set(parsed.events))
    body = {"url": parsed.url, "events": events}
    route = webhook_endpoints.CREATE_ROUTE
    keyed = Keyed(
        principal.actor,
        route,
        key,
        request_hash(principal.actor, route, body),
        request.app.state.replay_window,
    )
    created = await webhook_endpoints.create_endpoint(
        request.app.state.engine,
        request.app.state.clock,
        keyed,
        parsed.url,
        events,
        request.app.state.webhook_allow_private,
    )
    return JSONResponse(
        endpoint_document(created.endpoint, with_secret=True),
        status_code=200 if created.replayed else 201,
        headers={"Idempotent-Replayed": "true"} if created.replayed else {},
    )


@router.get("", summary="The actor's webhook endpoints")
async def list_endpoints(request: Request, principal: Authenticated) -> JSONResponse:
    found = await webhook_endpoints.list_endpoints(request.app.state.engine, principal.actor)
    return JSONResponse({"data": [endpoint_document(e) for e in found]})


@router.get("/{endpoint_id}", summary="A webhook endpoint (without its secret)")
async def get_endpoint(
    endpoint_id: str, request: Request, principal: Authenticated
) -> JSONResponse:
    found = await webhook_endpoints.read_endpoint(
        request.app.state.engine, principal.actor, endpoint_id
    )
    if found is None:
        raise _not_found(endpoint_id)
    return JSONResponse(endpoint_document(found))


@router.delete(
    "/{endpoint_id}", summary="Stop sending to an endpoint; what it has not received is cancelled"
)
async def delete_endpoint(
    endpoint_id: str, request: Request, principal: Authenticated
) -> JSONResponse:
    deleted = await webhook_endpoints.delete_endpoint(
        request.app.state.engine, request.app.state.clock, principal.actor, endpoint_id
    )
    if not deleted:
        raise _not_found(endpoint_id)
    return JSONResponse({"id": endpoint_id, "deleted": True})


@router.get(
    "/{endpoint_id}/deliveries",
    summary="Events sent to an endpoint, newest first, each with every attempt",
)
async def list_deliveries(
    endpoint_id: str,
    request: Request,
    principal: Authenticated,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    starting_after: Annotated[
        int | None, Query(ge=1, le=MAX_ROW_ID, description="A delivery id: list older ones")
    ] = None,
) -> JSONResponse:
    page = await webhook_endpoints.deliveries_page(
        request.app.state.engine, principal.actor, endpoint_id, limit, starting_after
    )
    if page is None:
        raise _not_found(endpoint_id)
    return JSONResponse(
        {
            "data": [delivery_document(d, page.attempts[d.id]) for d in page.deliveries],
            "has_more": page.has_more,
        }
    )


def delivery_document(
    delivery: ListedDeliveryRecord, attempts: list[WebhookAttemptRecord]
) -> dict[str, Any]:
    waiting = delivery.status == "pending" and delivery.lease_owner is None
    return {
        "id": delivery.id,
        "event_id": delivery.event_id,
        "type": delivery.type,
        "object_id": delivery.object_id,
        "status": delivery.status,
        "in_flight": delivery.status == "pending" and delivery.lease_owner is not None,
        "next_attempt_at": json_value(delivery.due_at) if waiting else None,
        "created_at": json_value(delivery.created_at),
        "finished_at": json_value(delivery.finished_at),
        "attempts": [
            {
                "at": json_value(a.at),
                "duration_ms": a.duration_ms,
                "http_status": a.http_status,
                "error": a.error,
                "delivered": a.delivered,
                "next_attempt_at": json_value(a.next_attempt_at),
            }
            for a in attempts
        ],
    }
