"""Operator endpoints: list, inspect and act on any actor's operations.

Every action needs the operator role and an Idempotency-Key, and is recorded
with who did it and why.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from intentledger.documents import event_documents, json_value, operation_document
from intentledger.domain.states import State
from intentledger.engine import operator
from intentledger.engine.api_keys import Principal
from intentledger.web.auth import authenticate
from intentledger.web.operator_actions import (
    ReasonRequest,
    RefundDuplicateRequest,
    ResolveRequest,
    perform_operator_action,
)
from intentledger.web.problems import Problem
from intentledger.web.validation import valid_idempotency_key

router = APIRouter(prefix="/v1/ops", tags=["operator"])


async def require_operator(principal: Annotated[Principal, Depends(authenticate)]) -> Principal:
    if not principal.is_operator:
        raise Problem(
            403,
            "operator-role-required",
            "Forbidden",
            "this endpoint needs a key with the operator role",
        )
    return principal


Operator = Annotated[Principal, Depends(require_operator)]


def _age_seconds(created_at: datetime, now: datetime) -> float:
    return round((now - created_at).total_seconds(), 3)


@router.get("/operations", summary="Operations of every actor, newest first")
async def list_operations(
    request: Request,
    _principal: Operator,
    state: Annotated[State | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> JSONResponse:
    rows = await operator.list_operations(request.app.state.engine, state, limit)
    now = request.app.state.clock()
    return JSONResponse(
        {
            "data": [
                {
                    "id": row.operation_id,
                    "actor": row.actor,
                    "state": row.state,
                    "next_action": row.next_action,
                    "age_seconds": _age_seconds(row.created_at, now),
                    "amount": row.amount,
                    "currency": row.currency,
                    "retry_after_at": json_value(row.retry_after_at),
                    "reconciliation_status": row.reconciliation_status,
                    "outcome": row.outcome,
                }
                for row in rows
            ]
        }
    )


@router.get("/operations/{operation_id}", summary="The record and its whole timeline")
async def show_operation(operation_id: str, request: Request, _principal: Operator) -> JSONResponse:
    shown = await operator.show(request.app.state.engine, operation_id)
    document = operation_document(
        shown["operation"], shown["attempts"], shown["submit_results"], shown["refunds"]
    )
    document["events"] = event_documents(shown["events"])
    return JSONResponse(document)


async def _act(
    request: Request,
    principal: Principal,
    operation_id: str,
    verb: str,
    body: BaseModel,
    idempotency_key: str | None,
) -> JSONResponse:
    key = valid_idempotency_key(idempotency_key)
    done, replayed = await perform_operator_action(
        request, principal, operation_id, verb, body, key
    )
    shown = await operator.show(request.app.state.engine, operation_id)
    document = operation_document(
        shown["operation"], shown["attempts"], shown["submit_results"], shown["refunds"]
    )
    document["action"] = done
    headers = {"Idempotent-Replayed": "true"} if replayed else {}
    return JSONResponse(document, headers=headers)


IdempotencyKey = Annotated[str | None, Header(alias="Idempotency-Key")]


@router.post("/operations/{operation_id}/resolve", summary="Settle on evidence a person found")
async def resolve(
    operation_id: str,
    body: ResolveRequest,
    request: Request,
    principal: Operator,
    idempotency_key: IdempotencyKey = None,
) -> JSONResponse:
    return await _act(request, principal, operation_id, "resolve", body, idempotency_key)


@router.post(
    "/operations/{operation_id}/approve-resubmission",
    summary="Approve a deliberate new request with a new provider key",
)
async def approve_resubmission(
    operation_id: str,
    body: ReasonRequest,
    request: Request,
    principal: Operator,
    idempotency_key: IdempotencyKey = None,
) -> JSONResponse:
    return await _act(
        request, principal, operation_id, "approve-resubmission", body, idempotency_key
    )


@router.post("/operations/{operation_id}/escalate", summary="Hand it to a person now")
async def escalate(
    operation_id: str,
    body: ReasonRequest,
    request: Request,
    principal: Operator,
    idempotency_key: IdempotencyKey = None,
) -> JSONResponse:
    return await _act(request, principal, operation_id, "escalate", body, idempotency_key)


@router.post(
    "/operations/{operation_id}/refund-duplicate",
    summary="Refund a duplicate charge of a payment flagged duplicate_detected",
)
async def refund_duplicate(
    operation_id: str,
    body: RefundDuplicateRequest,
    request: Request,
    principal: Operator,
    idempotency_key: IdempotencyKey = None,
) -> JSONResponse:
    return await _act(request, principal, operation_id, "refund-duplicate", body, idempotency_key)
