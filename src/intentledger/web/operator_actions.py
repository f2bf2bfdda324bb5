"""The operator actions, as the API and the console both take them: their
bodies, and how one runs under its Idempotency-Key.

The API and the console share the route names, so a key means one thing
whichever of them sent it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field

from intentledger.domain.canonical import request_hash
from intentledger.domain.retention import RetentionPolicy
from intentledger.domain.states import Outcome
from intentledger.engine import operator, refunds
from intentledger.engine.api_keys import Principal
from intentledger.web.problems import Problem

Reason = Annotated[str, Field(min_length=1, max_length=2000)]


class ResolveRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    outcome: Literal["succeeded", "failed"]
    evidence: Reason


class ReasonRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: Reason


class RefundDuplicateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    charge: Annotated[str, Field(min_length=1, max_length=255)]
    reason: Reason


ACTION_BODIES: dict[str, type[BaseModel]] = {
    "resolve": ResolveRequest,
    "approve-resubmission": ReasonRequest,
    "escalate": ReasonRequest,
    "refund-duplicate": RefundDuplicateRequest,
}


def operator_action(
    verb: str,
    body: BaseModel,
    operation_id: str,
    by: str,
    policy_for: Callable[[str], RetentionPolicy],
) -> operator.Action:
    """The engine's action for one of ACTION_BODIES' verbs and its checked body."""
    if isinstance(body, ResolveRequest):
        resolution = operator.OperatorAction(operation_id, by, body.evidence)
        outcome = Outcome(body.outcome)
        return lambda ledger, now: operator.resolve(ledger, now, resolution, outcome)
    if isinstance(body, RefundDuplicateRequest):
        remedy = operator.OperatorAction(operation_id, by, body.reason)
        charge = body.charge
        return lambda ledger, now: refunds.refund_duplicate(ledger, now, remedy, charge)
    assert isinstance(body, ReasonRequest)
    action = operator.OperatorAction(operation_id, by, body.reason)
    if verb == "approve-resubmission":
        return lambda ledger, now: operator.approve_resubmission(ledger, now, action, policy_for)
    assert verb == "escalate"
    return lambda ledger, now: operator.escalate(ledger, now, action)


async def perform_operator_action(
    request: Request,
    principal: Principal,
    operation_id: str,
    verb: str,
    body: BaseModel,
    key: str,
    expected_version: int | None = None,
) -> tuple[str, bool]:
    """Run an operator action under its Idempotency-Key: (what it did, replayed).
    The API and the console share the route names, so a key means one thing.
    With `expected_version` (the console) it is done only on the version reviewed."""
    route = f"POST /v1/ops/operations/{{id}}/{verb}"
    keyed = operator.KeyedRequest(
        actor=principal.actor,
        route=route,
        idempotency_key=key,
        request_hash=request_hash(
            principal.actor, route, {"id": operation_id, **body.model_dump()}
        ),
        operation_id=operation_id,
        replay_window=request.app.state.replay_window,
    )
    action = operator_action(
        verb, body, operation_id, principal.actor, request.app.state.policy_for
    )
    if expected_version is not None:
        action = operator.as_reviewed(action, operation_id, expected_version)
    try:
        return await operator.perform(
            request.app.state.engine, request.app.state.clock, action, keyed
        )
    except ValueError as exc:  # an empty reason or evidence
        raise Problem(422, "invalid-request", "Unprocessable Content", str(exc)) from exc
