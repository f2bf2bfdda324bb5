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
