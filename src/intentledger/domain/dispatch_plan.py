"""Dispatch eligibility: which attempt a `submit` delivery may send, if any. Pure.

The dispatcher (engine/dispatcher.py) and its batched first attempts
(engine/batch_dispatch.py) both ask here, so the batch never sends what the
one-at-a-time path would not:

- attempt 1 goes to an ACCEPTED operation nothing was ever sent for;
- every later attempt needs the decision that authorised it, and it must be
  the operation's latest: "submit" after evidence of non-execution (back in
  ACCEPTED), "resubmit" after a safety review or an operator's approval;
- a payment under a mandate is sent only while the mandate is active (a refund
  is not held to its payment's mandate: money going back needs no
  authorisation). What was true at acceptance does not matter: a first attempt
  whose mandate stopped is cancelled, and a new-key request (a new charge) goes
  to a person instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from intentledger.domain.mandates import MISSING, is_active
from intentledger.domain.quick_init import quick_init
from intentledger.domain.safety import attempt_key
from intentledger.domain.states import NextAction, State

FIRST_ATTEMPT = 1
# The states an attempt may be sent from (with its authorising decision after the first).
SENDABLE_FROM = frozenset({State.ACCEPTED, State.SAFETY_REVIEW, State.MANUAL_REVIEW})


def provider_key(operation_id: str) -> str:
    # The provider-facing key of the original request. A replay after evidence
    # of non-execution reuses it, so the provider can deduplicate.
    return attempt_key(operation_id, FIRST_ATTEMPT)


def mandate_stop(kind: str, mandate_id: str | None, mandate_status: str | None) -> str | None:
    """The status of the mandate that stops this operation being sent now
    ("missing" when the mandate is gone), or None when nothing stops it.
    `mandate_status` is None when the mandate named is not found."""
    if mandate_id is None or kind == "refund" or is_active(mandate_status):
        return None
    return mandate_status if mandate_status is not None else MISSING


def sends_first_attempt(state: State, attempted: bool) -> bool:
    """Is attempt 1 what an operation in `state` is waiting to send?"""
    return state is State.ACCEPTED and not attempted


@dataclass(frozen=True)
class Authorisation:
    """The operation's latest decision, as far as sending reads it."""

    decision_id: int
    next_action: str
    inputs: Mapping[str, Any]


@quick_init
@dataclass(frozen=True)
class AttemptPlan:
    number: int
    key: str  # the provider-facing idempotency key this attempt uses
    resubmission_of: int | None
    # Same key again from SAFETY_REVIEW: only while the provider still deduplicates
    # it, checked again at the moment of sending (the key's age grows meanwhile).
    replay: bool = False
    # A new key: a new charge, which needs the mandate active at the moment of sending.
    new_request: bool = False


def plan_attempt(
    operation_id: str,
    state: State,
    previous_attempt: int | None,
    latest: Authorisation | None,
    delivered_decision_id: int | None,
) -> AttemptPlan | None:
    """The attempt the delivery of `delivered_decision_id`'s row may send, or None
    (settled, cancelled, unresolved without an authorising decision, or a row
    whose decision was superseded). The mandate and a replay's window are
    checked by the caller, as the plan's flags say."""
    if sends_first_attempt(state, attempted=previous_attempt is not None):
        return AttemptPlan(FIRST_ATTEMPT, provider_key(operation_id), None)
    if state not in SENDABLE_FROM:
        return None
    if previous_attempt is None:
        # Only ACCEPTED sends a first attempt; an operation in review has been
        # sent before, and its missing attempt is a broken ledger, not a no.
        raise AssertionError(f"{operation_id} is {state} with no attempt")
    authorising = NextAction.SUBMIT if state is State.ACCEPTED else NextAction.RESUBMIT
    if (
        latest is None
        or latest.decision_id != delivered_decision_id
        or latest.next_action != authorising
    ):
        return None
    same_key = bool(latest.inputs.get("same_key"))
    return AttemptPlan(
        previous_attempt + 1,
        latest.inputs["provider_idempotency_key"],
        previous_attempt,
        replay=same_key and state is State.SAFETY_REVIEW,
        new_request=state is not State.ACCEPTED and not same_key,
    )


def batchable_first_attempt(
    kind: str,
    state: State,
    attempted: bool,
    delivered_decision_id: int | None,
    stop: str | None,
) -> bool:
    """May this delivery go with the batched first attempts? Only a payment's
    plain attempt 1 with nothing to stop it: everything else (and every stop,
    which writes a cancellation) takes the one-at-a-time path."""
    return (
        kind == "payment"
        and delivered_decision_id is None
        and sends_first_attempt(state, attempted)
        and stop is None
    )


__all__ = [
    "FIRST_ATTEMPT",
    "SENDABLE_FROM",
    "AttemptPlan",
    "Authorisation",
    "batchable_first_attempt",
    "mandate_stop",
    "plan_attempt",
    "provider_key",
    "sends_first_attempt",
]
