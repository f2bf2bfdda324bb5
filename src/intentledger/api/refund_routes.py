"""Refunds over HTTP: `POST /v1/payments/{id}/refunds` (idempotent, 202) and
`GET /v1/payments/{id}/refunds`."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse
from pydantic import Field, ValidationError

from intentledger.api.bodies import read_json_object
from intentledger.api.resource_routes import ScenarioBody
from intentledger.api.schemas import MAX_AMOUNT
from intentledger.documents import operation_document
from intentledger.domain.canonical import request_hash
from intentledger.engine import queries
from intentledger.engine.api_keys import Principal
from intentledger.engine.intake import Intent
from intentledger.engine.refunds import REFUND_ROUTE, accept_refund
from intentledger.web.auth import authenticate
from intentledger.web.problems import Problem, invalid_body_response
from intentledger.web.validation import valid_idempotency_key

router = APIRouter(tags=["refunds"])
Authenticated = Annotated[Principal, Depends(authenticate)]
IdempotencyKey = Annotated[str | None, Header(alias="Idempotency-Key")]


class RefundRequest(ScenarioBody):
    amount: int | None = Field(
        default=None,
        gt=0,
        le=MAX_AMOUNT,
        description="Minor units; omitted (send {}): all that is still refundable",
    )
    reason: str | None = Field(default=None, min_length=1, max_length=500)


def _not_found(payment_id: str) -> Problem:
    # Another actor's payment is indistinguishable from a missing one.
    return Problem(404, "payment-not-found", "Not Found", f"no payment {payment_id!r}")


@router.post(
    "/v1/payments/{payment_id}/refunds",
    status_code=202,
    summary="Refund a succeeded payment, in whole or in part (idempotent)",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": RefundRequest.model_json_schema()}},
        }
    },
)
async def create_refund(
    payment_id: str,
    request: Request,
    principal: Authenticated,
    idempotency_key: IdempotencyKey = None,
) -> JSONResponse:
    key = valid_idempotency_key(idempotency_key)
    provider = request.app.state.provider_name
    if "refund" not in request.app.state.provider_kinds:
        raise Problem(
            422,
            "kind-not-supported",
            "Unprocessable Content",
            f"refunds are not supported by provider {provider}",
        )
    raw = await read_json_object(request)
    try:
        parsed = RefundRequest.model_validate(raw)
    except ValidationError as exc:
        return invalid_body_response(request.url.path, exc.errors())
    body: dict[str, Any] = {"payment_id": payment_id, **parsed.model_dump(exclude_none=True)}
    intent = Intent(
        actor=principal.actor,
        route=REFUND_ROUTE,
        idempotency_key=key,
        request_hash=request_hash(principal.actor, REFUND_ROUTE, body),
        body=body,
        provider=provider,
        kind="refund",
        replay_window=request.app.state.replay_window,
    )
    result = await accept_refund(
        request.app.state.engine, request.app.state.clock, intent, payment_id
    )
    return JSONResponse(
        operation_document(result.operation),
        status_code=200 if result.replayed else 202,
        headers={"Idempotent-Replayed": "true"} if result.replayed else {},
    )


@router.get("/v1/payments/{payment_id}/refunds", summary="A payment's refunds, oldest first")
async def list_refunds(payment_id: str, request: Request, principal: Authenticated) -> JSONResponse:
    found = await queries.payment_refunds(request.app.state.engine, payment_id)
    if found is None or found[0].actor != principal.actor or found[0].kind != "payment":
        raise _not_found(payment_id)
    _payment, refunds = found
    return JSONResponse({"data": [operation_document(r) for r in refunds]})
