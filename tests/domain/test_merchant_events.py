"""Which changes are news for the merchant, and when a failed delivery is tried again."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from intentledger.domain.merchant_events import (
    CONTRADICTED,
    DUPLICATE_DETECTED,
    MANUAL_REVIEW,
    OUTCOME_KNOWN,
    UNKNOWN,
    OperationView,
    RetrySchedule,
    next_delivery_at,
    operation_events,
)
from intentledger.domain.states import TRANSITIONS, State

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
SCHEDULE = RetrySchedule(timedelta(seconds=10), timedelta(hours=6), timedelta(days=3))


def view(state: State, duplicate: bool = False, contradicted: bool = False) -> OperationView:
    return OperationView(state, duplicate, contradicted)


@pytest.mark.parametrize(
    ("before", "after", "events"),
    [
        (State.ACCEPTED, State.SUBMITTING, []),
        (State.SUBMITTING, State.ACCEPTED, []),
        (State.SUBMITTING, State.OUTCOME_KNOWN, [OUTCOME_KNOWN]),
        (State.SUBMITTING, State.UNKNOWN, [UNKNOWN]),
        (State.SUBMITTING, State.MANUAL_REVIEW, [MANUAL_REVIEW]),
        (State.UNKNOWN, State.RECONCILIATION_DUE, []),
        # A check or a review that found nothing: the outcome was unknown already.
        (State.RECONCILIATION_DUE, State.UNKNOWN, []),
        (State.SAFETY_REVIEW, State.UNKNOWN, []),
        (State.RECONCILIATION_DUE, State.SAFETY_REVIEW, []),
        (State.RECONCILIATION_DUE, State.MANUAL_REVIEW, [MANUAL_REVIEW]),
        (State.MANUAL_REVIEW, State.OUTCOME_KNOWN, [OUTCOME_KNOWN]),
        (State.MANUAL_REVIEW, State.SUBMITTING, []),
        # Cancelled with its mandate, never sent: final too.
        (State.ACCEPTED, State.CANCELLED, [OUTCOME_KNOWN]),
    ],
)
def test_state_moves_that_are_news(before: State, after: State, events: list[str]) -> None:
    assert after in TRANSITIONS[before]
    assert operation_events(view(before), view(after)) == events


def test_a_flag_is_news_once_when_it_is_raised() -> None:
    settled = view(State.OUTCOME_KNOWN)
    assert operation_events(settled, view(State.OUTCOME_KNOWN, contradicted=True)) == [CONTRADICTED]
    assert operation_events(settled, view(State.OUTCOME_KNOWN, duplicate=True)) == [
        DUPLICATE_DETECTED
    ]
    flagged = view(State.OUTCOME_KNOWN, duplicate=True, contradicted=True)
    assert operation_events(flagged, flagged) == [], "evidence counted twice is no news"
    # A settlement and its flag in one change: both, outcome first.
    assert operation_events(view(State.UNKNOWN), view(State.OUTCOME_KNOWN, duplicate=True)) == [
        OUTCOME_KNOWN,
        DUPLICATE_DETECTED,
    ]


def test_retries_double_up_to_the_longest_delay_then_give_up_after_the_horizon() -> None:
    delays = []
    now = T0
    failures = 0
    while True:
        failures += 1
        at = next_delivery_at(SCHEDULE, failures, T0, now, jitter=0.0)
        if at is None:
            break
        delays.append(at - now)
        now = at
    assert delays[:4] == [timedelta(seconds=s) for s in (10, 20, 40, 80)]
    assert max(delays) == timedelta(hours=6)
    # Tried for about three days, never past them.
    assert timedelta(days=2, hours=18) <= now - T0 <= timedelta(days=3)
    assert len(delays) < 30


@given(
    failures=st.integers(min_value=1, max_value=10_000),
    jitter=st.floats(min_value=0, max_value=1, exclude_max=True),
    elapsed=st.integers(min_value=0, max_value=4 * 86_400),
)
def test_a_retry_is_later_than_now_within_the_longest_delay_and_the_horizon(
    failures: int, jitter: float, elapsed: int
) -> None:
    now = T0 + timedelta(seconds=elapsed)
    at = next_delivery_at(SCHEDULE, failures, T0, now, jitter)
    if at is not None:
        assert now < at <= now + SCHEDULE.longest_delay
        assert at <= T0 + SCHEDULE.horizon
        # The jitter takes at most a fifth off.
        full = min(SCHEDULE.first_delay * 2 ** min(failures - 1, 30), SCHEDULE.longest_delay)
        assert at - now >= full * 0.8


def test_nonsense_is_refused() -> None:
    with pytest.raises(ValueError):
        next_delivery_at(SCHEDULE, 0, T0, T0, 0.0)
    with pytest.raises(ValueError):
        next_delivery_at(SCHEDULE, 1, T0, T0, 1.0)
