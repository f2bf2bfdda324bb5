"""The evidence funnel: what one new piece of evidence means for an operation.

Everything that can say what happened at the provider — the answer to a submit
(or its absence), a lookup by our reference, a provider's webhook, an
operator's statement — is judged here, and only here. `judge` takes what the
ledger knows about one operation (`Facts`) and one piece of evidence, and
returns the `Effect`: settle, become UNKNOWN with a check time, go back to
ACCEPTED on proof of non-execution, go to the safety review, go to a person,
look again, or record only — plus the flags a reviewer must see (a
contradiction, a duplicate) and a provider reference to adopt. The engine
carries the effect out; it keeps no outcome rules of its own.

Evidence never authorises a resubmission: the most it does is send the
operation to the safety review, whose decision (a rule or a person) may.

The unit of "did it execute?" is the provider idempotency key, not the attempt:
attempts that share a key are one request as far as a deduplicating provider is
concerned. A key *may have executed* until an answer under it proves it did not:
a final decline (the provider processed it and said no; a replay returns the
same decline), or every attempt under it refused before processing (429, no
connection). Two executions are two distinct executed provider references,
counted from every piece of evidence — never inferred.

Pure: no I/O, no clock reads; the caller passes `now` and its jitter in.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Literal

from intentledger.domain.backoff import next_check_at, recheck_delay
from intentledger.domain.quick_init import quick_init
from intentledger.domain.retry_after import DEFAULT_CEILING, RetryAfter
from intentledger.domain.safety import SafetyRules
from intentledger.domain.states import FINAL, UNRESOLVED, NextAction, Outcome, State
from intentledger.domain.transport import NOT_EXECUTED, PROVING, LookupVerdict, Verdict
from intentledger.domain.watching import (
    WATCHED,
    Look,
    Watch,
    held,
    not_quiet,
    settled_next_action,
)

# Verification looks at a settled operation (the duplicate and contradiction
# audit) before an absence the provider keeps showing counts against the ledger,
# and before a provider that is still not quiet is shown to a person (the looks
# go on: domain/watching.py).
AUDIT_LOOKS = 10
# A refusal before processing (429, no connection) is sent again no sooner than
# this, doubled for each attempt so far: a `Retry-After: 0` cannot make a loop.
RESEND_FLOOR = timedelta(seconds=1)


@quick_init
@dataclass(frozen=True)
class AttemptFacts:
    """One attempt and the most its submit's answer proved (None: no answer yet,
    or one that proved nothing)."""

    number: int
    key: str
    answer: Verdict | None = None
    reference: str | None = None
    sent_at: datetime | None = None


@quick_init
@dataclass(frozen=True)
class Facts:
    """What the ledger knows about one operation before the new evidence."""

    state: State
    outcome: Outcome | None = None
    provider_reference: str | None = None
    attempts: tuple[AttemptFacts, ...] = ()
    # Distinct provider references some evidence showed executed.
    executed: frozenset[str] = frozenset()
    # Lookups recorded so far (scheduled checks), and verification looks.
    checks: int = 0
    audits: int = 0
    unresolved_since: datetime | None = None
    duplicate_detected: bool = False
    outcome_contradicted: bool = False
    # Where watching the settled operation stands (None: never watched).
    watch: Watch | None = None
    # A submit of the operation is still in flight (its outbox row not done).
    submit_in_flight: bool = False
    # New provider keys a decision authorised that no attempt has sent yet.
    authorised_keys: frozenset[str] = frozenset()
    # The last attempt was answered "pending": the provider has the request.
    last_attempt_pending: bool = False


@quick_init
@dataclass(frozen=True)
class SubmitAnswer:
    """What a submit's call produced (Verdict.UNKNOWN also for no answer at all:
    a resumed delivery or the sweeper)."""

    attempt: int
    verdict: Verdict
    reason: str
    reference: str | None = None
    retry_after: RetryAfter | None = None


@dataclass(frozen=True)
class LookupResult:
    """A provider read by our reference, as `judge_lookup` summarised it."""

    verdict: LookupVerdict
    reason: str
    executed: frozenset[str] = frozenset()  # charges the provider shows succeeded
    failed: frozenset[str] = frozenset()  # charges it shows in a final failed state
    retry_after: RetryAfter | None = None
    # A verification look at a settled operation (an audit), not a scheduled check.
    audit: bool = False
    # For an eventually consistent lookup's early "nothing found": when it counts.
    visible_at: datetime | None = None
    # Objects it showed in a state that is not final, its declared lag, whether
    # it covered everything, and when it was taken (None: `now`).
    open: frozenset[str] = frozenset()
    lag: timedelta | None = None
    complete: bool = True
    looked_at: datetime | None = None


@dataclass(frozen=True)
class OperatorStatement:
    """A person's word on the outcome, with the evidence they relied on."""

    outcome: Outcome
    by: str
    evidence: str
    reference: str | None = None


@dataclass(frozen=True)
class ProviderNotice:
    """A provider's verified webhook about one of its objects under our
    reference: the object's status in the lookup's words (succeeded, failed,
    canceled, processing, or unmapped:<status>)."""

    status: str
    reference: str  # the provider's object, e.g. a PaymentIntent id
    reason: str


Evidence = SubmitAnswer | LookupResult | OperatorStatement | ProviderNotice

# Which operation kinds an event about each kind of provider object may speak
# for: a charge's success says nothing about a refund or a card under the same
# reference (a provider's mix-up, or a forged reference in a signed object).
SPOKEN_FOR: dict[str, frozenset[str]] = {
    "payment": frozenset({"payment"}),
    "refund": frozenset({"refund"}),
    "card": frozenset({"card_issue", "card_freeze", "card_unfreeze"}),
    "beneficiary": frozenset({"beneficiary"}),
}


def amount_differs(
    said: tuple[int, str] | None, amount: int | None, currency: str | None
) -> str | None:
    """Why an event that names an amount cannot speak for an operation of
    another amount (a partial authorisation, a refund of another sum), or None
    when it names none or the same. Such an event settles nothing: a person
    looks."""
    if said is None or amount is None or currency is None:
        return None
    value, unit = said
    if value == amount and unit.upper() == currency.upper():
        return None
    return f"it names {value} {unit}, the operation is for {amount} {currency}"


def speaks_for(object_kind: str | None, operation_kind: str) -> bool:
    """Whether a provider's event about an object of `object_kind` is evidence
    for an operation of `operation_kind`; an object of no declared kind speaks
    for none."""
    return object_kind is not None and operation_kind in SPOKEN_FOR.get(object_kind, ())


# What becomes of a provider's verified event on arrival, before any judging:
# `recorded` events go on to the funnel (`judge`, a ProviderNotice); the others
# are stored and acknowledged, and a `flagged` one is shown to a person.
EventDisposition = Literal[
    "unmapped_type", "unknown_reference", "wrong_kind", "flagged", "recorded"
]


@dataclass(frozen=True)
class NamedOperation:
    """The operation of ours, sent to the same provider, that an event names:
    what its disposition weighs of it."""

    kind: str
    amount: int | None
    currency: str | None


def event_disposition(
    *,
    object_id: str | None,
    status: str | None,
    needs_person: bool,
    object_kind: str | None,
    amount: tuple[int, str] | None,
    operation: NamedOperation | None,
) -> EventDisposition:
    """The disposition of a provider's event about its object `object_id` in
    `status` (the lookup's words; None: a type the adapter does not read) that
    names `operation` (None: no operation of ours at this provider).

    Only an event the adapter reads, about an operation of ours, of a kind that
    speaks for it (`speaks_for`) is evidence; of those, one a person must see
    (a chargeback) or about another amount (`amount_differs`) settles nothing
    and is flagged, and the rest are judged."""
    if not object_id or (status is None and not needs_person):
        return "unmapped_type"  # a type the adapter does not read: nothing to judge
    if operation is None:
        return "unknown_reference"
    if not speaks_for(object_kind, operation.kind):
        return "wrong_kind"
    if needs_person or amount_differs(amount, operation.amount, operation.currency):
        return "flagged"
    return "recorded"


def flag_reason(
    *,
    event_type: str,
    status: str | None,
    amount: tuple[int, str] | None,
    operation: NamedOperation,
) -> str:
    """Why a `flagged` event (`event_disposition`) needs a person: it names
    another amount than the operation's, or the provider moved money outside
    our writes (a chargeback)."""
    differs = amount_differs(amount, operation.amount, operation.currency)
    if differs is not None:
        return f"{status or event_type} for another amount: {differs}"
    return f"{event_type}: the provider moved money outside our writes"


@dataclass(frozen=True)
class Limits:
    """Timing, and the limits after which a person decides (the safety rules')."""

    backoff: timedelta  # our first re-check delay
    max_checks: int = SafetyRules.max_checks
    max_age: timedelta = SafetyRules.max_age
    jitter: float = 0.0  # drawn by the caller, in [0, 1)

    @classmethod
    def of(cls, rules: SafetyRules, backoff: timedelta, jitter: float) -> Limits:
        return cls(backoff, rules.max_checks, rules.max_age, jitter)


class Move(StrEnum):
    SETTLE = "settle"  # OUTCOME_KNOWN with `outcome`
    UNKNOWN = "unknown"  # UNKNOWN, checked again at `check_at`
    REQUEUE = "requeue"  # proof of non-execution: ACCEPTED, sent again at `check_at`
    REVIEW = "review"  # no evidence: the safety review decides
    # MANUAL_REVIEW under `rule`: limits reached (re-checked at `check_at`), or a
    # refusal only a person can fix (no `check_at`: nothing to check).
    OPERATOR = "operator"
    RECHECK = "recheck"  # state unchanged, looked at again at `check_at`
    RECORD = "record"  # recorded; the state does not change
    # A person's statement on a contradicted operation: its outcome is what they
    # state, with the evidence they relied on, and the flag comes down.
    RESOLVE_CONTRADICTION = "resolve_contradiction"


@quick_init
@dataclass(frozen=True)
class Effect:
    move: Move
    reason: str
    outcome: Outcome | None = None
    check_at: datetime | None = None
    reconciliation_status: str | None = None
    # A provider reference the record lacked (a person said "succeeded" without one).
    adopt_reference: str | None = None
    # Newly raised flags (each is raised once and stays).
    contradiction: bool = False
    duplicate: bool = False
    # Every executed reference known once this evidence is counted.
    executed: frozenset[str] = frozenset()
    # Why `check_at` is when it is (the timing rule and the guidance it weighed).
    timing: str | None = None
    # Ask the provider again (the audit), and when.
    verify: bool = False
    verify_at: datetime | None = None
    # For Move.OPERATOR: the rule a person is called under.
    rule: str = "checks_exhausted"
    # Where watching stands after this evidence (None: unchanged), and, when the
    # looks' budget ran out with the provider not quiet, what is still open.
    watch: Watch | None = None
    not_final: str | None = None
    # What a settled operation waits for once watching changes (None: watching
    # did not change, and neither does this).
    next_action: NextAction | None = None
    # Provider keys that may still execute once this evidence is counted.
    live_keys: int = 0


# -- what the facts imply --------------------------------------------------------------------


def keys_in_order(attempts: Iterable[AttemptFacts]) -> list[str]:
    seen: list[str] = []
    for attempt in attempts:
        if attempt.key not in seen:
            seen.append(attempt.key)
    return seen


def may_have_executed(key: str, attempts: Iterable[AttemptFacts]) -> bool:
    """Until an answer proves otherwise, a key that was sent may have executed."""
    under = [a for a in attempts if a.key == key]
    if any(a.answer is Verdict.FAILED for a in under):
        return False
    return any(a.answer not in NOT_EXECUTED for a in under)


def open_keys(attempts: Iterable[AttemptFacts]) -> list[str]:
    listed = list(attempts)
    return [k for k in keys_in_order(listed) if may_have_executed(k, listed)]


def success_key(facts: Facts) -> str | None:
    """The key the recorded success was answered under, if a submit answer gave it."""
    if facts.outcome is not Outcome.SUCCEEDED:
        return None
    for attempt in facts.attempts:
        if attempt.answer is Verdict.SUCCEEDED and attempt.reference == facts.provider_reference:
            return attempt.key
    return None


def live_keys(attempts: Iterable[AttemptFacts], authorised: Iterable[str] = ()) -> int:
    """Keys that may still execute: sent and not proven final-and-not-executed,
    or authorised and not sent yet. Keys, never attempt numbers."""
    listed = list(attempts)
    sent = {a.key for a in listed}
    return len(open_keys(listed)) + len(set(authorised) - sent)


def last_sent_at(attempts: Iterable[AttemptFacts]) -> datetime | None:
    return max((a.sent_at for a in attempts if a.sent_at is not None), default=None)


def executions(state: State, outcome: Outcome | None, executed: frozenset[str]) -> int:
    """How many charges the books must count: every executed reference known, and
    at least one for an outcome known succeeded (a person may not name the charge)."""
    settled_success = state is State.OUTCOME_KNOWN and outcome == Outcome.SUCCEEDED
    return max(len(executed), 1 if settled_success else 0)


def recorded_executions(
    references: Iterable[str] | None, outcome: str | None, provider_reference: str | None
) -> frozenset[str]:
    """The executed references a record holds: its list, and a settled success's
    own reference (a batch settles without writing the list)."""
    known = set(references or ())
    if outcome == Outcome.SUCCEEDED and provider_reference:
        known.add(provider_reference)
    return frozenset(known)


@dataclass(frozen=True)
class Share:
    """An operation's part of its mandate's books."""

    reserved: int
    spent: int


def mandate_share(
    amount: int,
    state: State,
    outcome: Outcome | None,
    executed: frozenset[str],
    keys: int = 0,
    watched: bool = False,
) -> Share:
    """The provider's evidence is the truth for the books: every charge it showed
    is spent, whatever the ledger's outcome says. The rest is reserved once per
    key that may still execute while the operation is unresolved or watched
    (domain/watching.py: `held`); only the end of watching gives it back."""
    count = executions(state, outcome, executed)
    return Share(
        reserved=amount * (held(state, count, keys, watched) - count), spent=amount * count
    )


def room_after_a_new_key(free: int, before: Share, after: Share) -> int:
    """What stays free under a mandate's total limit once an operation's share
    grows from `before` to `after` with one more key held; negative: no room, and
    the new key is refused (nothing is sent)."""
    return free - ((after.reserved + after.spent) - (before.reserved + before.spent))


# -- the funnel ------------------------------------------------------------------------------


def judge(facts: Facts, evidence: Evidence, now: datetime, limits: Limits) -> Effect:
    """The one place evidence is weighed; see the module docstring."""
    # The attempts as this evidence leaves them, worked out once: the answer's
    # judgement and the live keys both read them.
    after = _attempts_after(facts, evidence)
    if isinstance(evidence, SubmitAnswer):
        effect = _judge_answer(facts, evidence, now, limits, after)
    elif isinstance(evidence, LookupResult):
        effect = _judge_lookup(facts, evidence, now, limits)
    elif isinstance(evidence, ProviderNotice):
        effect = _judge_notice(facts, evidence)
    else:
        effect = _judge_statement(facts, evidence)
    return _finish(facts, after, effect, now, limits)


def _finish(
    facts: Facts,
    after: tuple[AttemptFacts, ...],
    effect: Effect,
    now: datetime,
    limits: Limits,
) -> Effect:
    """Raise each flag once (a duplicate is two distinct executed references),
    time the verification look (backing off with each look already made, up to
    the cap), start watching with the first one, and count the live keys."""
    executed = facts.executed | effect.executed
    duplicate = len(executed) > 1 and not facts.duplicate_detected
    contradiction = effect.contradiction and not facts.outcome_contradicted
    verify_at = None
    watch = effect.watch
    if effect.verify:
        verify_at = now + recheck_delay(facts.audits + 1, limits.backoff, jitter=limits.jitter)
        if watch is None and facts.watch not in WATCHED:
            watch = Watch.WATCHING
    watch = watch if watch != facts.watch else None
    next_action = None
    if Watch.NOT_FINAL in (watch, facts.watch) and watch is not None:
        # Into provider_not_final, or out of it: a person, or only for a flag.
        next_action = settled_next_action(
            facts.duplicate_detected or duplicate,
            facts.outcome_contradicted or contradiction,
            watch,
        )
    # Every field kept but these, as `dataclasses.replace` would, at two
    # thirds of its CPU: every evidence of every operation passes here.
    return Effect(
        **{
            **effect.__dict__,
            "executed": executed,
            "duplicate": duplicate,
            "contradiction": contradiction,
            "verify_at": verify_at,
            "watch": watch,
            "next_action": next_action,
            "live_keys": live_keys(after, facts.authorised_keys),
        }
    )


def _attempts_after(facts: Facts, evidence: Evidence) -> tuple[AttemptFacts, ...]:
    """The attempts with what a submit answer proved about its own attempt."""
    if not isinstance(evidence, SubmitAnswer):
        return facts.attempts
    proved = evidence.verdict if evidence.verdict in PROVING else None
    # Made field by field: `dataclasses.replace` costs the hot path several times more.
    return tuple(
        AttemptFacts(a.number, a.key, proved or a.answer, evidence.reference, a.sent_at)
        if a.number == evidence.attempt
        else a
        for a in facts.attempts
    )


def _settled(facts: Facts) -> bool:
    return facts.state in FINAL


def _unresolved(facts: Facts) -> bool:
    return facts.state in UNRESOLVED


def _late(facts: Facts, reason: str) -> str:
    return reason if facts.state is State.SUBMITTING else f"late evidence: {reason}"


def _settle(
    facts: Facts,
    outcome: Outcome,
    reason: str,
    *,
    executed: frozenset[str] = frozenset(),
    adopt_reference: str | None = None,
    reconciliation_status: str | None = None,
) -> Effect:
    # More than one key used: a second execution is possible, so look for it.
    return Effect(
        Move.SETTLE,
        _late(facts, reason),
        outcome=outcome,
        executed=executed,
        adopt_reference=adopt_reference,
        reconciliation_status=reconciliation_status,
        verify=len(keys_in_order(facts.attempts)) > 1,
    )


def _judge_answer(
    facts: Facts,
    answer: SubmitAnswer,
    now: datetime,
    limits: Limits,
    after: tuple[AttemptFacts, ...],
) -> Effect:
    this = next((a for a in facts.attempts if a.number == answer.attempt), None)
    key = this.key if this is not None else None
    executed = frozenset(
        {answer.reference} if answer.verdict is Verdict.SUCCEEDED and answer.reference else ()
    )
    if _settled(facts):
        return _against_settled_answer(facts, answer, key, after, executed)
    if facts.state is State.ACCEPTED:
        # Only a refusal sends an operation back to ACCEPTED, and its answer
        # has been judged: whatever else arrives is recorded.
        return Effect(Move.RECORD, _late(facts, answer.reason), executed=executed)
    if answer.verdict is Verdict.SUCCEEDED:
        return _settle(
            facts,
            Outcome.SUCCEEDED,
            answer.reason,
            executed=executed,
            adopt_reference=answer.reference,
        )
    still_open = open_keys(after)
    if answer.verdict is Verdict.FAILED and not still_open:
        return _settle(facts, Outcome.FAILED, answer.reason)
    if answer.verdict is Verdict.NOT_EXECUTED and not still_open and _current(facts, answer):
        check_at, timing = _resend_at(answer, now, limits)
        return Effect(Move.REQUEUE, answer.reason, check_at=check_at, timing=timing)
    if answer.verdict is Verdict.MISCONFIGURED and not still_open and _current(facts, answer):
        # Not executed, but the same request would be refused again: a person
        # fixes the configuration and decides; nothing is sent meanwhile.
        return Effect(
            Move.OPERATOR,
            f"{answer.reason}: a configuration error, not resent until a person decides",
            rule="provider_refused_configuration",
        )
    reason = answer.reason
    if answer.verdict in PROVING and still_open:
        reason = f"{reason}; but key(s) {', '.join(still_open)} may have executed"
    return _unsettled_answer(facts, answer, reason, now, limits)


def _current(facts: Facts, answer: SubmitAnswer) -> bool:
    """The answer of the attempt the operation is SUBMITTING for (always the last)."""
    return (
        facts.state is State.SUBMITTING
        and bool(facts.attempts)
        and (facts.attempts[-1].number == answer.attempt)
    )


def _unsettled_answer(
    facts: Facts, answer: SubmitAnswer, reason: str, now: datetime, limits: Limits
) -> Effect:
    """An answer that settles nothing: the live call's leaves SUBMITTING for
    UNKNOWN; any other is late, and only recorded."""
    if _current(facts, answer):
        delay = recheck_delay(1, limits.backoff, jitter=limits.jitter)
        return Effect(Move.UNKNOWN, reason, check_at=next_check_at(now, answer.retry_after, delay))
    return Effect(Move.RECORD, _late(facts, f"{reason}; attempt {answer.attempt} is not in flight"))


def _resend_at(answer: SubmitAnswer, now: datetime, limits: Limits) -> tuple[datetime, str]:
    """When a refused attempt goes again, and why then: no earlier than the
    provider asked, and never sooner than a floor that doubles with each attempt
    (a `Retry-After: 0` or a provider refusing for ever cannot make a tight loop)."""
    guidance = answer.retry_after
    if guidance is None or guidance.at is None:
        delay = recheck_delay(answer.attempt, limits.backoff, jitter=limits.jitter)
        ignored = f" (Retry-After {guidance.raw!r} ignored: {guidance.problem})" if guidance else ""
        return now + delay, f"our backoff {delay} after attempt {answer.attempt}{ignored}"
    floor = recheck_delay(answer.attempt, RESEND_FLOOR, cap=DEFAULT_CEILING)
    timing = (
        f"the later of Retry-After {guidance.raw!r} ({guidance.at.isoformat()}) and the "
        f"resend floor {floor} after attempt {answer.attempt}"
    )
    return next_check_at(now, guidance, floor), timing


def _against_settled_answer(
    facts: Facts,
    answer: SubmitAnswer,
    key: str | None,
    after: tuple[AttemptFacts, ...],
    executed: frozenset[str],
) -> Effect:
    """A submit answer for an operation already settled (or cancelled)."""
    if answer.verdict is Verdict.SUCCEEDED:
        return _success_against_settled(facts, answer.reason, executed, answer.reference)
    if answer.verdict is Verdict.FAILED and facts.outcome is Outcome.SUCCEEDED:
        # A decline contradicts the success recorded for its own key; a success
        # no answer attributes to a key (a lookup's, a person's) is contradicted
        # once no key that was sent may have executed.
        settled_under = success_key(facts)
        if key == settled_under if settled_under is not None else not open_keys(after):
            return Effect(
                Move.RECORD,
                f"late evidence contradicts the recorded success: {answer.reason}",
                contradiction=True,
            )
    return Effect(Move.RECORD, f"late evidence, recorded only: {answer.reason}")


def _success_against_settled(
    facts: Facts, reason: str, executed: frozenset[str], reference: str | None
) -> Effect:
    if facts.state is State.CANCELLED or facts.outcome is not Outcome.SUCCEEDED:
        return Effect(
            Move.RECORD,
            f"late evidence of execution contradicts the recorded "
            f"{facts.outcome or facts.state}: {reason}",
            contradiction=True,
            executed=executed,
        )
    adopt = reference if facts.provider_reference is None and reference else None
    if adopt is not None:
        return Effect(
            Move.RECORD,
            f"late evidence names the charge of the recorded success: {reason}",
            executed=executed,
            adopt_reference=adopt,
        )
    return Effect(Move.RECORD, f"late evidence, recorded: {reason}", executed=executed)


def _judge_lookup(facts: Facts, lookup: LookupResult, now: datetime, limits: Limits) -> Effect:
    status = str(lookup.verdict)
    if _settled(facts):
        return _against_settled_lookup(facts, lookup, now)
    executed = lookup.executed
    reason = f"lookup evidence: {lookup.reason}"
    if facts.state is State.ACCEPTED:
        # Waiting to be sent again after a refusal: the resend, under the same
        # key, will hear the provider's answer; the execution is counted now.
        return Effect(Move.RECORD, _late(facts, reason), executed=executed)
    if executed:
        return _settle(
            facts,
            Outcome.SUCCEEDED,
            reason,
            executed=executed,
            adopt_reference=min(executed),
            reconciliation_status=status,
        )
    if lookup.verdict is LookupVerdict.FAILED:
        # Failed charges prove failure only if one key was ever used: a charge
        # under another key may not be listed yet.
        keys = keys_in_order(facts.attempts)
        if len(keys) <= 1:
            return _settle(facts, Outcome.FAILED, reason, reconciliation_status=status)
        reason = f"{reason}, but {len(keys)} provider keys were used: not conclusive"
        return _inconclusive(facts, LookupVerdict.NOT_FOUND, reason, lookup, now, limits)
    if lookup.verdict is LookupVerdict.NO_LOOKUP and facts.last_attempt_pending:
        # The provider has the request and said it is not final: a resend would
        # only hear that again. Its notification is awaited, on the backoff.
        reason = (
            f"{reason}; the last attempt was answered pending: awaiting the provider's "
            "notification, nothing is resent"
        )
        return _inconclusive(facts, lookup.verdict, reason, lookup, now, limits, waiting=True)
    return _inconclusive(facts, lookup.verdict, reason, lookup, now, limits)


# Lookups that wait and look again rather than count as "no evidence": the
# provider says not final yet, or its listing may not show the charge yet.
_WAITING = frozenset({LookupVerdict.PROCESSING, LookupVerdict.NOT_YET_VISIBLE})
_LOOK_AGAIN = _WAITING | {LookupVerdict.LOOKUP_FAILED}
# Looks that had no answer: they prove neither presence nor absence. (A
# provider without a lookup is not looked at again by a person's queue: a
# look there would ask nothing; its notifications still settle.)
_NO_ANSWER = frozenset({LookupVerdict.LOOKUP_FAILED, LookupVerdict.NO_LOOKUP})


def _inconclusive(
    facts: Facts,
    verdict: LookupVerdict,
    reason: str,
    lookup: LookupResult,
    now: datetime,
    limits: Limits,
    *,
    waiting: bool = False,
) -> Effect:
    """A check that found no outcome. "Still processing" (or a word the adapter
    does not know, or, at a provider without a lookup, a last answer that was
    pending: `waiting`) waits and looks again, but counts toward the same
    limits as any other check: past them a person is told while the checks go
    on."""
    status = str(verdict)
    checks = facts.checks + 1
    delay = recheck_delay(checks, limits.backoff, jitter=limits.jitter)
    check_at = next_check_at(now, lookup.retry_after, delay)
    if lookup.visible_at is not None:
        check_at = max(check_at, lookup.visible_at)
    if facts.state is State.MANUAL_REVIEW:
        if verdict in _LOOK_AGAIN:
            return Effect(Move.RECHECK, reason, check_at=check_at, reconciliation_status=status)
        return Effect(Move.RECORD, reason, reconciliation_status=status)
    if facts.state is not State.RECONCILIATION_DUE:
        return Effect(Move.RECORD, _late(facts, reason), reconciliation_status=status)
    if verdict not in _WAITING and not waiting:
        return Effect(Move.REVIEW, f"no evidence: {lookup.reason}", reconciliation_status=status)
    since = facts.unresolved_since or now
    if checks >= limits.max_checks or now - since >= limits.max_age:
        return Effect(
            Move.OPERATOR,
            f"still not final after {checks} checks over {now - since} (limits: "
            f"{limits.max_checks} checks, {limits.max_age}): {lookup.reason}; a person "
            "decides, and the checks go on",
            check_at=check_at,
            reconciliation_status=status,
        )
    how = {
        LookupVerdict.PROCESSING: "still processing",
        LookupVerdict.NOT_YET_VISIBLE: "not visible yet",
    }.get(verdict, "pending at the provider")
    return Effect(
        Move.UNKNOWN,
        f"{how}: {reason}" if waiting else f"{how}: {lookup.reason}",
        check_at=check_at,
        reconciliation_status=status,
    )


def _against_settled_lookup(facts: Facts, lookup: LookupResult, now: datetime) -> Effect:
    """A lookup of a settled operation: the audit, or a check that was in flight
    while the operation was settled some other way.

    A listing can lag, so a look that shows less than the ledger expects (no
    charge at all, or not the one it knows of) is followed by another, up to
    AUDIT_LOOKS. A person's word is checked this way too: a wrong "failed"
    meets the charge at a later look, a wrong "succeeded" its absence.

    A watched operation is looked at until the provider is quiet, whatever the
    budget (domain/watching.py): past AUDIT_LOOKS a person is told what is still
    open, and the looks go on."""
    effect = _flags_against_settled(facts, lookup)
    if facts.watch not in WATCHED and not lookup.audit:
        return effect
    look = Look(
        lookup.verdict not in _NO_ANSWER and lookup.complete,
        lookup.open,
        lookup.lag,
        facts.submit_in_flight,
    )
    still_open = not_quiet(look, last_sent_at(facts.attempts), lookup.looked_at or now)
    if still_open is None:
        return effect if effect.verify else replace(effect, watch=Watch.QUIET)
    looks = facts.audits + (1 if lookup.audit else 0)
    if looks < AUDIT_LOOKS or facts.watch is Watch.NOT_FINAL:
        return replace(effect, verify=True)  # a person, if any, was told once
    return replace(
        effect, verify=True, watch=Watch.NOT_FINAL, not_final=f"{still_open} after {looks} looks"
    )


def _flags_against_settled(facts: Facts, lookup: LookupResult) -> Effect:
    """What a look at a settled operation raises, and whether it showed less than
    the ledger expects (`verify`: look again, inside the budget)."""
    reason = f"lookup of a settled operation: {lookup.reason}"
    looks = facts.audits + (1 if lookup.audit else 0)
    look_again = looks < AUDIT_LOOKS
    succeeded = facts.state is State.OUTCOME_KNOWN and facts.outcome is Outcome.SUCCEEDED
    if lookup.executed:
        effect = _success_against_settled(facts, reason, lookup.executed, min(lookup.executed))
        known = facts.provider_reference
        if succeeded and known is not None and known not in lookup.executed:
            return replace(effect, verify=look_again)  # not even our charge shows yet
        return effect
    if succeeded and facts.provider_reference in lookup.failed:
        return Effect(
            Move.RECORD,
            f"the provider shows charge {facts.provider_reference} failed, the ledger "
            f"says succeeded: {lookup.reason}",
            contradiction=True,
        )
    if (
        succeeded
        and facts.provider_reference is None
        and lookup.verdict is LookupVerdict.FAILED
        and len(keys_in_order(facts.attempts)) <= 1
    ):
        return Effect(
            Move.RECORD,
            f"the provider shows only failed charges, the ledger says succeeded: {lookup.reason}",
            contradiction=True,
        )
    if look_again or lookup.verdict in _NO_ANSWER or not succeeded:
        return Effect(Move.RECORD, reason, verify=look_again)
    return Effect(
        Move.RECORD,
        f"the provider showed no executed charge in {looks} looks, the ledger says "
        f"succeeded: {lookup.reason}",
        contradiction=True,
    )


# What a notice's status must say to be final (the lookup's words).
_NOTICE_FAILED = frozenset({"failed", "canceled"})


def _judge_notice(facts: Facts, notice: ProviderNotice) -> Effect:
    """A provider's webhook about one object. It can settle an operation waiting
    anywhere unresolved (or still SUBMITTING: the webhook may beat the answer),
    raise a flag against a settled one, or be recorded; it never sends anything
    and never sends an operation to the safety review.

    A success names an execution, which always counts. A failure speaks for
    its object only: it settles a payment only if one key was ever sent (a
    charge under another key may exist), and contradicts a recorded success
    only if it names that success's own object."""
    reason = f"provider event: {notice.reason}"
    if notice.status == "succeeded":
        executed = frozenset({notice.reference})
        if _settled(facts):
            return _success_against_settled(facts, reason, executed, notice.reference)
        if facts.state is State.ACCEPTED:
            return Effect(Move.RECORD, _late(facts, reason), executed=executed)
        return _settle(
            facts, Outcome.SUCCEEDED, reason, executed=executed, adopt_reference=notice.reference
        )
    if notice.status not in _NOTICE_FAILED:
        # Not final: a settled operation is looked at again until it is quiet.
        return Effect(Move.RECORD, f"{reason} (not an outcome)", verify=_settled(facts))
    one_key = len(keys_in_order(facts.attempts)) <= 1
    if _settled(facts):
        succeeded = facts.state is State.OUTCOME_KNOWN and facts.outcome is Outcome.SUCCEEDED
        # Its own object failed, or (as a lookup's only failed charges do) the
        # only key's object failed under a success nobody named.
        names_our_success = succeeded and (
            facts.provider_reference == notice.reference
            or (facts.provider_reference is None and one_key and not facts.executed)
        )
        if names_our_success:
            return Effect(
                Move.RECORD,
                f"the provider says {notice.reference} {notice.status}, the ledger says "
                f"succeeded: {reason}",
                contradiction=True,
            )
        return Effect(Move.RECORD, f"late evidence, recorded only: {reason}")
    # Any execution known (of this object or another) outweighs one object's failure.
    if facts.state is State.ACCEPTED or not one_key or facts.executed:
        return Effect(Move.RECORD, _late(facts, f"{reason}; not conclusive for the operation"))
    return _settle(facts, Outcome.FAILED, reason)


def _judge_statement(facts: Facts, statement: OperatorStatement) -> Effect:
    """A person's resolution settles an unresolved operation; the provider is then
    asked once more (the audit), so a wrong statement meets the provider's truth."""
    reason = f"resolved by {statement.by}: {statement.evidence}"
    if _settled(facts) and facts.outcome_contradicted:
        # The provider's evidence stays counted in the books whatever is stated:
        # a person can say which outcome stands, not undo what the provider showed.
        # Succeeded with no charge named: the one execution the provider showed
        # is the charge (so it can be refunded); with several, a person names it.
        only = next(iter(facts.executed)) if len(facts.executed) == 1 else None
        adopt = statement.reference or only if statement.outcome is Outcome.SUCCEEDED else None
        return Effect(
            Move.RESOLVE_CONTRADICTION,
            f"contradiction resolved by {statement.by} as {statement.outcome.value}: "
            f"{statement.evidence}",
            outcome=statement.outcome,
            adopt_reference=adopt if facts.provider_reference is None else None,
        )
    if not _unresolved(facts):
        return Effect(Move.RECORD, f"statement about a {facts.state} operation: {reason}")
    executed = frozenset({statement.reference}) if statement.reference else frozenset()
    if statement.outcome is Outcome.SUCCEEDED:
        return Effect(
            Move.SETTLE,
            reason,
            outcome=Outcome.SUCCEEDED,
            executed=executed,
            adopt_reference=statement.reference,
            verify=True,
        )
    return Effect(Move.SETTLE, reason, outcome=Outcome.FAILED, verify=True)


__all__ = [
    "AUDIT_LOOKS",
    "AttemptFacts",
    "Effect",
    "EventDisposition",
    "Evidence",
    "Facts",
    "Limits",
    "LookupResult",
    "Move",
    "NamedOperation",
    "OperatorStatement",
    "ProviderNotice",
    "Share",
    "SubmitAnswer",
    "event_disposition",
    "flag_reason",
    "judge",
    "last_sent_at",
    "live_keys",
    "mandate_share",
    "may_have_executed",
    "open_keys",
    "recorded_executions",
    "room_after_a_new_key",
]
