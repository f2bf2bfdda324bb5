"""Safety review rules, at their boundaries, with retention policies from the registry."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from intentledger.domain.retention import REGISTRY, RetentionPolicy, sandbox_policy
from intentledger.domain.safety import (
    Evidence,
    Resolution,
    ReviewInputs,
    SafetyRules,
    may_replay_same_key,
    replay_bound,
    review,
)
from intentledger.domain.states import NextAction

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def evidence(lookups: int = 1, not_found: int = 1, spread: timedelta = timedelta(0)) -> Evidence:
    return Evidence(
        lookups=lookups,
        not_found=not_found,
        lookup_failures=lookups - not_found,
        first_not_found_at=T0 if not_found else None,
        last_not_found_at=T0 + spread if not_found else None,
        last_result="no charge carries our reference",
    )


def inputs(policy: RetentionPolicy, key_age: timedelta, ev: Evidence | None = None) -> ReviewInputs:
    return ReviewInputs(
        now=T0 + key_age,
        key_first_used_at=T0,
        unresolved_since=T0,
        evidence=ev or evidence(),
        policy=policy,
    )


@pytest.mark.parametrize(
    ("api", "allowed", "refused"),
    [
        ("stripe-v1", timedelta(hours=21, minutes=30), timedelta(hours=21, minutes=36)),
        ("mollie", timedelta(minutes=53, seconds=59), timedelta(minutes=54)),
        ("paypal-orders-v2-create", timedelta(hours=5, minutes=23), timedelta(hours=5, minutes=24)),
        ("adyen", timedelta(days=6, hours=7), timedelta(days=6, hours=7, minutes=12)),
    ],
)
def test_replay_allowed_below_retention_less_margin_and_manual_from_there(
    api: str, allowed: timedelta, refused: timedelta
) -> None:
    policy = REGISTRY[api]
    rules = SafetyRules()
    # checks_exhausted must not be what decides here
    rules = SafetyRules(max_age=timedelta(days=60))
    yes = review(inputs(policy, allowed), rules)
    assert (yes.rule, yes.resolution, yes.next_action) == (
        "replay_within_retention",
        Resolution.REPLAY_SAME_KEY,
        NextAction.RESUBMIT,
    )
    no = review(inputs(policy, refused), rules)
    assert (no.rule, no.resolution, no.next_action) == (
        "retention_passed",
        Resolution.MANUAL_REVIEW,
        NextAction.OPERATOR,
    )
    for later in (refused + timedelta(hours=1), refused + timedelta(days=40)):
        assert review(inputs(policy, later), rules).resolution is Resolution.MANUAL_REVIEW
    assert yes.key_age == allowed and no.key_age == refused


def test_stripe_v1_bound_is_21_hours_36_minutes() -> None:
    assert replay_bound(REGISTRY["stripe-v1"], SafetyRules()) == timedelta(hours=21, minutes=36)
    assert replay_bound(REGISTRY["mollie"], SafetyRules()) == timedelta(minutes=54)


def test_every_registry_entry_cites_a_source_and_a_minimum() -> None:
    expected = {
        "stripe-v1": timedelta(hours=24),
        "stripe-v2": timedelta(days=30),
        "checkout-com": timedelta(hours=24),
        "braintree-graphql": timedelta(days=30),
        "mollie": timedelta(hours=1),
        "adyen": timedelta(days=7),
        "paypal-orders-v2-create": timedelta(hours=6),
    }
    assert {api: policy.minimum for api, policy in REGISTRY.items()} == expected
    for policy in REGISTRY.values():
        assert policy.source and policy.provider_api in policy.note
    assert "7 days vs 31 days" in REGISTRY["adyen"].note
    assert sandbox_policy(timedelta(seconds=3)).minimum == timedelta(seconds=3)


def test_checks_exhausted_sends_to_a_person_even_inside_retention() -> None:
    rules = SafetyRules(max_checks=3)
    decision = review(inputs(REGISTRY["stripe-v1"], timedelta(minutes=5), evidence(3, 3)), rules)
    assert (decision.rule, decision.resolution) == ("checks_exhausted", Resolution.MANUAL_REVIEW)
    old = ReviewInputs(
        T0 + timedelta(days=8), T0 + timedelta(days=8), T0, evidence(), REGISTRY["stripe-v2"]
    )
    assert review(old, SafetyRules()).rule == "checks_exhausted"


def test_new_request_only_when_the_provider_rule_allows_it() -> None:
    policy = REGISTRY["stripe-v1"]
    past = timedelta(hours=23)
    spread_out = evidence(lookups=4, not_found=4, spread=timedelta(hours=2))
    assert review(inputs(policy, past, spread_out), SafetyRules()).rule == "retention_passed"
    allowing = SafetyRules(
        allow_new_request=True,
        new_request_min_not_found=3,
        new_request_min_spread=timedelta(hours=1),
    )
    decision = review(inputs(policy, past, spread_out), allowing)
    assert (decision.rule, decision.resolution) == (
        "new_request_after_not_found",
        Resolution.NEW_REQUEST,
    )
    # Not enough evidence yet: look again rather than hand over or resend.
    too_few = evidence(lookups=2, not_found=2, spread=timedelta(hours=2))
    waiting = review(inputs(policy, past, too_few), allowing)
    assert (waiting.rule, waiting.resolution, waiting.next_action) == (
        "awaiting_not_found",
        Resolution.KEEP_CHECKING,
        NextAction.RECONCILE,
    )
    too_close = evidence(lookups=4, not_found=4, spread=timedelta(minutes=59))
    assert review(inputs(policy, past, too_close), allowing).rule == "awaiting_not_found"
    # Inside retention the same-key replay is still preferred over a new request.
    assert review(inputs(policy, timedelta(hours=1), spread_out), allowing).rule == (
        "replay_within_retention"
    )


@given(
    key_age=st.timedeltas(min_value=timedelta(0), max_value=timedelta(days=90)),
    api=st.sampled_from(sorted(REGISTRY)),
    lookups=st.integers(0, 20),
    margin=st.floats(0, 0.5),
)
def test_no_same_key_replay_at_or_past_the_bound(
    key_age: timedelta, api: str, lookups: int, margin: float
) -> None:
    policy = REGISTRY[api]
    rules = SafetyRules(margin=margin, max_checks=1000, max_age=timedelta(days=365))
    decision = review(inputs(policy, key_age, evidence(lookups, lookups)), rules)
    if decision.resolution is Resolution.REPLAY_SAME_KEY:
        assert key_age < policy.minimum * (1 - margin)
        assert may_replay_same_key(policy, rules, key_age)
    else:
        assert decision.resolution is Resolution.MANUAL_REVIEW  # new requests are off by default
