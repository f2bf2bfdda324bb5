"""Safety review: gather the inputs, apply the domain's rules, record the decision.

Runs inside the reconciler's record transaction when a check produced no
evidence. The decision row holds everything the rule saw, so a reviewer can
tell later why the operation was (or was not) sent again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, replace
from datetime import datetime

from intentledger.domain.retention import RetentionPolicy
from intentledger.domain.safety import (
    Evidence,
    Resolution,
    ReviewInputs,
    SafetyDecision,
    SafetyRules,
    attempt_key,
    review,
)
from intentledger.domain.states import NextAction, State
from intentledger.domain.transport import LookupVerdict
from intentledger.engine import changes
from intentledger.engine.new_keys import room_for_a_new_key
from intentledger.engine.unknown import plan_unknown
from intentledger.store.ledger import Ledger
from intentledger.store.records import OperationRecord

PolicyFor = Callable[[str], RetentionPolicy]
RulesFor = Callable[[str], SafetyRules]


async def gather_evidence(ledger: Ledger, operation_id: str) -> Evidence:
    """The checks so far. Not-found lookups count only when made after the last
    attempt: one from before it says nothing about what that attempt did. A
    lookup that failed is never a not-found."""
    lookups = await ledger.lookups_of(operation_id)
    last = await ledger.last_attempt(operation_id)
    since = last.submitted_at if last is not None else None
    not_found = [
        o
        for o in lookups
        if o.verdict == LookupVerdict.NOT_FOUND and (since is None or o.at > since)
    ]
    return Evidence(
        lookups=len(lookups),
        not_found=len(not_found),
        lookup_failures=sum(o.verdict == LookupVerdict.LOOKUP_FAILED for o in lookups),
        first_not_found_at=not_found[0].at if not_found else None,
        last_not_found_at=not_found[-1].at if not_found else None,
        last_result=lookups[-1].reason if lookups else "no lookup yet",
    )


def policy_document(policy: RetentionPolicy) -> dict[str, object]:
    """A retention policy as a decision row records it."""
    return {
        "provider_api": policy.provider_api,
        "minimum_seconds": policy.minimum.total_seconds(),
        "deduplicates_by_key": policy.deduplicates_by_key,
        "source": policy.source,
        "note": policy.note,
    }


def _inputs_document(
    inputs: ReviewInputs, rules: SafetyRules, decision: SafetyDecision, key: str
) -> dict[str, object]:
    evidence = asdict(inputs.evidence)
    for name in ("first_not_found_at", "last_not_found_at"):
        value = evidence[name]
        evidence[name] = value.isoformat() if isinstance(value, datetime) else None
    return {
        "evidence": evidence,
        "provider_idempotency_key": key,
        "key_first_used_at": inputs.key_first_used_at.isoformat(),
        "key_age_seconds": decision.key_age.total_seconds(),
        "replay_bound_seconds": decision.replay_bound.total_seconds(),
        "unresolved_since": inputs.unresolved_since.isoformat(),
        "provider_retention_note": inputs.policy.note,
        "policy": policy_document(inputs.policy),
        "no_room_for_a_new_key": inputs.no_room_for_a_new_key,
        "rules": {
            "margin": rules.margin,
            "max_checks": rules.max_checks,
            "max_age_seconds": rules.max_age.total_seconds(),
            "allow_new_request": rules.allow_new_request,
            "new_request_min_not_found": rules.new_request_min_not_found,
            "new_request_min_spread_seconds": rules.new_request_min_spread.total_seconds(),
        },
    }


async def run_safety_review(
    ledger: Ledger,
    operation: OperationRecord,
    *,
    now: datetime,
    policy: RetentionPolicy,
    rules: SafetyRules,
    source: str,
    reason: str,
    reconciliation_status: str,
    recheck_at: datetime,
) -> None:
    """RECONCILIATION_DUE -> SAFETY_REVIEW, a decision row, and what it orders:
    a resubmission (an outbox row citing the decision), another check at
    `recheck_at` (UNKNOWN), or MANUAL_REVIEW."""
    last = await ledger.last_attempt(operation.operation_id)
    assert last is not None, "only an attempted operation can be under review"
    key = last.provider_idempotency_key
    if operation.kind == "refund":
        # A new-key refund could pay the customer twice: only a person approves
        # one, after the payment's refundable amount is checked for it.
        rules = replace(rules, allow_new_request=False)
    keys, no_room = (
        await room_for_a_new_key(ledger, operation) if rules.allow_new_request else (0, None)
    )
    inputs = ReviewInputs(
        now=now,
        key_first_used_at=await ledger.first_use_of_key(operation.operation_id, key),
        unresolved_since=operation.first_attempt_at or now,
        evidence=await gather_evidence(ledger, operation.operation_id),
        policy=policy,
        no_room_for_a_new_key=no_room,
    )
    decision = review(inputs, rules)
    new_key = decision.resolution is Resolution.NEW_REQUEST
    chosen_key = attempt_key(operation.operation_id, last.number + 1) if new_key else key
    document = _inputs_document(inputs, rules, decision, chosen_key)
    document["same_key"] = decision.resolution is Resolution.REPLAY_SAME_KEY
    document["unresolved_attempt"] = last.number
    # Into SAFETY_REVIEW with the decision, then out to what it orders: two
    # changes, each planned from the record as the one before left it.
    planned = changes.Writes(now)
    made = planned.decide(
        operation_id=operation.operation_id,
        actor=operation.actor,
        at=now,
        rule=decision.rule,
        inputs=document,
        next_action=decision.next_action,
        reason=decision.reason,
        key_age_at_decision=decision.key_age,
        source=source,
    )
    planned.change(
        changes.plan(
            operation,
            State.SAFETY_REVIEW,
            now=now,
            next_action=decision.next_action,
            reason=f"{reason}; safety review: {decision.rule}",
            source=source,
            key_age_at_decision=decision.key_age,
            provider_retention_note=policy.note,
            reconciliation_status=reconciliation_status,
            last_observed_at=now,
            # A new key is held from its decision on (engine/new_keys.py).
            **({"live_keys": keys} if new_key else {}),
        )
    )
    if decision.next_action is NextAction.RESUBMIT:
        planned.enqueue(operation, "submit", now, decision=made)
        await planned.save(ledger)
        return
    await planned.save(ledger)
    reviewed = await ledger.lock_operation(operation.operation_id)
    assert reviewed is not None
    if decision.resolution is Resolution.KEEP_CHECKING:
        plan_unknown(planned, reviewed, check_at=recheck_at, reason=decision.reason, source=source)
    else:
        planned.change(
            changes.plan(
                reviewed,
                State.MANUAL_REVIEW,
                now=now,
                next_action=NextAction.OPERATOR,
                reason=decision.reason,
                source=source,
            )
        )
    await planned.save(ledger)
