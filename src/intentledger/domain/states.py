"""Operation states and the transition table: the only way a state changes.

There is deliberately no edge from UNKNOWN or RECONCILIATION_DUE to SUBMITTING.
A timer can make a check due; it cannot create evidence. A resubmission exists
only as SAFETY_REVIEW (or MANUAL_REVIEW) -> SUBMITTING, authorised by a decision.
"""

from __future__ import annotations

from enum import StrEnum


class State(StrEnum):
    ACCEPTED = "ACCEPTED"
    SUBMITTING = "SUBMITTING"
    UNKNOWN = "UNKNOWN"
    RECONCILIATION_DUE = "RECONCILIATION_DUE"
    SAFETY_REVIEW = "SAFETY_REVIEW"
    MANUAL_REVIEW = "MANUAL_REVIEW"
    OUTCOME_KNOWN = "OUTCOME_KNOWN"
    CANCELLED = "CANCELLED"


# By value: `state_of` reads a stored state at a dict lookup's cost.
_BY_VALUE: dict[str, State] = {state.value: state for state in State}


def state_of(value: str) -> State:
    """`State(value)` for a stored state (a string) or a member (a StrEnum
    hashes as its value), at a tenth of its CPU, without the enum
    machinery's Python call: a worker reads a record's state several times a
    payment. A string that names no state is refused with `State`'s
    ValueError."""
    try:
        return _BY_VALUE[value]
    except KeyError:
        raise ValueError(f"{value!r} is not a valid State") from None


class NextAction(StrEnum):
    SUBMIT = "submit"
    WAIT = "wait"
    RECONCILE = "reconcile"
    REVIEW_SAFETY = "review_safety"
    RESUBMIT = "resubmit"
    OPERATOR = "operator"
    NONE = "none"


class Outcome(StrEnum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"


# States whose provider outcome is not known and that may still move money.
UNRESOLVED: frozenset[State] = frozenset(
    {
        State.UNKNOWN,
        State.RECONCILIATION_DUE,
        State.SAFETY_REVIEW,
        State.MANUAL_REVIEW,
    }
)
FINAL: frozenset[State] = frozenset({State.OUTCOME_KNOWN, State.CANCELLED})

TRANSITIONS: dict[State, frozenset[State]] = {
    # Claimed and locked for submission, or cancelled with its mandate.
    State.ACCEPTED: frozenset({State.SUBMITTING, State.CANCELLED}),
    # A definite answer, an ambiguous one, or proof that nothing was sent
    # (connection never established, 429): the last goes back to ACCEPTED. A
    # refusal only a person can fix (the provider rejected our credentials)
    # goes to a person instead: sending again would be refused again.
    State.SUBMITTING: frozenset(
        {State.OUTCOME_KNOWN, State.UNKNOWN, State.ACCEPTED, State.MANUAL_REVIEW}
    ),
    # Only time passing (a check falls due), late evidence, or a person
    # escalating move UNKNOWN. None of these sends anything.
    State.UNKNOWN: frozenset({State.RECONCILIATION_DUE, State.OUTCOME_KNOWN, State.MANUAL_REVIEW}),
    State.RECONCILIATION_DUE: frozenset(
        {State.OUTCOME_KNOWN, State.UNKNOWN, State.SAFETY_REVIEW, State.MANUAL_REVIEW}
    ),
    State.SAFETY_REVIEW: frozenset(
        {State.SUBMITTING, State.UNKNOWN, State.MANUAL_REVIEW, State.OUTCOME_KNOWN}
    ),
    State.MANUAL_REVIEW: frozenset({State.SUBMITTING, State.OUTCOME_KNOWN}),
    State.OUTCOME_KNOWN: frozenset(),
    State.CANCELLED: frozenset(),
}


class IllegalTransition(ValueError):
    def __init__(self, current: State, target: State) -> None:
        super().__init__(f"no transition from {current} to {target}")
        self.current = current
        self.target = target


def can_transition(current: State, target: State) -> bool:
    return target in TRANSITIONS[current]


def require_transition(current: State, target: State) -> State:
    """Return `target` if the table allows the move, else raise IllegalTransition."""
    if not can_transition(current, target):
        raise IllegalTransition(current, target)
    return target
