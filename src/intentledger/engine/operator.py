"""Operator actions: a person resolves, approves a new request, or escalates.

Each action is one transaction that records who did it and why (an
observation for what they saw, a decision for what they decided) before the
state changes, so the timeline shows a person's word like any other evidence.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.evidence import Limits, OperatorStatement
from intentledger.domain.operator_rules import (
    APPROVABLE,
    RESOLVABLE,
    approval_awaited,
    may_resolve,
)
from intentledger.domain.operator_rules import ESCALATABLE as ESCALATABLE  # the tests' name
from intentledger.domain.replay_window import DEFAULT_REPLAY_WINDOW
from intentledger.domain.retention import RetentionPolicy
from intentledger.domain.safety import attempt_key
from intentledger.domain.states import NextAction, Outcome, State
from intentledger.engine import changes
from intentledger.engine.clock import Clock
from intentledger.engine.evidence import weigh
from intentledger.engine.new_keys import room_for_a_new_key
from intentledger.engine.refusal import Refusal, claim_key, find_keyed_replay, retry_key_races
from intentledger.engine.safety_review import policy_document
from intentledger.store.ledger import Ledger
from intentledger.store.records import OperationRecord
from intentledger.store.work_queue import recent_operations

# After a person's resolution the provider is asked once more, this soon.
VERIFY_AFTER = timedelta(seconds=30)


class OperationNotFound(Refusal):
    def __init__(self, operation_id: str) -> None:
        super().__init__(404, "operation-not-found", f"no operation {operation_id!r}")


class ActionNotAllowed(Refusal):
    """The operation's state does not allow this action."""

    def __init__(self, detail: str) -> None:
        super().__init__(409, "action-not-allowed", detail)


class NoRoomForANewKey(Refusal):
    """A new key would hold more than the mandate or the refunded charge has room for."""

    def __init__(self, detail: str) -> None:
        super().__init__(409, "no-room-for-a-new-key", detail)


class ChangedSinceReviewed(Refusal):
    """A person confirmed what a page showed, and the operation has moved on since."""

    def __init__(self, operation_id: str) -> None:
        super().__init__(
            409,
            "changed-since-reviewed",
            f"{operation_id} changed since it was reviewed (another person acted, or the "
            "engine moved it on): review it again",
        )


@dataclass(frozen=True)
class OperatorAction:
    operation_id: str
    by: str
    reason: str
    # Where an action from the CLI was typed. `intentledger ops` writes with the
    # database's credentials and `by` is only what its user declared, so the
    # record keeps what the machine says beside it (docs/operations.md). None
    # through the API and console: there `by` is the authenticated key's actor.
    os_user: str | None = None
    host: str | None = None

    def recorded_by(self) -> dict[str, str]:
        """Who acted, as a decision's inputs record it."""
        seen = {"os_user": self.os_user, "host": self.host}
        return {"by": self.by} | {name: value for name, value in seen.items() if value is not None}


def _not_allowed(
    operation: OperationRecord, allowed: frozenset[State], verb: str
) -> ActionNotAllowed:
    return ActionNotAllowed(
        f"cannot {verb} {operation.operation_id}: it is {operation.state} "
        f"(allowed from {', '.join(sorted(allowed))})"
    )


async def _locked(
    ledger: Ledger, operation_id: str, allowed: frozenset[State], verb: str
) -> OperationRecord:
    operation = await ledger.lock_operation(operation_id)
    if operation is None:
        raise OperationNotFound(operation_id)
    if State(operation.state) not in allowed:
        raise _not_allowed(operation, allowed, verb)
    return operation


def require_text(value: str, what: str) -> str:
    if not value or not value.strip():
        raise ValueError(f"{what} must not be empty: it is the record of why")
    return value.strip()


async def resolve(ledger: Ledger, now: datetime, action: OperatorAction, outcome: Outcome) -> str:
    """Settle an unresolved operation on evidence a person found (OUTCOME_KNOWN),
    or resolve a contradiction: which outcome stands, on the evidence stated.

    The statement is evidence like any other: the funnel settles the operation
    and asks the provider once more (the audit), so a wrong statement meets the
    provider's truth and is flagged, and the mandate's books follow the charges.
    """
    evidence = require_text(action.reason, "the evidence")
    operation = await ledger.lock_operation(action.operation_id)
    if operation is None:
        raise OperationNotFound(action.operation_id)
    contradicted = bool(operation.outcome_contradicted)
    if not may_resolve(State(operation.state), contradicted):
        raise _not_allowed(operation, RESOLVABLE, "resolve")
    planned = changes.Writes(now)
    observation = planned.observe(
        operation_id=action.operation_id,
        actor=operation.actor,
        at=now,
        kind="operator",
        source=f"operator:{action.by}",
        verdict=outcome.value,
        reason=evidence,
    )
    planned.decide(
        operation_id=action.operation_id,
        actor=operation.actor,
        at=now,
        rule="operator_contradiction_resolution" if contradicted else "operator_resolution",
        inputs={
            "observation_id": observation,
            "evidence": evidence,
            **action.recorded_by(),
            "outcome": outcome.value,
            "state_before": operation.state,
            "outcome_before": operation.outcome,
            "contradiction": contradicted,
        },
        next_action=NextAction.NONE,
        reason=(
            f"{action.by} resolved the contradiction as {outcome.value}: {evidence}"
            if contradicted
            else f"{action.by} resolved it as {outcome.value}: {evidence}"
        ),
        source=f"operator:{action.by}",
    )
    await weigh(
        ledger,
        operation,
        OperatorStatement(outcome, action.by, evidence),
        now=now,
        limits=Limits(VERIFY_AFTER),
        source=f"operator:{action.by}",
        observation_id=observation,
        writes=planned,
    )
    return f"resolved as {outcome.value}"


async def approve_resubmission(
    ledger: Ledger,
    now: datetime,
    action: OperatorAction,
    policy_for: Callable[[str], RetentionPolicy],
) -> str:
    """A deliberate new request with a new provider key, linked to the unresolved
    attempt, recorded with what every resubmission decision records: who and
    why, the key's age against the provider's retention policy, and the link."""
    reason = require_text(action.reason, "the reason")
    operation = await _locked(
        ledger,
        action.operation_id,
        APPROVABLE,
        "approve a resubmission of",
    )
    if not approval_awaited(State(operation.state), operation.next_action):
        # Already approved (a new request is on its way, next_action resubmit):
        # a second approval would be a third request nobody weighed.
        raise ActionNotAllowed(
            f"cannot approve a resubmission of {action.operation_id}: one is already "
            f"approved and on its way (next action {operation.next_action})"
        )
    keys, no_room = await room_for_a_new_key(ledger, operation)
    if no_room is not None:
        raise NoRoomForANewKey(f"cannot approve a new request: {no_room}")
    last = await ledger.last_attempt(action.operation_id)
    assert last is not None, "only an attempted operation reaches MANUAL_REVIEW"
    key = attempt_key(action.operation_id, last.number + 1)
    policy = policy_for(operation.provider)
    first_use = await ledger.first_use_of_key(action.operation_id, last.provider_idempotency_key)
    key_age = now - first_use
    planned = changes.Writes(now)
    decision = planned.decide(
        operation_id=action.operation_id,
        actor=operation.actor,
        at=now,
        rule="operator_approved_new_request",
        inputs={
            **action.recorded_by(),
            "reason": reason,
            "provider_idempotency_key": key,
            "same_key": False,
            "unresolved_attempt": last.number,
            "previous_key": last.provider_idempotency_key,
            "previous_key_first_used_at": first_use.isoformat(),
            "key_age_seconds": key_age.total_seconds(),
            "provider_retention_note": policy.note,
            "policy": policy_document(policy),
        },
        next_action=NextAction.RESUBMIT,
        reason=(
            f"{action.by} approved a new request with key {key} (attempt "
            f"{last.number}'s key is {key_age} old; {policy.provider_api} honours keys "
            f"for at least {policy.minimum}): {reason}"
        ),
        key_age_at_decision=key_age,
        source=f"operator:{action.by}",
    )
    planned.change(
        changes.plan(
            operation,
            None,
            now=now,
            next_action=NextAction.RESUBMIT,
            key_age_at_decision=key_age,
            provider_retention_note=policy.note,
            # Held from now, not from when the dispatcher sends it: an intent accepted
            # in between must not take the room this key was approved with.
            live_keys=keys,
        )
    )
    planned.enqueue(operation, "submit", now, decision=decision)
    await planned.save(ledger)
    return f"new request approved with key {key}"


async def escalate(ledger: Ledger, now: datetime, action: OperatorAction) -> str:
    """Hand an unresolved operation to a person now, whatever its rules would do."""
    reason = require_text(action.reason, "the reason")
    operation = await _locked(ledger, action.operation_id, ESCALATABLE, "escalate")
    planned = changes.Writes(now)
    planned.decide(
        operation_id=action.operation_id,
        actor=operation.actor,
        at=now,
        rule="operator_escalation",
        inputs={**action.recorded_by(), "reason": reason, "state_before": operation.state},
        next_action=NextAction.OPERATOR,
        reason=f"{action.by} escalated it: {reason}",
        source=f"operator:{action.by}",
    )
    planned.change(
        changes.plan(
            operation,
            State.MANUAL_REVIEW,
            now=now,
            next_action=NextAction.OPERATOR,
            reason=f"escalated by {action.by}: {reason}",
            source=f"operator:{action.by}",
        )
    )
    await planned.save(ledger)
    return "escalated to MANUAL_REVIEW"


Action = Callable[[Ledger, datetime], Awaitable[str]]


def as_reviewed(action: Action, operation_id: str, version: int) -> Action:
    """`action`, done only while the operation is at the version a person
    reviewed (the console's confirmation page): what they confirmed is what is done."""

    async def reviewed(ledger: Ledger, now: datetime) -> str:
        operation = await ledger.lock_operation(operation_id)
        if operation is not None and operation.version != version:
            raise ChangedSinceReviewed(operation_id)
        return await action(ledger, now)

    return reviewed


@dataclass(frozen=True)
class KeyedRequest:
    """An HTTP request's idempotency claim: (actor, route, key) and its hash."""

    actor: str
    route: str
    idempotency_key: str
    request_hash: str
    operation_id: str
    # How long an equal retry of this key replays (decision 0018).
    replay_window: timedelta = DEFAULT_REPLAY_WINDOW


async def perform(
    engine: AsyncEngine, clock: Clock, action: Action, keyed: KeyedRequest | None = None
) -> tuple[str, bool]:
    """Run one operator action in its own transaction; returns (what it did, replayed).

    With `keyed`, an equal retry is a replay (nothing is done again) and the
    same key for a different request is refused, as for every mutation.
    """

    async def attempt() -> tuple[str, bool]:
        async with engine.begin() as conn:
            ledger = Ledger(conn)
            now = clock()
            if keyed is not None:
                if await find_keyed_replay(ledger, keyed, now):
                    return "replayed", True
                await claim_key(
                    ledger,
                    keyed.actor,
                    keyed.route,
                    keyed.idempotency_key,
                    keyed.request_hash,
                    keyed.operation_id,
                    now,
                )
            return await action(ledger, now), False

    return await retry_key_races(attempt)


async def list_operations(
    engine: AsyncEngine, state: State | None = None, limit: int = 100
) -> list[OperationRecord]:
    async with engine.connect() as conn:
        return await recent_operations(conn, state, limit)


async def show(engine: AsyncEngine, operation_id: str) -> dict[str, Any]:
    """The record, its attempts with their results, and its whole timeline."""
    async with engine.connect() as conn:
        ledger = Ledger(conn)
        operation = await ledger.get_operation(operation_id)
        if operation is None:
            raise OperationNotFound(operation_id)
        return {
            "operation": operation,
            "attempts": await ledger.attempts_of(operation_id),
            "submit_results": await ledger.submit_results_of(operation_id),
            "events": await ledger.events_of(operation_id),
            "refunds": await ledger.refunds_of(operation_id),
        }
