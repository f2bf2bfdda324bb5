"""Mandates over HTTP: create (idempotent), read, suspend, resume, revoke."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from intentledger.api.bodies import read_json_object
from intentledger.api.schemas import MAX_AMOUNT, Currency
from intentledger.documents import mandate_document
from intentledger.domain.canonical import request_hash
from intentledger.engine import mandates
from intentledger.engine.api_keys import Principal
from intentledger.engine.queries import MandateRecord
from intentledger.web.auth import authenticate
from intentledger.web.problems import Problem, invalid_body_response
from intentledger.web.validation import valid_idempotency_key

router = APIRouter(prefix="/v1/mandates", tags=["mandates"])
Authenticated = Annotated[Principal, Depends(authenticate)]
IdempotencyKey = Annotated[str | None, Header(alias="Idempotency-Key")]


class MandateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    currency: Currency
    max_amount: int = Field(gt=0, le=MAX_AMOUNT, description="Largest single payment, minor units.")
    total_limit: int = Field(gt=0, le=MAX_AMOUNT, description="All payments together, minor units.")

    @model_validator(mode="after")
    def _max_within_total(self) -> MandateRequest:
        if self.max_amount > self.total_limit:
            raise ValueError("max_amount must not exceed total_limit")
        return self


def _keyed(
    request: Request, principal: Principal, route: str, key: str | None, body: Any
) -> mandates.Keyed:
    valid = valid_idempotency_key(key)
    return mandates.Keyed(
        principal.actor,
        route,
        valid,
        request_hash(principal.actor, route, body),
        request.app.state.replay_window,
    )


def _respond(mandate: MandateRecord, replayed: bool, first_status: int) -> JSONResponse:
    headers = {"Idempotent-Replayed": "true"} if replayed else {}
    return JSONResponse(
        mandate_document(mandate), status_code=200 if replayed else first_status, headers=headers
    )


@router.post(
    "",
    status_code=201,
    summary="Create a mandate (idempotent)",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": MandateRequest.model_json_schema()}},
        }
    },
)
async def create_mandate(
    request: Request, principal: Authenticated, idempotency_key: IdempotencyKey = None
) -> JSONResponse:
    valid_idempotency_key(idempotency_key)
    raw = await read_json_object(request)
    try:
        body = MandateRequest.model_validate(raw).model_dump(mode="json")
    except ValidationError as exc:
        return invalid_body_response(request.url.path, exc.errors())
    keyed = _keyed(request, principal, mandates.CREATE_ROUTE, idempotency_key, body)
    mandate, replayed = await mandates.create_mandate(
        request.app.state.engine, request.app.state.clock, keyed, body
    )
    return _respond(mandate, replayed, 201)


@router.get("/{mandate_id}", summary="A mandate with its reserved and spent amounts")
async def get_mandate(mandate_id: str, request: Request, principal: Authenticated) -> JSONResponse:
    mandate = await mandates.read_mandate(request.app.state.engine, principal.actor, mandate_id)
    if mandate is None:
        raise Problem(404, "mandate-not-found", "Not Found", f"no mandate {mandate_id!r}")
    return JSONResponse(mandate_document(mandate))


async def _change(
    request: Request,
    principal: Principal,
    mandate_id: str,
    action: mandates.MandateAction,
    idempotency_key: str | None,
) -> JSONResponse:
    route = f"POST /v1/mandates/{{id}}/{action}"
    keyed = _keyed(request, principal, route, idempotency_key, {"id": mandate_id})
    mandate, replayed = await mandates.change_status(
        request.app.state.engine, request.app.state.clock, keyed, mandate_id, action
    )
    return _respond(mandate, replayed, 200)


@router.post("/{mandate_id}/suspend", summary="Suspend; cancels payments not yet submitted")
async def suspend(
    mandate_id: str,
    request: Request,
    principal: Authenticated,
    idempotency_key: IdempotencyKey = None,
) -> JSONResponse:
    return await _change(request, principal, mandate_id, "suspend", idempotency_key)


@router.post("/{mandate_id}/resume", summary="Resume a suspended mandate")
async def resume(
    mandate_id: str,
    request: Request,
    principal: Authenticated,
    idempotency_key: IdempotencyKey = None,
) -> JSONResponse:
    return await _change(request, principal, mandate_id, "resume", idempotency_key)


@router.post("/{mandate_id}/revoke", summary="Revoke for good; cancels payments not yet submitted")
async def revoke(
    mandate_id: str,
    request: Request,
    principal: Authenticated,
    idempotency_key: IdempotencyKey = None,
) -> JSONResponse:
    return await _change(request, principal, mandate_id, "revoke", idempotency_key)
