"""Dispatch eligibility: which attempt a delivery may send, and what a mandate stops."""

from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from intentledger.domain.dispatch_plan import (
    SENDABLE_FROM,
    AttemptPlan,
    Authorisation,
    batchable_first_attempt,
    mandate_stop,
    plan_attempt,
    provider_key,
)
from intentledger.domain.states import NextAction, State


def test_a_mandate_stops_a_payment_unless_active_and_never_a_refund() -> None:
    assert mandate_stop("payment", None, None) is None
    assert mandate_stop("payment", "md_1", "active") is None
    assert mandate_stop("payment", "md_1", "suspended") == "suspended"
    assert mandate_stop("payment", "md_1", "revoked") == "revoked"
    assert mandate_stop("payment", "md_1", None) == "missing"
    # Money going back needs no authorisation.
    assert mandate_stop("refund", "md_1", "revoked") is None


def test_attempt_one_goes_to_an_accepted_operation_never_attempted() -> None:
    assert plan_attempt("op_1", State.ACCEPTED, None, None, None) == AttemptPlan(
        1, provider_key("op_1"), None
    )
    for state in State:
        if state not in SENDABLE_FROM:
            assert plan_attempt("op_1", state, None, None, None) is None
        elif state is not State.ACCEPTED:
            # In review it has been sent before: no attempt is a broken ledger.
            with pytest.raises(AssertionError, match="with no attempt"):
                plan_attempt("op_1", state, None, None, None)


def decision(next_action: NextAction, same_key: bool, decision_id: int = 7) -> Authorisation:
    return Authorisation(
        decision_id, next_action, {"provider_idempotency_key": "k2", "same_key": same_key}
    )


def test_a_later_attempt_needs_the_latest_decision_and_the_right_action() -> None:
    submit = decision(NextAction.SUBMIT, same_key=True)
    plan = plan_attempt("op_1", State.ACCEPTED, 1, submit, 7)
    assert plan == AttemptPlan(2, "k2", 1, replay=False, new_request=False)
    # The row of a superseded decision sends nothing.
    assert plan_attempt("op_1", State.ACCEPTED, 1, submit, 6) is None
    # Review states need "resubmit", ACCEPTED needs "submit".
    assert plan_attempt("op_1", State.SAFETY_REVIEW, 1, submit, 7) is None
    assert plan_attempt("op_1", State.ACCEPTED, 1, decision(NextAction.RESUBMIT, True), 7) is None
    assert plan_attempt("op_1", State.ACCEPTED, 1, None, None) is None


def test_a_replay_and_a_new_request_say_what_must_be_checked_when_sent() -> None:
    replay = plan_attempt("op_1", State.SAFETY_REVIEW, 2, decision(NextAction.RESUBMIT, True), 7)
    assert replay == AttemptPlan(3, "k2", 2, replay=True, new_request=False)
    new = plan_attempt("op_1", State.MANUAL_REVIEW, 2, decision(NextAction.RESUBMIT, False), 7)
    assert new == AttemptPlan(3, "k2", 2, replay=False, new_request=True)


@given(
    state=st.sampled_from(State),
    previous=st.none() | st.integers(1, 20),
    next_action=st.sampled_from(NextAction),
    same_key=st.booleans(),
    delivered=st.none() | st.integers(1, 3),
)
def test_nothing_is_sent_from_a_state_that_does_not_send(
    state: State,
    previous: int | None,
    next_action: NextAction,
    same_key: bool,
    delivered: int | None,
) -> None:
    assume(previous is not None or state in (State.ACCEPTED, *set(State) - SENDABLE_FROM))
    plan = plan_attempt("op_1", state, previous, decision(next_action, same_key, 2), delivered)
    if state not in SENDABLE_FROM:
        assert plan is None
    if plan is not None:
        assert plan.number == (previous or 0) + 1
        assert plan.resubmission_of == previous
        assert not (plan.replay and plan.new_request)


@given(
    kind=st.sampled_from(["payment", "refund", "card_freeze"]),
    state=st.sampled_from(State),
    attempted=st.booleans(),
    delivered=st.none() | st.integers(1, 3),
    status=st.none() | st.sampled_from(["active", "suspended", "revoked"]),
)
def test_the_batch_takes_only_what_the_reference_path_sends_as_attempt_one(
    kind: str, state: State, attempted: bool, delivered: int | None, status: str | None
) -> None:
    # An operation in review was sent before (it has an attempt).
    assume(attempted or state is State.ACCEPTED or state not in SENDABLE_FROM)
    stop = mandate_stop(kind, "md_1", status)
    batched = batchable_first_attempt(kind, state, attempted, delivered, stop)
    reference = plan_attempt("op_1", state, 1 if attempted else None, None, delivered)
    if batched:
        assert reference is not None and reference.number == 1
        assert stop is None and kind == "payment" and delivered is None
