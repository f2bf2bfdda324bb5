"""What the merchant is told, and when a failed delivery is tried again. Pure.

An event is news about one of the actor's objects: an operation whose outcome
became known (or that ended cancelled, never sent), became UNKNOWN, went to a
person, or was flagged; a mandate or card whose public representation
changed. A state move that is not news — SUBMITTING, a check falling due, a
safety review that decides to wait — tells nobody anything. Each event shows
the object with its `version`, which every change raises: deliveries are not
ordered, and a receiver drops one that is not newer than what it acted on.

A delivery that fails is tried again after a capped exponential delay, less a
random part of it (so endpoints that failed together do not all come back at
once), until the retry horizon (about three days after the event, as Stripe
retries) has passed; then it is given up and stays listed as failed.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from intentledger.domain.quick_init import quick_init
from intentledger.domain.states import FINAL, State

OUTCOME_KNOWN = "operation.outcome_known"
UNKNOWN = "operation.unknown"
MANUAL_REVIEW = "operation.manual_review"
CONTRADICTED = "operation.contradicted"
DUPLICATE_DETECTED = "operation.duplicate_detected"
MANDATE_UPDATED = "mandate.updated"
CARD_UPDATED = "card.updated"

EVENT_TYPES: tuple[str, ...] = (
    OUTCOME_KNOWN,
    UNKNOWN,
    MANUAL_REVIEW,
    CONTRADICTED,
    DUPLICATE_DETECTED,
    MANDATE_UPDATED,
    CARD_UPDATED,
)


@quick_init
@dataclass(frozen=True)
class OperationView:
    """The parts of an operation whose change is news."""

    state: State
    duplicate_detected: bool
    outcome_contradicted: bool


def operation_events(before: OperationView, after: OperationView) -> list[str]:
    """The events a change from `before` to `after` gives, in a stable order."""
    events = []
    if after.state != before.state:
        if after.state in FINAL:
            events.append(OUTCOME_KNOWN)
        elif after.state == State.UNKNOWN and before.state == State.SUBMITTING:
            # From a check or a review that found nothing it is no news: the
            # outcome was already unknown.
            events.append(UNKNOWN)
        elif after.state == State.MANUAL_REVIEW:
            events.append(MANUAL_REVIEW)
    if after.outcome_contradicted and not before.outcome_contradicted:
        events.append(CONTRADICTED)
    if after.duplicate_detected and not before.duplicate_detected:
        events.append(DUPLICATE_DETECTED)
    return events


def subscribed(event_type: str, wanted: list[str] | None) -> bool:
    """An endpoint with no list takes every event."""
    return wanted is None or event_type in wanted


@dataclass(frozen=True)
class RetrySchedule:
    first_delay: timedelta
    longest_delay: timedelta
    horizon: timedelta


def next_delivery_at(
    schedule: RetrySchedule,
    failed_attempts: int,
    event_created_at: datetime,
    now: datetime,
    jitter: float,
) -> datetime | None:
    """When to try again after `failed_attempts` (≥ 1) failures, or None to give up.

    `jitter` in [0, 1) takes up to a fifth off the delay."""
    if failed_attempts < 1:
        raise ValueError("failed_attempts counts failures already made: at least 1")
    if not 0 <= jitter < 1:
        raise ValueError("jitter must be in [0, 1)")
    delay = schedule.first_delay
    # Doubled until it reaches the cap (never beyond: timedelta overflows).
    for _ in range(failed_attempts - 1):
        if delay >= schedule.longest_delay:
            break
        delay *= 2
    delay = min(delay, schedule.longest_delay)
    delay -= delay * (jitter / 5)
    at: datetime = now + delay
    if at > event_created_at + schedule.horizon:
        return None
    return at
