"""What asks a person to act: the operator console's work queue.

Every operation whose `next_action` is `operator` (MANUAL_REVIEW, a refused
credential, a provider still not final past the budget of looks), every flagged
one (a contradiction, a duplicate) and every unresolved one that has waited
longer than the queue's threshold (an UNKNOWN the reconciler keeps failing to
settle) is shown to a person, oldest first:
nothing that needs a person waits silently (docs/design.md#nothing-waits-silently).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum

from intentledger.domain.states import NextAction, State
from intentledger.domain.watching import Watch


class Need(StrEnum):
    """Why an operation is in the queue (an operation may have several reasons)."""

    OPERATOR = "operator"  # next_action: operator (MANUAL_REVIEW and the like)
    CONTRADICTED = "outcome_contradicted"
    DUPLICATE = "duplicate_detected"
    WAITING = "unresolved_too_long"
    # Settled, but past the budget of looks the provider still shows something
    # open: the amount stays held and the looks go on (domain/watching.py).
    PROVIDER_NOT_FINAL = "provider_not_final"


# Unresolved states the engine is still working on: a person is asked only once
# one has waited longer than the threshold (MANUAL_REVIEW asks at once).
WAITING_STATES: tuple[State, ...] = (
    State.UNKNOWN,
    State.RECONCILIATION_DUE,
    State.SAFETY_REVIEW,
)
DEFAULT_WAITING_THRESHOLD = timedelta(minutes=15)
# The form of every id this service issues: a cursor naming anything else names
# no operation (and must not reach the database, which may refuse its bytes).
OPERATION_ID = re.compile(r"[A-Za-z0-9_-]{1,40}")


@dataclass(frozen=True)
class QueueFacts:
    state: State
    next_action: NextAction
    duplicate_detected: bool
    outcome_contradicted: bool
    created_at: datetime
    watch: str | None = None


def needs(facts: QueueFacts, now: datetime, threshold: timedelta) -> tuple[Need, ...]:
    """Every reason this operation needs a person now (empty: it does not)."""
    reasons: list[Need] = []
    if facts.next_action == NextAction.OPERATOR:
        reasons.append(Need.OPERATOR)
    if facts.outcome_contradicted:
        reasons.append(Need.CONTRADICTED)
    if facts.duplicate_detected:
        reasons.append(Need.DUPLICATE)
    if facts.state in WAITING_STATES and now - facts.created_at >= threshold:
        reasons.append(Need.WAITING)
    if facts.watch == Watch.NOT_FINAL:
        reasons.append(Need.PROVIDER_NOT_FINAL)
    return tuple(reasons)


@dataclass(frozen=True)
class Cursor:
    """Where a page of the queue (oldest first) ends: keyset paging, so a page
    deep in a long queue costs what the first one does."""

    created_at: datetime
    operation_id: str

    def encode(self) -> str:
        return f"{self.created_at.isoformat()}~{self.operation_id}"

    @classmethod
    def decode(cls, text: str) -> Cursor:
        """Raises ValueError for anything this class did not encode."""
        instant, separator, operation_id = text.partition("~")
        if not separator or not OPERATION_ID.fullmatch(operation_id):
            raise ValueError("not a queue position")
        created_at = datetime.fromisoformat(instant)
        if created_at.tzinfo is None:
            raise ValueError("a queue position carries its time zone")
        try:
            # In UTC, as stored: an instant at the calendar's edge may not fit.
            created_at = created_at.astimezone(UTC)
        except OverflowError as exc:
            raise ValueError("not a queue position") from exc
        return cls(created_at, operation_id)
