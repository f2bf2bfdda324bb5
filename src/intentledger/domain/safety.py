"""Safety review: may an unresolved operation be sent again, and how?

Evidence (what lookups found), timing (when to look) and resubmission safety
are separate questions. This module answers only the last, by explicit rules
evaluated in order; the first that applies decides, and its name, inputs and
reason are stored as a decision row. A resubmission with the *same* key is a
replay the provider deduplicates only while it still holds the key; after
that, a same-key request may execute a second time, so no rule here resends
automatically unless a provider's rule explicitly allows a deliberate new
request after repeated not-found lookups (off by default).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum

from intentledger.domain.retention import RetentionPolicy
from intentledger.domain.states import NextAction


class Resolution(StrEnum):
    REPLAY_SAME_KEY = "replay_same_key"
    NEW_REQUEST = "new_request"
    # The new-request rule is on but its evidence is not complete yet: look again.
    KEEP_CHECKING = "keep_checking"
    MANUAL_REVIEW = "manual_review"


@dataclass(frozen=True)
class SafetyRules:
    # Replays stop this fraction short of the documented retention minimum.
    margin: float = 0.10
    # After this many lookups, or this long unresolved, a person decides.
    max_checks: int = 10
    max_age: timedelta = timedelta(days=7)
    # A deliberate new request (new key) after not-found lookups: off by default.
    allow_new_request: bool = False
    new_request_min_not_found: int = 3
    new_request_min_spread: timedelta = timedelta(hours=1)


@dataclass(frozen=True)
class Evidence:
    """What the checks so far produced. `lookups` counts every check; the
    not-found figures count only lookups made after the last attempt, the only
    ones that can speak for it."""

    lookups: int
    not_found: int
    lookup_failures: int
    first_not_found_at: datetime | None
    last_not_found_at: datetime | None
    # The last lookup's reason, as recorded.
    last_result: str | None


@dataclass(frozen=True)
class ReviewInputs:
    now: datetime
    key_first_used_at: datetime
    unresolved_since: datetime
    evidence: Evidence
    policy: RetentionPolicy
    # Why a new key would not fit under the money it may move (the mandate, the
    # refunded charge) beside every key still live; None: it fits.
    no_room_for_a_new_key: str | None = None


@dataclass(frozen=True)
class SafetyDecision:
    rule: str
    resolution: Resolution
    next_action: NextAction
    reason: str
    key_age: timedelta
    replay_bound: timedelta


def replay_bound(policy: RetentionPolicy, rules: SafetyRules) -> timedelta:
    """The key age below which a same-key replay is still deduplicated."""
    return policy.minimum * (1 - rules.margin)


def may_replay_same_key(policy: RetentionPolicy, rules: SafetyRules, key_age: timedelta) -> bool:
    return policy.deduplicates_by_key and key_age < replay_bound(policy, rules)


def review(inputs: ReviewInputs, rules: SafetyRules) -> SafetyDecision:
    key_age = inputs.now - inputs.key_first_used_at
    bound = replay_bound(inputs.policy, rules)
    evidence = inputs.evidence

    def decide(rule: str, resolution: Resolution, reason: str) -> SafetyDecision:
        next_action = {
            Resolution.REPLAY_SAME_KEY: NextAction.RESUBMIT,
            Resolution.NEW_REQUEST: NextAction.RESUBMIT,
            Resolution.KEEP_CHECKING: NextAction.RECONCILE,
            Resolution.MANUAL_REVIEW: NextAction.OPERATOR,
        }[resolution]
        return SafetyDecision(rule, resolution, next_action, reason, key_age, bound)

    unresolved_for = inputs.now - inputs.unresolved_since
    if evidence.lookups >= rules.max_checks or unresolved_for >= rules.max_age:
        return decide(
            "checks_exhausted",
            Resolution.MANUAL_REVIEW,
            f"{evidence.lookups} checks over {unresolved_for} without evidence "
            f"(limits: {rules.max_checks} checks, {rules.max_age}): a person decides",
        )
    if may_replay_same_key(inputs.policy, rules, key_age):
        return decide(
            "replay_within_retention",
            Resolution.REPLAY_SAME_KEY,
            f"key age {key_age} is below {bound} ({inputs.policy.provider_api} minimum "
            f"{inputs.policy.minimum} less {rules.margin:.0%}): the provider deduplicates a "
            "same-key replay, so it cannot execute twice",
        )
    if (
        rules.allow_new_request
        and _not_found_long_enough(evidence, rules)
        and inputs.no_room_for_a_new_key is not None
    ):
        return decide(
            "no_room_for_a_new_key",
            Resolution.MANUAL_REVIEW,
            f"the provider's rule would allow a new request, but {inputs.no_room_for_a_new_key}: "
            "a person decides",
        )
    if rules.allow_new_request and _not_found_long_enough(evidence, rules):
        return decide(
            "new_request_after_not_found",
            Resolution.NEW_REQUEST,
            f"{evidence.not_found} not-found lookups spread over "
            f"{_spread(evidence)} (rule: {rules.new_request_min_not_found} over "
            f"{rules.new_request_min_spread}); the provider's rule allows a deliberate "
            "new request with a new key",
        )
    if rules.allow_new_request:
        return decide(
            "awaiting_not_found",
            Resolution.KEEP_CHECKING,
            f"{evidence.not_found} not-found lookups since the last attempt, spread over "
            f"{_spread(evidence)}; the provider's rule allows a new request after "
            f"{rules.new_request_min_not_found} over {rules.new_request_min_spread}: "
            "checking again (the checks/age limits still hand it to a person)",
        )
    if not inputs.policy.deduplicates_by_key:
        reason = f"{inputs.policy.provider_api} does not deduplicate by key"
    else:
        reason = (
            f"key age {key_age} is at or past {bound} ({inputs.policy.provider_api} minimum "
            f"{inputs.policy.minimum} less {rules.margin:.0%}): the key may be pruned and a "
            "same-key request could execute again"
        )
    return decide("retention_passed", Resolution.MANUAL_REVIEW, reason + ": a person decides")


def _spread(evidence: Evidence) -> timedelta:
    if evidence.first_not_found_at is None or evidence.last_not_found_at is None:
        return timedelta(0)
    return evidence.last_not_found_at - evidence.first_not_found_at


def _not_found_long_enough(evidence: Evidence, rules: SafetyRules) -> bool:
    return (
        evidence.not_found >= rules.new_request_min_not_found
        and _spread(evidence) >= rules.new_request_min_spread
    )


def attempt_key(operation_id: str, number: int) -> str:
    """The provider-facing idempotency key of attempt `number`. Every replay of
    an attempt sends its key again (the provider deduplicates); a deliberate
    new request, authorised by a decision, is the next attempt with the next key."""
    return f"{operation_id}:{number}"
