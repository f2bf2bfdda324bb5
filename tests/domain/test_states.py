"""The transition table against docs/design.md#the-transition-table, pair by pair and as a graph.

The expected edges are written out here independently of `TRANSITIONS`, each with
the line of the design that justifies it, so a change to the table has to change
this list too — on purpose.
"""

from __future__ import annotations

import itertools
from collections import deque

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from intentledger.domain.states import (
    FINAL,
    TRANSITIONS,
    UNRESOLVED,
    IllegalTransition,
    State,
    can_transition,
    require_transition,
    state_of,
)

S = State

EXPECTED_EDGES: frozenset[tuple[State, State]] = frozenset(
    {
        (S.ACCEPTED, S.SUBMITTING),  # claim + lock
        (S.ACCEPTED, S.CANCELLED),  # mandate suspended
        (S.SUBMITTING, S.OUTCOME_KNOWN),  # definite response
        (S.SUBMITTING, S.UNKNOWN),  # ambiguous result, resumed delivery, stale sweep
        (S.SUBMITTING, S.ACCEPTED),  # proof of non-execution (not connected, 429)
        (S.SUBMITTING, S.MANUAL_REVIEW),  # refused for our configuration (401/403)
        (S.UNKNOWN, S.RECONCILIATION_DUE),  # retry_after_at reached
        (S.UNKNOWN, S.OUTCOME_KNOWN),  # late evidence
        (S.UNKNOWN, S.MANUAL_REVIEW),  # an operator escalates
        (S.RECONCILIATION_DUE, S.MANUAL_REVIEW),  # an operator escalates
        (S.RECONCILIATION_DUE, S.OUTCOME_KNOWN),  # lookup found evidence
        (S.RECONCILIATION_DUE, S.SAFETY_REVIEW),  # lookup found no evidence
        (S.RECONCILIATION_DUE, S.UNKNOWN),  # check again later (not drawn in the diagram)
        (S.SAFETY_REVIEW, S.SUBMITTING),  # rule: resubmit, decision recorded
        (S.SAFETY_REVIEW, S.UNKNOWN),  # continue checking
        (S.SAFETY_REVIEW, S.MANUAL_REVIEW),  # rule: needs a person
        (S.SAFETY_REVIEW, S.OUTCOME_KNOWN),  # late evidence
        (S.MANUAL_REVIEW, S.SUBMITTING),  # operator approves
        (S.MANUAL_REVIEW, S.OUTCOME_KNOWN),  # operator resolves / late evidence
    }
)
REVIEW = frozenset({S.SAFETY_REVIEW, S.MANUAL_REVIEW})
ALL_PAIRS = list(itertools.product(State, State))


def edges() -> set[tuple[State, State]]:
    return {(a, b) for a, targets in TRANSITIONS.items() for b in targets}


def reachable(start: State, *, avoiding: frozenset[State] = frozenset()) -> set[State]:
    """States reachable from `start` in one or more steps, never entering `avoiding`."""
    seen: set[State] = set()
    queue = deque([start])
    while queue:
        for nxt in TRANSITIONS[queue.popleft()]:
            if nxt not in seen and nxt not in avoiding:
                seen.add(nxt)
                queue.append(nxt)
    return seen


# --- the table, pair by pair ------------------------------------------------------------


def test_table_has_a_row_for_every_state_and_only_states() -> None:
    assert set(TRANSITIONS) == set(State)
    for targets in TRANSITIONS.values():
        assert all(type(t) is State for t in targets)


def test_table_is_exactly_the_designed_edges() -> None:
    assert edges() == set(EXPECTED_EDGES)


@pytest.mark.parametrize(("current", "target"), ALL_PAIRS, ids=[f"{a}->{b}" for a, b in ALL_PAIRS])
def test_every_pair_allowed_iff_listed(current: State, target: State) -> None:
    allowed = (current, target) in EXPECTED_EDGES
    assert can_transition(current, target) is allowed
    if allowed:
        assert require_transition(current, target) is target
    else:
        with pytest.raises(IllegalTransition) as caught:
            require_transition(current, target)
        assert caught.value.current is current
        assert caught.value.target is target
        assert str(current) in str(caught.value)
        assert str(target) in str(caught.value)


def test_illegal_transition_is_a_value_error() -> None:
    assert issubclass(IllegalTransition, ValueError)


def test_no_self_loops() -> None:
    assert all(a is not b for a, b in edges())


# --- safety properties from docs/design.md ---------------------------------------------------


@pytest.mark.parametrize("source", [S.UNKNOWN, S.RECONCILIATION_DUE])
def test_no_edge_from_unknown_or_reconciliation_due_to_submitting(source: State) -> None:
    # A timer can make a check due; it cannot create evidence.
    assert not can_transition(source, S.SUBMITTING)
    with pytest.raises(IllegalTransition):
        require_transition(source, S.SUBMITTING)


def test_only_ways_into_submitting() -> None:
    assert {a for a, b in edges() if b is S.SUBMITTING} == {
        S.ACCEPTED,
        S.SAFETY_REVIEW,
        S.MANUAL_REVIEW,
    }


def test_every_path_from_unknown_to_submitting_passes_through_a_review() -> None:
    assert S.SUBMITTING in reachable(S.UNKNOWN)
    assert S.SUBMITTING not in reachable(S.UNKNOWN, avoiding=REVIEW)
    assert S.SUBMITTING not in reachable(S.RECONCILIATION_DUE, avoiding=REVIEW)


def test_after_unknown_nothing_leads_back_to_accepted() -> None:
    # ACCEPTED is resubmitted without a decision, so no unresolved state may reach it.
    for state in UNRESOLVED:
        assert S.ACCEPTED not in reachable(state, avoiding=frozenset({S.SUBMITTING}))
    assert {a for a, b in edges() if b is S.ACCEPTED} == {S.SUBMITTING}


@pytest.mark.parametrize("final", [S.OUTCOME_KNOWN, S.CANCELLED])
def test_final_states_have_no_outgoing_edges(final: State) -> None:
    assert final in FINAL
    assert TRANSITIONS[final] == frozenset()
    for target in State:
        with pytest.raises(IllegalTransition):
            require_transition(final, target)


def test_final_is_exactly_the_states_without_outgoing_edges() -> None:
    assert {S.OUTCOME_KNOWN, S.CANCELLED} == FINAL
    assert frozenset(s for s in State if not TRANSITIONS[s]) == FINAL


@pytest.mark.parametrize("state", sorted(set(State) - FINAL))
def test_every_non_final_state_can_reach_outcome_known(state: State) -> None:
    assert S.OUTCOME_KNOWN in reachable(state)


def test_cancelled_is_reachable_only_from_accepted() -> None:
    assert {a for a, b in edges() if b is S.CANCELLED} == {S.ACCEPTED}
    # Not even indirectly once a submission has happened.
    assert S.CANCELLED not in reachable(S.SUBMITTING, avoiding=frozenset({S.ACCEPTED}))


def test_unknown_is_never_a_dead_end() -> None:
    assert TRANSITIONS[S.UNKNOWN]
    # Whatever happens after UNKNOWN, the outcome can still become known.
    for state in reachable(S.UNKNOWN) - FINAL:
        assert S.OUTCOME_KNOWN in reachable(state)


@pytest.mark.parametrize("state", sorted(UNRESOLVED))
def test_late_evidence_is_always_welcome(state: State) -> None:
    assert can_transition(state, S.OUTCOME_KNOWN)


def test_state_groups_partition_the_states() -> None:
    assert not (UNRESOLVED & FINAL)
    assert UNRESOLVED | FINAL | {S.ACCEPTED, S.SUBMITTING} == set(State)


# --- a stateful model: timers versus evidence -------------------------------------------

# The only move a timer may make: a check falls due. Everything else needs evidence
# (a provider answer, a lookup, a recorded decision, an operator).
TIMER_MOVES = frozenset({(S.UNKNOWN, S.RECONCILIATION_DUE)})


class TransitionMachine(RuleBasedStateMachine):
    """Random attempted moves through `require_transition`, as the ledger makes them."""

    def __init__(self) -> None:
        super().__init__()
        self.state: State = S.ACCEPTED
        self.history: list[State] = [S.ACCEPTED]
        self.timer_moves: list[tuple[State, State]] = []

    @initialize(start=st.sampled_from(State))
    def start_anywhere(self, start: State) -> None:
        self.state = start
        self.history = [start]

    def attempt(self, target: State) -> bool:
        before = self.state
        try:
            result = require_transition(before, target)
        except IllegalTransition as exc:
            assert (before, target) not in EXPECTED_EDGES
            assert (exc.current, exc.target) == (before, target)
            assert self.state is before  # a refused move changes nothing
            return False
        assert (before, target) in EXPECTED_EDGES
        assert result is target
        self.state = result
        self.history.append(result)
        return True

    @rule()
    def timer_fires(self) -> None:
        if self.state is S.UNKNOWN:
            assert self.attempt(S.RECONCILIATION_DUE)
            self.timer_moves.append((S.UNKNOWN, S.RECONCILIATION_DUE))
        # Whatever the timer did, it cannot have made a resubmission possible.
        if self.state in (S.UNKNOWN, S.RECONCILIATION_DUE):
            with pytest.raises(IllegalTransition):
                require_transition(self.state, S.SUBMITTING)

    @rule(wanted=st.sampled_from(State))
    def evidence_arrives(self, wanted: State) -> None:
        """Any attempted move, legal or not: the table decides."""
        self.attempt(wanted)

    @precondition(lambda self: bool(TRANSITIONS[self.state]))
    @rule(data=st.data())
    def legal_evidence_arrives(self, data: st.DataObject) -> None:
        """A legal move, so runs get deep into the graph instead of bouncing off it."""
        target = data.draw(st.sampled_from(sorted(TRANSITIONS[self.state])))
        assert self.attempt(target)

    @invariant()
    def state_is_a_state_member(self) -> None:
        assert type(self.state) is State
        assert self.state in TRANSITIONS

    @invariant()
    def history_follows_the_table(self) -> None:
        for before, after in itertools.pairwise(self.history):
            assert (before, after) in EXPECTED_EDGES

    @invariant()
    def once_final_always_final(self) -> None:
        finals = [i for i, s in enumerate(self.history) if s in FINAL]
        if finals:
            assert finals[0] == len(self.history) - 1
            assert self.state in FINAL

    @invariant()
    def unknown_to_submitting_passes_through_review(self) -> None:
        unreviewed_unknown = False
        for state in self.history:
            if state is S.UNKNOWN:
                unreviewed_unknown = True
            elif state in REVIEW:
                unreviewed_unknown = False
            elif state is S.SUBMITTING:
                assert not unreviewed_unknown, self.history

    @invariant()
    def timers_only_make_checks_due(self) -> None:
        assert set(self.timer_moves) <= TIMER_MOVES


TransitionMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None
)
TestTransitionMachine = TransitionMachine.TestCase


@pytest.mark.parametrize("value", [*(s.value for s in State), *State])
def test_state_of_reads_every_state_as_the_enum_does(value: str) -> None:
    assert state_of(value) is State(value)


@pytest.mark.parametrize("value", ["", "submitting", "DONE", " ACCEPTED", None, 1])
def test_state_of_refuses_what_the_enum_refuses(value: object) -> None:
    with pytest.raises(ValueError):
        State(value)
    with pytest.raises(ValueError, match="is not a valid State"):
        state_of(value)  # type: ignore[arg-type]
