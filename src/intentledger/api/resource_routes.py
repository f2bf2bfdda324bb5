"""Synchronous writes over HTTP: beneficiaries and cards.

The provider is called in the request path: a definite answer is 201 with the
result; a lost one is 202 with the operation UNKNOWN (and a card marked
`indeterminate`) — never a 500, never a false failure. Equal retries are 200
with `Idempotent-Replayed: true` and the operation's current state.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema

from intentledger.api.bodies import read_json_object
from intentledger.documents import card_document, operation_document
from intentledger.domain.canonical import request_hash
from intentledger.domain.iban import normalise_iban
from intentledger.domain.states import State
from intentledger.engine import cards, queries
from intentledger.engine.api_keys import Principal
from intentledger.engine.intake import Intent, Prepare
from intentledger.engine.sync_writes import SyncWriter, WriteResult
from intentledger.web.auth import authenticate
from intentledger.web.problems import Problem, invalid_body_response
from intentledger.web.validation import valid_idempotency_key

router = APIRouter(tags=["beneficiaries and cards"])
Authenticated = Annotated[Principal, Depends(authenticate)]
IdempotencyKey = Annotated[str | None, Header(alias="Idempotency-Key")]
Scenario = Literal["ok", "declined", "timeout_after_execute", "timeout_before_execute"]


class ScenarioBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    sandbox_scenario: Scenario | None = Field(
        default=None, description="Sandbox only: the fault the sandbox provider plays."
    )


class BeneficiaryRequest(ScenarioBody):
    name: str = Field(min_length=1, max_length=140)
    iban: Annotated[
        str,
        AfterValidator(normalise_iban),
        # What normalise_iban accepts, less the check digits no pattern can state.
        WithJsonSchema(
            {
                "type": "string",
                "pattern": "^ *[A-Za-z] *[A-Za-z] *[0-9] *[0-9]( *[A-Za-z0-9]){11,30} *$",
            }
        ),
    ]


class CardRequest(ScenarioBody):
    label: str | None = Field(default=None, max_length=100)


async def _validated(request: Request, model: type[ScenarioBody]) -> dict[str, Any] | JSONResponse:
    raw = await read_json_object(request)
    try:
        body = model.model_validate(raw).model_dump(mode="json", exclude_none=True)
    except ValidationError as exc:
        return invalid_body_response(request.url.path, exc.errors())
    if "sandbox_scenario" in body and request.app.state.provider_name != "sandbox":
        raise Problem(
            422,
            "sandbox-only",
            "Unprocessable Content",
            "sandbox_scenario is accepted only while the provider is the sandbox",
        )
    return body


async def _write(
    request: Request,
    principal: Principal,
    route: str,
    kind: str,
    key: str | None,
    body: dict[str, Any],
    prepare: Prepare | None = None,
    hash_extra: dict[str, Any] | None = None,
) -> WriteResult:
    valid_key = valid_idempotency_key(key)
    provider = request.app.state.provider_name
    if kind not in request.app.state.provider_kinds:
        # Refused before anything is stored: no provider could carry it.
        raise Problem(
            422,
            "kind-not-supported",
            "Unprocessable Content",
            f"{kind.replace('_', ' ')} writes are not supported by provider {provider}",
        )
    intent = Intent(
        actor=principal.actor,
        route=route,
        idempotency_key=valid_key,
        request_hash=request_hash(principal.actor, route, {**body, **(hash_extra or {})}),
        body=body,
        provider=provider,
        kind=kind,
        replay_window=request.app.state.replay_window,
    )
    writer: SyncWriter | None = request.app.state.sync_writer
    if writer is None:
        raise Problem(503, "no-provider", "Service Unavailable", "no provider is configured")
    return await (writer.write(intent, prepare) if prepare else writer.write(intent))


def _status(result: WriteResult) -> int:
    if result.replayed:
        return 200
    return 201 if result.operation.state == State.OUTCOME_KNOWN else 202


def _headers(result: WriteResult) -> dict[str, str]:
    return {"Idempotent-Replayed": "true"} if result.replayed else {}


def _schema(model: type[BaseModel]) -> dict[str, Any]:
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": model.model_json_schema()}},
        }
    }


@router.post(
    "/v1/beneficiaries",
    summary="Create a beneficiary at the provider (synchronous)",
    status_code=201,
    openapi_extra=_schema(BeneficiaryRequest),
)
async def create_beneficiary(
    request: Request, principal: Authenticated, idempotency_key: IdempotencyKey = None
) -> JSONResponse:
    valid_idempotency_key(idempotency_key)
    body = await _validated(request, BeneficiaryRequest)
    if isinstance(body, JSONResponse):
        return body
    result = await _write(
        request, principal, "POST /v1/beneficiaries", "beneficiary", idempotency_key, body
    )
    return JSONResponse(
        operation_document(result.operation), status_code=_status(result), headers=_headers(result)
    )


async def _card_response(request: Request, result: WriteResult) -> JSONResponse:
    card = await queries.card_of(
        request.app.state.engine, result.operation.request_context["card_id"]
    )
    assert card is not None
    document = card_document(card)
    document["operation"] = operation_document(result.operation)
    return JSONResponse(document, status_code=_status(result), headers=_headers(result))


@router.post(
    "/v1/cards",
    summary="Issue a card (synchronous)",
    status_code=201,
    openapi_extra=_schema(CardRequest),
)
async def issue_card(
    request: Request, principal: Authenticated, idempotency_key: IdempotencyKey = None
) -> JSONResponse:
    valid_idempotency_key(idempotency_key)
    body = await _validated(request, CardRequest)
    if isinstance(body, JSONResponse):
        return body
    prepare = cards.prepare_issue(cards.new_card_id(), body.get("label"))
    result = await _write(
        request, principal, "POST /v1/cards", "card_issue", idempotency_key, body, prepare
    )
    return await _card_response(request, result)


async def _card_action(
    request: Request, principal: Principal, card_id: str, kind: str, key: str | None
) -> JSONResponse:
    valid_idempotency_key(key)
    body = await _validated(request, ScenarioBody)
    if isinstance(body, JSONResponse):
        return body
    verb = kind.removeprefix("card_")
    result = await _write(
        request,
        principal,
        f"POST /v1/cards/{{id}}/{verb}",
        kind,
        key,
        body,
        cards.prepare_action(card_id, kind),
        hash_extra={"card_id": card_id},
    )
    return await _card_response(request, result)


@router.post(
    "/v1/cards/{card_id}/freeze",
    summary="Freeze a card (synchronous)",
    openapi_extra=_schema(ScenarioBody),
)
async def freeze_card(
    card_id: str,
    request: Request,
    principal: Authenticated,
    idempotency_key: IdempotencyKey = None,
) -> JSONResponse:
    return await _card_action(request, principal, card_id, "card_freeze", idempotency_key)


@router.post(
    "/v1/cards/{card_id}/unfreeze",
    summary="Unfreeze a card (synchronous)",
    openapi_extra=_schema(ScenarioBody),
)
async def unfreeze_card(
    card_id: str,
    request: Request,
    principal: Authenticated,
    idempotency_key: IdempotencyKey = None,
) -> JSONResponse:
    return await _card_action(request, principal, card_id, "card_unfreeze", idempotency_key)


@router.get("/v1/cards/{card_id}", summary="A card's projection")
async def get_card(card_id: str, request: Request, principal: Authenticated) -> JSONResponse:
    card = await queries.card_of(request.app.state.engine, card_id)
    if card is None or card.actor != principal.actor:
        raise Problem(404, "card-not-found", "Not Found", f"no card {card_id!r}")
    return JSONResponse(card_document(card))
