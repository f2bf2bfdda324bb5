"""What a provider's answer (or its absence) proves about execution.

Transport is not outcome: a lost response proves only that we lack an answer.
The adapter reports *what it saw*; these rules decide *what that proves*.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum

from intentledger.domain.quick_init import quick_init


class Transport(StrEnum):
    # The connection was never established: the request cannot have been read.
    NOT_SENT = "not_sent"
    # Bytes may have left (or a response was being read) and no answer arrived.
    NO_RESPONSE = "no_response"
    RESPONSE = "response"


class Verdict(StrEnum):
    """What one submit's answer proves, in the provider-neutral words the funnel reads.

    Which of its statuses and error types means which is each adapter's
    documented knowledge (`Provider.map_answer`); only the transport cases
    (no connection, no answer) are decided by the exact exception class
    (providers/http.py).
    """

    SUCCEEDED = "succeeded"
    # Final for this request: the provider processed it and said no.
    FAILED = "failed"
    # Evidence that the provider did not execute the request; it may be sent
    # again with the same key.
    NOT_EXECUTED = "not_executed"
    # Refused before processing because of our configuration (credentials,
    # permissions): not executed, but sending again cannot help; a person fixes it.
    MISCONFIGURED = "misconfigured"
    # Executed or executing, outcome not final yet.
    PENDING = "pending"
    # The key was used before (other parameters, or still in flight): something
    # may have executed under it.
    KEY_CONFLICT = "key_conflict"
    UNKNOWN = "unknown"


# What an answer may prove about its attempt's execution; the rest prove nothing.
PROVING = frozenset(
    {Verdict.SUCCEEDED, Verdict.FAILED, Verdict.NOT_EXECUTED, Verdict.MISCONFIGURED}
)
# Answers proving the provider did not execute the request.
NOT_EXECUTED = frozenset({Verdict.NOT_EXECUTED, Verdict.MISCONFIGURED})


@quick_init
@dataclass(frozen=True)
class Classification:
    verdict: Verdict
    reason: str


# The longest provider reference the ledger keeps (its columns' width). A
# longer one is kept cut to it, as a webhook event keeps its own: an
# answer, a look and an event about one execution then name it alike, and
# PostgreSQL, which refuses a longer value where SQLite keeps it, never
# refuses the record of an outcome.
REFERENCE_WIDTH = 255


# The longest error class the ledger keeps (its column's width). The class is
# the qualified name of whatever the call raised, and a provider's adapter may
# be a plug-in whose libraries name their exceptions at any length: a longer
# name is kept cut, so the answer it describes is never refused its record.
ERROR_CLASS_WIDTH = 64


def _kept_reference(reference: str | None) -> str | None:
    if reference is not None and len(reference) > REFERENCE_WIDTH:
        return reference[:REFERENCE_WIDTH]
    return reference


@quick_init
@dataclass(frozen=True)
class ProviderAnswer:
    """What one provider call produced, as seen on the wire (its reference
    kept to `REFERENCE_WIDTH`, its error class to `ERROR_CLASS_WIDTH`)."""

    transport: Transport
    error_class: str | None = None  # e.g. "aiohttp.SocketTimeoutError" when no response
    status: int | None = None
    error_code: str | None = None  # the provider's error type/code, if any
    provider_reference: str | None = None
    retry_after: tuple[str, ...] = ()  # raw Retry-After header values
    detail: dict[str, object] = field(default_factory=dict)
    # The adapter's reading of a response (None: the adapter does not map it).
    mapped: Classification | None = None

    def __post_init__(self) -> None:
        kept = _kept_reference(self.provider_reference)
        if kept is not self.provider_reference:
            object.__setattr__(self, "provider_reference", kept)
        error_class = self.error_class
        if error_class is not None and len(error_class) > ERROR_CLASS_WIDTH:
            object.__setattr__(self, "error_class", error_class[:ERROR_CLASS_WIDTH])


def usual_answer(answer: ProviderAnswer) -> bool:
    """A response on the provider's usual path (a 2xx): its time says how fast
    the provider is."""
    return answer.transport is Transport.RESPONSE and 200 <= (answer.status or 0) < 300


def classify(answer: ProviderAnswer) -> Classification:
    """What an answer proves: the transport decides when there was no response,
    the adapter's mapping when there was one. A response the adapter does not
    map proves nothing: never success, never failure."""
    if answer.transport is Transport.NOT_SENT:
        return Classification(
            Verdict.NOT_EXECUTED, f"connection never established ({answer.error_class})"
        )
    if answer.transport is Transport.NO_RESPONSE:
        return Classification(Verdict.UNKNOWN, f"no response ({answer.error_class})")
    assert answer.status is not None, "a response always has a status"
    if answer.mapped is None:
        code = f" ({answer.error_code})" if answer.error_code else ""
        return Classification(
            Verdict.UNKNOWN, f"status {answer.status}{code} is not mapped by the adapter"
        )
    return answer.mapped


class LookupVerdict(StrEnum):
    """What one provider lookup by our reference showed. None of these means
    "safe to resubmit": that is the safety review's question, not the lookup's."""

    SUCCEEDED = "found_succeeded"
    FAILED = "found_failed"
    PROCESSING = "processing"
    NOT_FOUND = "not_found"
    # Nothing found, but the lookup is eventually consistent and the last
    # attempt is younger than its lag: inconclusive, not a not-found.
    NOT_YET_VISIBLE = "not_yet_visible"
    LOOKUP_FAILED = "lookup_failed"
    # The provider has no lookup (Adyen's Checkout API): nothing was asked, and
    # nothing is proven either way.
    NO_LOOKUP = "no_lookup"


@dataclass(frozen=True)
class ChargeSeen:
    provider_reference: str
    # The adapter's word for it: succeeded, failed, processing, or the
    # provider's own status when the adapter does not map it (never final).
    status: str
    raw_status: str | None = None  # the provider's own status, as it said it

    def __post_init__(self) -> None:
        kept = _kept_reference(self.provider_reference)
        if kept is not self.provider_reference:
            object.__setattr__(self, "provider_reference", kept)


@dataclass(frozen=True)
class LookupAnswer:
    answer: ProviderAnswer
    charges: tuple[ChargeSeen, ...] = ()
    # False when a 2xx body could not be read: that is no evidence of absence.
    readable: bool = True
    # False when the lookup did not cover everything (a bounded list scan that
    # stopped at its bound): an absence it shows is no evidence either.
    complete: bool = True
    # How the adapter looked (retrieve by id, search, list scan), for the record.
    method: str | None = None
    # An eventually consistent lookup's lag (None: strongly consistent). Inside
    # it, measured from the last attempt, "nothing found" is inconclusive.
    lag: timedelta | None = None
    # False: the provider has no lookup, so nothing was asked (`no_lookup`).
    asked: bool = True


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
    # Every object it listed in a state that is not final: "not final" is
    # never "not executed" (processing, pending, requires_*, a word not mapped).
    open: frozenset[str] = frozenset()
    # For NOT_YET_VISIBLE: when an absence starts to count.
    visible_at: datetime | None = None
    # False when the lookup did not cover everything (a list scan that stopped
    # at its bound): whatever it shows, it cannot show that nothing else is open.
    complete: bool = True


def _nothing_found(
    lookup: LookupAnswer, last_sent_at: datetime | None, now: datetime | None
) -> LookupJudgement:
    how = f" ({lookup.method})" if lookup.method else ""
    if not lookup.complete:
        return LookupJudgement(
            LookupVerdict.LOOKUP_FAILED, f"nothing found, but the lookup{how} was not complete"
        )
    if lookup.lag is not None and last_sent_at is not None and now is not None:
        visible_at = last_sent_at + lookup.lag
        if now < visible_at:
            return LookupJudgement(
                LookupVerdict.NOT_YET_VISIBLE,
                f"nothing found{how}, but the lookup may lag up to {lookup.lag} and the last "
                f"attempt was sent {now - last_sent_at} ago: inconclusive until "
                f"{visible_at.isoformat()}",
                visible_at=visible_at,
            )
    return LookupJudgement(LookupVerdict.NOT_FOUND, f"no charge carries our reference{how}")


# Only these words are final failures; anything unrecognised is not an outcome.
_FAILED_WORDS = frozenset({"failed", "canceled", "cancelled", "declined"})


def speaks_an_outcome(word: str | None) -> bool:
    """Whether an adapter's word (a lookup's or a webhook's) is read as a final
    success or failure anywhere: the words an unnamed status must never become."""
    return word == "succeeded" or word in _FAILED_WORDS


def judge_lookup(
    lookup: LookupAnswer, last_sent_at: datetime | None = None, now: datetime | None = None
) -> LookupJudgement:
    """What a lookup shows. `last_sent_at` (the last attempt's send) and `now`
    place an eventually consistent lookup's "nothing found" inside or past its lag."""
    answer = lookup.answer
    if not lookup.asked:
        return LookupJudgement(
            LookupVerdict.NO_LOOKUP,
            "the provider has no lookup: nothing was asked (its evidence is a same-key "
            "resend while the key is kept, and its notifications)",
        )
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
        return _nothing_found(lookup, last_sent_at, now)
    succeeded = [c for c in lookup.charges if c.status == "succeeded"]
    failed = [c for c in lookup.charges if c.status in _FAILED_WORDS]
    executed = frozenset(c.provider_reference for c in succeeded)
    failed_refs = frozenset(c.provider_reference for c in failed)
    # Not final: any word that is neither success nor failure, and a status that
    # waits on someone (requires_*), whatever outcome the adapter maps it to —
    # somebody may still act on it.
    open_refs = frozenset(
        c.provider_reference
        for c in lookup.charges
        if c.provider_reference not in executed
        and (c.provider_reference not in failed_refs or _waits_on_someone(c))
    )
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
            open=open_refs,
            complete=lookup.complete,
        )
    if failed and len(failed) == len(lookup.charges):
        return LookupJudgement(
            LookupVerdict.FAILED,
            f"charge {failed[0].provider_reference} is {failed[0].status}",
            failed[0].provider_reference,
            executed=executed,
            failed=failed_refs,
            open=open_refs,
            complete=lookup.complete,
        )
    # Still processing, or a status we do not know: neither is an outcome.
    other = next(c for c in lookup.charges if c.status not in _FAILED_WORDS)
    return LookupJudgement(
        LookupVerdict.PROCESSING,
        f"charge {other.provider_reference} is {other.status!r}: not final",
        other.provider_reference,
        executed=executed,
        failed=failed_refs,
        open=open_refs,
        complete=lookup.complete,
    )


def _waits_on_someone(charge: ChargeSeen) -> bool:
    return (charge.raw_status or "").startswith("requires_")
