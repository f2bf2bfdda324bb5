"""Which operator action is allowed in which state: the table the console offers from."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from intentledger.domain.operator_rules import (
    ActionFacts,
    approval_awaited,
    available_actions,
    may_escalate,
    may_resolve,
)
from intentledger.domain.states import UNRESOLVED, NextAction, State

WAITING = ActionFacts(
    state=State.MANUAL_REVIEW,
    next_action=NextAction.OPERATOR,
    outcome_contradicted=False,
    attempted=True,
    duplicate_detected=False,
    executed=(),
    settled_charge=None,
)


def facts(state: State, **changes: Any) -> ActionFacts:
    return replace(WAITING, state=state, **changes)


def test_each_state_offers_its_actions() -> None:
    assert available_actions(facts(State.UNKNOWN)) == ["resolve", "escalate"]
    assert available_actions(facts(State.RECONCILIATION_DUE)) == ["resolve", "escalate"]
    assert available_actions(facts(State.SAFETY_REVIEW)) == ["resolve", "escalate"]
    assert available_actions(facts(State.MANUAL_REVIEW)) == ["resolve", "approve-resubmission"]
    assert available_actions(facts(State.OUTCOME_KNOWN)) == []
    assert available_actions(facts(State.ACCEPTED)) == []


def test_an_approved_request_or_one_never_attempted_is_not_approved_again() -> None:
    approved = facts(State.MANUAL_REVIEW, next_action=NextAction.RESUBMIT)
    assert "approve-resubmission" not in available_actions(approved)
    assert "approve-resubmission" not in available_actions(
        facts(State.MANUAL_REVIEW, attempted=False)
    )


def test_a_contradiction_is_resolvable_even_settled() -> None:
    settled = facts(State.OUTCOME_KNOWN, outcome_contradicted=True)
    assert available_actions(settled) == ["resolve"]


def test_refund_duplicate_only_with_a_charge_beyond_the_settled_one() -> None:
    flagged = facts(
        State.OUTCOME_KNOWN,
        duplicate_detected=True,
        executed=("ch_1", "ch_2"),
        settled_charge="ch_1",
    )
    assert available_actions(flagged) == ["refund-duplicate"]
    only_settled = facts(
        State.OUTCOME_KNOWN, duplicate_detected=True, executed=("ch_1",), settled_charge="ch_1"
    )
    assert available_actions(only_settled) == []


@given(
    state=st.sampled_from(State),
    next_action=st.sampled_from(NextAction),
    contradicted=st.booleans(),
    attempted=st.booleans(),
)
def test_what_is_offered_is_what_the_engine_allows(
    state: State, next_action: NextAction, contradicted: bool, attempted: bool
) -> None:
    shown = facts(
        state, next_action=next_action, outcome_contradicted=contradicted, attempted=attempted
    )
    offered = available_actions(shown)
    assert ("resolve" in offered) == may_resolve(state, contradicted)
    assert ("escalate" in offered) == may_escalate(state)
    assert ("approve-resubmission" in offered) == (
        approval_awaited(state, next_action) and attempted
    )
    assert may_resolve(state, contradicted) == (contradicted or state in UNRESOLVED)
