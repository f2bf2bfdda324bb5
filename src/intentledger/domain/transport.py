"""What a provider's answer (or its absence) proves about execution.

Transport is not outcome: a lost response proves only that we lack an answer.
The adapter reports *what it saw*; these rules decide *what that proves*.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class Transport(StrEnum):
    # The connection was never established: the request cannot have been read.
    NOT_SENT = "not_sent"
    # Bytes may have left (or a response was being read) and no answer arrived.
    NO_RESPONSE = "no_response"
    RESPONSE = "response"


class Verdict(StrEnum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    # Evidence that the provider did not execute the request; it may be sent again.
    NOT_EXECUTED = "not_executed"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class ProviderAnswer:
    """What one provider call produced, as seen on the wire."""

    transport: Transport
    error_class: str | None = None  # e.g. "httpx.ReadTimeout" when no response
    status: int | None = None
    error_code: str | None = None  # the provider's error type/code, if any
    provider_reference: str | None = None
    retry_after: tuple[str, ...] = ()  # raw Retry-After header values
    detail: dict[str, object] = field(default_factory=dict)


# Provider error codes that mean "something already happened under this key",
# so a 4xx carrying them is not a final decline of this request.
KEY_CONFLICT_CODES = frozenset(
    {"idempotency_error", "idempotency_key_reused", "idempotency_key_in_use"}
)
# Statuses the provider documents as a final refusal of this very request.
FINAL_REFUSAL_STATUSES = frozenset({400, 402, 422})


@dataclass(frozen=True)
class Classification:
    verdict: Verdict
    reason: str


def classify(answer: ProviderAnswer) -> Classification:
    if answer.transport is Transport.NOT_SENT:
        return Classification(
            Verdict.NOT_EXECUTED, f"connection never established ({answer.error_class})"
        )
    if answer.transport is Transport.NO_RESPONSE:
        return Classification(Verdict.UNKNOWN, f"no response ({answer.error_class})")
    status = answer.status
    assert status is not None, "a response always has a status"
    if 200 <= status < 300:
        return Classification(Verdict.SUCCEEDED, f"provider answered {status}")
    if status == 429:
        return Classification(Verdict.NOT_EXECUTED, "provider refused with 429 before processing")
    if status == 409:
        # Stripe's idempotency_key_in_use: the earlier request reached the
        # provider and is still being processed. Neither failed nor resendable.
        return Classification(Verdict.UNKNOWN, "provider reports the key in use (409)")
    if status in FINAL_REFUSAL_STATUSES:
        if answer.error_code in KEY_CONFLICT_CODES:
            return Classification(
                Verdict.UNKNOWN, f"{status} {answer.error_code}: the key was used before"
            )
        return Classification(
            Verdict.FAILED, f"provider refused with {status} ({answer.error_code})"
        )
    if status >= 500:
        return Classification(Verdict.UNKNOWN, f"provider error {status}: outcome indeterminate")
    # Anything else (401, 403, 404, 3xx, ...) is not documented as final for a
    # charge: treat it as unknown rather than guess a failure.
    return Classification(Verdict.UNKNOWN, f"undocumented status {status}")


class LookupVerdict(StrEnum):
    """What one provider lookup by our reference showed. None of these means
    "safe to resubmit": that is the safety review's question, not the lookup's."""

    SUCCEEDED = "found_succeeded"
    FAILED = "found_failed"
    PROCESSING = "processing"
    NOT_FOUND = "not_found"
    LOOKUP_FAILED = "lookup_failed"


@dataclass(frozen=True)
class ChargeSeen:
    provider_reference: str
    status: str  # the provider's own word: succeeded, failed, processing, ...


@dataclass(frozen=True)
class LookupAnswer:
    answer: ProviderAnswer
    charges: tuple[ChargeSeen, ...] = ()
    # False when a 2xx body could not be read: that is no evidence of absence.
    readable: bool = True


@dataclass(frozen=True)
class LookupJudgement:
    verdict: LookupVerdict
    reason: str
    provider_reference: str | None = None
    # More than one executed charge under one reference is a duplicate to refund.
    executed_charges: int = 0
    # Every charge the lookup listed as executed, and as finally failed.
    executed: frozenset[str] = frozenset()
    failed: frozenset[str] = frozenset()


# Only these words are final failures; anything unrecognised is not an outcome.
_FAILED_WORDS = frozenset({"failed", "canceled", "cancelled", "declined"})


def judge_lookup(lookup: LookupAnswer) -> LookupJudgement:
    answer = lookup.answer
    if answer.transport is not Transport.RESPONSE:
        return LookupJudgement(
            LookupVerdict.LOOKUP_FAILED, f"lookup got no answer ({answer.error_class})"
        )
    status = answer.status
    if status is None or not 200 <= status < 300:
        return LookupJudgement(LookupVerdict.LOOKUP_FAILED, f"lookup answered {status}")
    if not lookup.readable:
        return LookupJudgement(LookupVerdict.LOOKUP_FAILED, f"lookup answer {status} unreadable")
    if not lookup.charges:
        return LookupJudgement(LookupVerdict.NOT_FOUND, "no charge carries our reference")
    succeeded = [c for c in lookup.charges if c.status == "succeeded"]
    failed = [c for c in lookup.charges if c.status in _FAILED_WORDS]
    executed = frozenset(c.provider_reference for c in succeeded)
    failed_refs = frozenset(c.provider_reference for c in failed)
    if succeeded:
        distinct = len(executed)
        extra = f" ({distinct} executed charges: a duplicate)" if distinct > 1 else ""
        return LookupJudgement(
            LookupVerdict.SUCCEEDED,
            f"charge {succeeded[0].provider_reference} succeeded{extra}",
            succeeded[0].provider_reference,
            executed_charges=distinct,
            executed=executed,
            failed=failed_refs,
        )
    if failed and len(failed) == len(lookup.charges):
        return LookupJudgement(
            LookupVerdict.FAILED,
            f"charge {failed[0].provider_reference} is {failed[0].status}",
            failed[0].provider_reference,
            executed=executed,
            failed=failed_refs,
        )
    # Still processing, or a status we do not know: neither is an outcome.
    other = next(c for c in lookup.charges if c.status not in _FAILED_WORDS)
    return LookupJudgement(
        LookupVerdict.PROCESSING,
        f"charge {other.provider_reference} is {other.status!r}: not final",
        other.provider_reference,
        executed=executed,
        failed=failed_refs,
    )
