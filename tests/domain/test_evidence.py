"""The evidence funnel, property-tested directly: what any evidence may and may not do."""

from __future__ import annotations

from dataclasses import fields, replace
from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from intentledger.domain.evidence import (
    AUDIT_LOOKS,
    AttemptFacts,
    Effect,
    Facts,
    Limits,
    LookupResult,
    Move,
    NamedOperation,
    OperatorStatement,
    ProviderNotice,
    SubmitAnswer,
    event_disposition,
    flag_reason,
    judge,
    mandate_share,
    may_have_executed,
    open_keys,
)
from intentledger.domain.retry_after import RetryAfter
from intentledger.domain.states import FINAL, UNRESOLVED, Outcome, State
from intentledger.domain.transport import (
    ChargeSeen,
    LookupAnswer,
    LookupVerdict,
    ProviderAnswer,
    Transport,
    Verdict,
    judge_lookup,
)

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
LIMITS = Limits(timedelta(seconds=30), max_checks=10, max_age=timedelta(days=7))
REFS = st.sampled_from(["ch_1", "ch_2", "ch_3"])
KEYS = st.sampled_from(["op:1", "op:2", "op:3"])


@st.composite
def facts(draw: st.DrawFn) -> Facts:
    state = draw(st.sampled_from(list(State)))
    attempts = []
    if state is not State.ACCEPTED or draw(st.booleans()):
        count = draw(st.integers(min_value=1 if state is not State.ACCEPTED else 0, max_value=4))
        for number in range(1, count + 1):
            answer = draw(
                st.sampled_from([None, Verdict.SUCCEEDED, Verdict.FAILED, Verdict.NOT_EXECUTED])
            )
            reference = draw(REFS) if answer is Verdict.SUCCEEDED else None
            attempts.append(AttemptFacts(number, draw(KEYS), answer, reference))
    outcome = draw(st.sampled_from(list(Outcome))) if state is State.OUTCOME_KNOWN else None
    executed = frozenset(draw(st.sets(REFS, max_size=2)))
    if state in UNRESOLVED or state in (State.ACCEPTED, State.SUBMITTING):
        executed = frozenset()  # executed evidence settles an unresolved operation at once
    reference = draw(st.one_of(st.none(), REFS)) if outcome is Outcome.SUCCEEDED else None
    if reference is not None:
        executed |= {reference}
    return Facts(
        state=state,
        outcome=outcome,
        provider_reference=reference,
        attempts=tuple(attempts),
        executed=executed,
        checks=draw(st.integers(min_value=0, max_value=12)),
        audits=draw(st.integers(min_value=0, max_value=AUDIT_LOOKS)),
        unresolved_since=NOW - draw(st.sampled_from([timedelta(0), timedelta(days=8)])),
        duplicate_detected=len(executed) > 1,
        outcome_contradicted=draw(st.booleans()) if state in FINAL else False,
    )


def answers(attempts: int) -> st.SearchStrategy[SubmitAnswer]:
    return st.builds(
        SubmitAnswer,
        attempt=st.integers(min_value=1, max_value=max(1, attempts)),
        verdict=st.sampled_from(list(Verdict)),
        reason=st.just("an answer"),
        reference=st.one_of(st.none(), REFS),
        retry_after=st.one_of(
            st.none(),
            st.sampled_from([0, 1, 30]).map(
                lambda s: RetryAfter(str(s), NOW + timedelta(seconds=s), None)
            ),
        ),
    )


lookups = st.builds(
    LookupResult,
    verdict=st.sampled_from(list(LookupVerdict)),
    reason=st.just("a lookup"),
    executed=st.frozensets(REFS, max_size=2),
    failed=st.frozensets(REFS, max_size=1),
    audit=st.booleans(),
).map(
    lambda lookup: replace(
        lookup,
        executed=lookup.executed if lookup.verdict is LookupVerdict.SUCCEEDED else frozenset(),
        failed=lookup.failed - lookup.executed,
    )
)
statements = st.builds(
    OperatorStatement,
    outcome=st.sampled_from(list(Outcome)),
    by=st.just("olive"),
    evidence=st.just("checked the dashboard"),
    reference=st.one_of(st.none(), REFS),
)


@st.composite
def cases(draw: st.DrawFn) -> tuple[Facts, SubmitAnswer | LookupResult | OperatorStatement]:
    known = draw(facts())
    evidence = draw(st.one_of(answers(len(known.attempts)), lookups, statements))
    return known, evidence


def executed_by(evidence: object) -> frozenset[str]:
    if isinstance(evidence, SubmitAnswer) and evidence.verdict is Verdict.SUCCEEDED:
        return frozenset({evidence.reference} if evidence.reference else ())
    if isinstance(evidence, LookupResult):
        return evidence.executed
    if isinstance(evidence, OperatorStatement) and evidence.outcome is Outcome.SUCCEEDED:
        return frozenset({evidence.reference} if evidence.reference else ())
    return frozenset()


def after(known: Facts, effect: Effect) -> Facts:
    """The facts once `effect` is carried out (as engine/evidence.py writes it)."""
    state = {
        Move.SETTLE: State.OUTCOME_KNOWN,
        Move.UNKNOWN: State.UNKNOWN,
        Move.REQUEUE: State.ACCEPTED,
        Move.OPERATOR: State.MANUAL_REVIEW,
    }.get(effect.move, known.state)
    return replace(
        known,
        state=state,
        outcome=effect.outcome or known.outcome,
        provider_reference=known.provider_reference or effect.adopt_reference,
        executed=effect.executed,
        duplicate_detected=known.duplicate_detected or effect.duplicate,
        outcome_contradicted=known.outcome_contradicted or effect.contradiction,
    )


@settings(max_examples=2000, deadline=None, derandomize=True, database=None)
@given(cases())
def test_what_evidence_may_do(case: tuple[Facts, object]) -> None:
    known, evidence = case
    effect = judge(known, evidence, NOW, LIMITS)  # type: ignore[arg-type]
    seen = executed_by(evidence)
    if isinstance(evidence, OperatorStatement) and known.state not in UNRESOLVED:
        seen = frozenset()  # a person may resolve only what is unresolved (engine refuses)

    # Every execution any evidence showed is counted, and never forgotten.
    assert effect.executed == known.executed | seen
    # Duplicates are counted, not guessed: two distinct executed references.
    assert effect.duplicate == (len(effect.executed) > 1 and not known.duplicate_detected)
    # Evidence never authorises a resubmission: only proof of non-execution of
    # the live attempt sends an operation back to ACCEPTED (with the same key).
    if effect.move is Move.REQUEUE:
        assert isinstance(evidence, SubmitAnswer) and evidence.verdict is Verdict.NOT_EXECUTED
        assert known.state is State.SUBMITTING and known.attempts[-1].number == evidence.attempt
        assert effect.check_at is not None and effect.check_at >= NOW + timedelta(seconds=1)
    # Nothing leaves a final state, and the transition table is respected. Only
    # a person's statement on a contradicted operation changes anything there:
    # which outcome stands (the state stays, the flag comes down).
    if known.state in FINAL:
        if isinstance(evidence, OperatorStatement) and known.outcome_contradicted:
            assert effect.move is Move.RESOLVE_CONTRADICTION
            assert effect.outcome is evidence.outcome and not effect.contradiction
        else:
            assert effect.move is Move.RECORD
    if effect.move is Move.RESOLVE_CONTRADICTION:
        assert known.state in FINAL and known.outcome_contradicted
    # Evidence of execution settles an unresolved operation as succeeded ...
    if known.state in UNRESOLVED and seen and not isinstance(evidence, OperatorStatement):
        assert (effect.move, effect.outcome) == (Move.SETTLE, Outcome.SUCCEEDED)
    # ... and contradicts a settled failure or a cancellation, from any source.
    if (
        seen
        and (known.state is State.CANCELLED or known.outcome is Outcome.FAILED)
        and not known.outcome_contradicted
    ):
        assert effect.contradiction
    # A failure is never settled while a key that was sent may have executed.
    if effect.move is Move.SETTLE and effect.outcome is Outcome.FAILED:
        if isinstance(evidence, SubmitAnswer):
            rest = [a for a in known.attempts if a.number != evidence.attempt]
            this = [a for a in known.attempts if a.number == evidence.attempt]
            proved = [replace(a, answer=Verdict.FAILED) for a in this]
            assert not open_keys([*rest, *proved])
        if isinstance(evidence, LookupResult):
            assert len({a.key for a in known.attempts}) <= 1
    # Flags are raised once.
    if known.outcome_contradicted:
        assert not effect.contradiction
    # Leaving SUBMITTING for UNKNOWN, a live call's answer always has a next check;
    # a refusal only a person can fix (our configuration) has nothing to check.
    if effect.move is Move.OPERATOR and effect.rule == "provider_refused_configuration":
        assert effect.check_at is None
        assert isinstance(evidence, SubmitAnswer) and evidence.verdict is Verdict.MISCONFIGURED
    elif effect.move in (Move.UNKNOWN, Move.REQUEUE, Move.OPERATOR, Move.RECHECK):
        assert effect.check_at is not None and effect.check_at > NOW


@settings(max_examples=2000, deadline=None, derandomize=True, database=None)
@given(cases())
def test_evidence_twice_changes_nothing_more(case: tuple[Facts, object]) -> None:
    """A redelivered answer, a repeated lookup: the second raises no flag and
    moves no money."""
    known, evidence = case
    first = judge(known, evidence, NOW, LIMITS)  # type: ignore[arg-type]
    if first.move is not Move.RECORD:
        return  # the state moved on: the second is judged against a new state
    settled = after(known, first)
    second = judge(settled, evidence, NOW, LIMITS)  # type: ignore[arg-type]
    assert not second.duplicate and not second.contradiction
    assert second.executed == first.executed
    share = mandate_share(100, settled.state, settled.outcome, settled.executed)
    again = mandate_share(100, after(settled, second).state, settled.outcome, second.executed)
    assert share == again


@settings(max_examples=1000, deadline=None, derandomize=True, database=None)
@given(
    state=st.sampled_from(list(State)),
    outcome=st.one_of(st.none(), st.sampled_from(list(Outcome))),
    executed=st.frozensets(REFS, max_size=3),
)
def test_the_books_cover_every_known_charge(
    state: State, outcome: Outcome | None, executed: frozenset[str]
) -> None:
    share = mandate_share(250, state, outcome, executed)
    assert share.spent >= 250 * len(executed)
    if state not in FINAL:
        assert share.reserved + share.spent >= 250  # held while the outcome is unknown
    if state is State.OUTCOME_KNOWN and outcome is Outcome.SUCCEEDED:
        assert share.spent >= 250


def test_a_key_may_have_executed_until_an_answer_proves_otherwise() -> None:
    lost = AttemptFacts(1, "k1")
    refused_replay = AttemptFacts(2, "k1", Verdict.NOT_EXECUTED)
    assert may_have_executed("k1", [lost, refused_replay])
    assert not may_have_executed("k1", [replace(lost, answer=Verdict.NOT_EXECUTED)])
    assert not may_have_executed("k1", [lost, AttemptFacts(2, "k1", Verdict.FAILED)])


def test_retry_after_zero_is_floored_and_doubles_with_each_attempt() -> None:
    zero = RetryAfter("0", NOW, None)
    dues = []
    for number in (1, 2, 3):
        attempts = tuple(AttemptFacts(n, "op:1", Verdict.NOT_EXECUTED) for n in range(1, number))
        known = Facts(State.SUBMITTING, attempts=(*attempts, AttemptFacts(number, "op:1")))
        answer = SubmitAnswer(number, Verdict.NOT_EXECUTED, "429", retry_after=zero)
        effect = judge(known, answer, NOW, LIMITS)
        assert effect.move is Move.REQUEUE and effect.check_at is not None
        dues.append(effect.check_at - NOW)
    assert dues == [timedelta(seconds=1), timedelta(seconds=2), timedelta(seconds=4)]


def test_a_provider_retry_after_beyond_the_floor_is_honoured() -> None:
    known = Facts(State.SUBMITTING, attempts=(AttemptFacts(1, "op:1"),))
    later = RetryAfter("120", NOW + timedelta(seconds=120), None)
    effect = judge(
        known, SubmitAnswer(1, Verdict.NOT_EXECUTED, "429", retry_after=later), NOW, LIMITS
    )
    assert effect.check_at == NOW + timedelta(seconds=120)


def test_processing_past_the_limits_goes_to_a_person_and_keeps_checking() -> None:
    known = Facts(
        State.RECONCILIATION_DUE,
        attempts=(AttemptFacts(1, "op:1"),),
        checks=9,
        unresolved_since=NOW - timedelta(hours=1),
    )
    lookup = LookupResult(LookupVerdict.PROCESSING, "charge pi_1 is 'requires_action'")
    effect = judge(known, lookup, NOW, LIMITS)
    assert effect.move is Move.OPERATOR and effect.check_at is not None
    assert judge(replace(known, checks=3), lookup, NOW, LIMITS).move is Move.UNKNOWN
    aged = replace(known, checks=1, unresolved_since=NOW - timedelta(days=8))
    assert judge(aged, lookup, NOW, LIMITS).move is Move.OPERATOR
    in_review = replace(known, state=State.MANUAL_REVIEW)
    assert judge(in_review, lookup, NOW, LIMITS).move is Move.RECHECK


def test_a_late_success_names_the_charge_a_person_did_not() -> None:
    known = Facts(State.OUTCOME_KNOWN, Outcome.SUCCEEDED, None, attempts=(AttemptFacts(1, "op:1"),))
    effect = judge(known, SubmitAnswer(1, Verdict.SUCCEEDED, "200", "ch_9"), NOW, LIMITS)
    assert effect.adopt_reference == "ch_9" and not effect.duplicate
    assert not effect.contradiction


def test_a_decline_contradicts_only_the_success_of_its_own_key() -> None:
    attempts = (
        AttemptFacts(1, "op:1", Verdict.SUCCEEDED, "ch_1"),
        AttemptFacts(2, "op:2"),
    )
    known = Facts(State.OUTCOME_KNOWN, Outcome.SUCCEEDED, "ch_1", attempts, frozenset({"ch_1"}))
    other_key = judge(known, SubmitAnswer(2, Verdict.FAILED, "402"), NOW, LIMITS)
    assert not other_key.contradiction
    same_key = judge(known, SubmitAnswer(1, Verdict.FAILED, "402"), NOW, LIMITS)
    assert same_key.contradiction


# -- the adapters' verdicts and an eventually consistent lookup (issue 14) ---------------------

SUBMITTING_ONE_KEY = Facts(
    state=State.SUBMITTING, attempts=(AttemptFacts(1, "op:1"),), unresolved_since=NOW
)


def test_a_refusal_of_our_credentials_goes_to_a_person_and_nothing_is_resent() -> None:
    answer = SubmitAnswer(1, Verdict.MISCONFIGURED, "Stripe answered 401")
    effect = judge(SUBMITTING_ONE_KEY, answer, NOW, LIMITS)
    assert effect.move is Move.OPERATOR and effect.rule == "provider_refused_configuration"
    assert effect.check_at is None  # nothing to check: it was not executed
    # ...and it proves non-execution of its key, like a 429.
    assert not may_have_executed("op:1", (AttemptFacts(1, "op:1", Verdict.MISCONFIGURED),))


def test_a_refusal_of_our_credentials_while_another_key_may_have_executed_is_unknown() -> None:
    facts = replace(SUBMITTING_ONE_KEY, attempts=(AttemptFacts(1, "op:1"), AttemptFacts(2, "op:2")))
    effect = judge(facts, SubmitAnswer(2, Verdict.MISCONFIGURED, "401"), NOW, LIMITS)
    assert effect.move is Move.UNKNOWN and "op:1" in effect.reason


def test_pending_and_key_conflict_prove_nothing() -> None:
    for verdict in (Verdict.PENDING, Verdict.KEY_CONFLICT):
        effect = judge(SUBMITTING_ONE_KEY, SubmitAnswer(1, verdict, "said"), NOW, LIMITS)
        assert effect.move is Move.UNKNOWN and effect.check_at is not None
        assert may_have_executed("op:1", (AttemptFacts(1, "op:1", None),))


def test_not_yet_visible_waits_for_the_window_and_is_never_a_review() -> None:
    visible_at = NOW + timedelta(minutes=1)
    due = Facts(
        state=State.RECONCILIATION_DUE, attempts=(AttemptFacts(1, "op:1"),), unresolved_since=NOW
    )
    lookup = LookupResult(LookupVerdict.NOT_YET_VISIBLE, "search lag", visible_at=visible_at)
    effect = judge(due, lookup, NOW, LIMITS)
    assert effect.move is Move.UNKNOWN and effect.check_at is not None
    assert effect.check_at >= visible_at
    in_review = replace(due, state=State.MANUAL_REVIEW)
    assert judge(in_review, lookup, NOW, LIMITS).move is Move.RECHECK
    # The same absence past the window is a not-found: the safety review's question.
    past = LookupResult(LookupVerdict.NOT_FOUND, "nothing")
    assert judge(due, past, NOW, LIMITS).move is Move.REVIEW


@given(sent_ago=st.integers(0, 600), lag=st.integers(0, 300))
def test_an_absence_inside_the_lag_of_the_last_attempt_is_inconclusive(
    sent_ago: int, lag: int
) -> None:
    ok = ProviderAnswer(Transport.RESPONSE, status=200)
    sent = NOW - timedelta(seconds=sent_ago)
    empty = LookupAnswer(ok, lag=timedelta(seconds=lag), method="search")
    got = judge_lookup(empty, sent, NOW)
    expected = LookupVerdict.NOT_YET_VISIBLE if sent_ago < lag else LookupVerdict.NOT_FOUND
    assert got.verdict is expected
    if expected is LookupVerdict.NOT_YET_VISIBLE:
        assert got.visible_at == sent + timedelta(seconds=lag)
    # A strongly consistent lookup's absence is an absence at once...
    assert judge_lookup(LookupAnswer(ok), sent, NOW).verdict is LookupVerdict.NOT_FOUND
    # ...one that did not look everywhere proves none...
    partial = LookupAnswer(ok, complete=False)
    assert judge_lookup(partial, sent, NOW).verdict is LookupVerdict.LOOKUP_FAILED
    # ...and what is found is found, lag or not.
    found = replace(empty, charges=(ChargeSeen("pi_1", "succeeded", "succeeded"),))
    assert judge_lookup(found, sent, NOW).verdict is LookupVerdict.SUCCEEDED


# -- provider webhooks (issue 15) -----------------------------------------------------------------

NOTICE_WORDS = st.sampled_from(["succeeded", "failed", "canceled", "processing", "unmapped:x"])


@settings(max_examples=300)
@given(facts=facts(), status=NOTICE_WORDS, reference=REFS)
def test_a_provider_event_settles_or_records_and_never_sends_anything(
    facts: Facts, status: str, reference: str
) -> None:
    effect = judge(facts, ProviderNotice(status, reference, "an event"), NOW, LIMITS)
    assert effect.move in (Move.SETTLE, Move.RECORD)
    if effect.move is Move.SETTLE:
        assert facts.state not in FINAL and facts.state is not State.ACCEPTED
        assert status in ("succeeded", "failed", "canceled")
    if status == "succeeded":
        assert reference in effect.executed  # an execution always counts
    if status in ("processing", "unmapped:x"):
        assert effect.move is Move.RECORD and not effect.contradiction


def test_a_success_event_settles_every_unresolved_state() -> None:
    for state in (*UNRESOLVED, State.SUBMITTING):
        facts = Facts(state=state, attempts=(AttemptFacts(1, "op:1"),), unresolved_since=NOW)
        effect = judge(facts, ProviderNotice("succeeded", "pi_1", "evt"), NOW, LIMITS)
        assert (effect.move, effect.outcome, effect.adopt_reference) == (
            Move.SETTLE,
            Outcome.SUCCEEDED,
            "pi_1",
        ), state


def test_a_success_event_after_a_persons_failed_is_a_contradiction() -> None:
    facts = Facts(
        state=State.OUTCOME_KNOWN,
        outcome=Outcome.FAILED,
        attempts=(AttemptFacts(1, "op:1"),),
    )
    effect = judge(facts, ProviderNotice("succeeded", "pi_1", "evt"), NOW, LIMITS)
    assert effect.move is Move.RECORD and effect.contradiction
    assert effect.executed == {"pi_1"}  # counted: the books follow the provider


def test_a_failure_event_speaks_for_its_object_only() -> None:
    one = Facts(state=State.UNKNOWN, attempts=(AttemptFacts(1, "op:1"),), unresolved_since=NOW)
    settled = judge(one, ProviderNotice("failed", "pi_1", "evt"), NOW, LIMITS)
    assert (settled.move, settled.outcome) == (Move.SETTLE, Outcome.FAILED)
    two = replace(one, attempts=(AttemptFacts(1, "op:1"), AttemptFacts(2, "op:2")))
    assert judge(two, ProviderNotice("failed", "pi_1", "evt"), NOW, LIMITS).move is Move.RECORD
    ours = Facts(
        state=State.OUTCOME_KNOWN,
        outcome=Outcome.SUCCEEDED,
        provider_reference="pi_1",
        executed=frozenset({"pi_1"}),
        attempts=(AttemptFacts(1, "op:1", Verdict.SUCCEEDED, "pi_1"),),
    )
    assert judge(ours, ProviderNotice("failed", "pi_1", "evt"), NOW, LIMITS).contradiction
    other = judge(ours, ProviderNotice("canceled", "pi_9", "evt"), NOW, LIMITS)
    assert other.move is Move.RECORD and not other.contradiction


def test_a_second_success_event_for_another_object_is_a_duplicate() -> None:
    ours = Facts(
        state=State.OUTCOME_KNOWN,
        outcome=Outcome.SUCCEEDED,
        provider_reference="pi_1",
        executed=frozenset({"pi_1"}),
        attempts=(AttemptFacts(1, "op:1", Verdict.SUCCEEDED, "pi_1"),),
    )
    effect = judge(ours, ProviderNotice("succeeded", "pi_2", "evt"), NOW, LIMITS)
    assert effect.duplicate and effect.executed == {"pi_1", "pi_2"}
    again = judge(ours, ProviderNotice("succeeded", "pi_1", "evt"), NOW, LIMITS)
    assert not again.duplicate and not again.contradiction


def test_a_failure_event_never_settles_failed_over_a_known_execution() -> None:
    known = Facts(
        state=State.UNKNOWN,
        attempts=(AttemptFacts(1, "op:1"),),
        executed=frozenset({"pi_1"}),
        unresolved_since=NOW,
    )
    effect = judge(known, ProviderNotice("failed", "pi_2", "evt"), NOW, LIMITS)
    assert effect.move is Move.RECORD


def test_a_failure_event_contradicts_an_unnamed_success_on_the_only_key() -> None:
    said = Facts(
        state=State.OUTCOME_KNOWN,
        outcome=Outcome.SUCCEEDED,
        attempts=(AttemptFacts(1, "op:1"),),
    )
    assert judge(said, ProviderNotice("failed", "pi_1", "evt"), NOW, LIMITS).contradiction
    two_keys = replace(said, attempts=(AttemptFacts(1, "op:1"), AttemptFacts(2, "op:2")))
    assert not judge(two_keys, ProviderNotice("failed", "pi_1", "evt"), NOW, LIMITS).contradiction


# -- a provider event's disposition on arrival (issue 37) ------------------------------------------

PAYMENT = NamedOperation("payment", 1000, "EUR")


def disposition(
    *,
    object_id: str | None = "pi_1",
    status: str | None = "succeeded",
    needs_person: bool = False,
    object_kind: str | None = "payment",
    amount: tuple[int, str] | None = (1000, "EUR"),
    operation: NamedOperation | None = PAYMENT,
) -> str:
    """The disposition of a charge's success for its own payment, but for what is given."""
    return event_disposition(
        object_id=object_id,
        status=status,
        needs_person=needs_person,
        object_kind=object_kind,
        amount=amount,
        operation=operation,
    )


def test_an_event_for_its_own_operation_and_amount_is_recorded_for_judging() -> None:
    assert disposition() == "recorded"
    assert disposition(amount=None) == "recorded"  # it names no amount: nothing differs
    assert disposition(amount=(1000, "eur")) == "recorded"  # a currency in either case
    assert disposition(operation=NamedOperation("payment", None, None)) == "recorded"


def test_an_event_the_adapter_does_not_read_is_unmapped_whatever_it_names() -> None:
    assert disposition(status=None) == "unmapped_type"
    assert disposition(object_id=None) == "unmapped_type"
    assert disposition(object_id="") == "unmapped_type"
    assert disposition(status=None, operation=None) == "unmapped_type"
    # An object's id is still needed for a person to see it.
    assert disposition(object_id=None, status=None, needs_person=True) == "unmapped_type"


def test_an_event_naming_no_operation_of_ours_is_an_unknown_reference() -> None:
    assert disposition(operation=None) == "unknown_reference"
    assert disposition(operation=None, needs_person=True, status=None) == "unknown_reference"


def test_an_event_about_another_kind_of_object_is_the_wrong_kind() -> None:
    assert disposition(object_kind="refund") == "wrong_kind"
    assert disposition(object_kind=None) == "wrong_kind"  # no declared kind speaks for none
    refund = NamedOperation("refund", 1000, "EUR")
    assert disposition(operation=refund) == "wrong_kind"
    assert disposition(object_kind="card", operation=NamedOperation("card_freeze", None, None)) == (
        "recorded"
    )
    # The kind is weighed before a person is called: a refund's chargeback is not ours.
    assert disposition(operation=refund, needs_person=True, status=None) == "wrong_kind"


def test_an_event_a_person_must_see_or_for_another_amount_is_flagged() -> None:
    assert disposition(needs_person=True, status=None) == "flagged"
    assert disposition(needs_person=True) == "flagged"
    assert disposition(amount=(1, "EUR")) == "flagged"
    assert disposition(amount=(1000, "USD")) == "flagged"
    assert disposition(status="failed", amount=(999, "EUR")) == "flagged"


def test_a_flag_says_why_a_person_must_see_the_event() -> None:
    another = flag_reason(
        event_type="AUTHORISATION", status="succeeded", amount=(1, "EUR"), operation=PAYMENT
    )
    assert another == (
        "succeeded for another amount: it names 1 EUR, the operation is for 1000 EUR"
    )
    # Without a status, the event's type says what it was.
    unread = flag_reason(event_type="CAPTURE", status=None, amount=(5, "EUR"), operation=PAYMENT)
    assert unread.startswith("CAPTURE for another amount: it names 5 EUR")
    chargeback = flag_reason(
        event_type="CHARGEBACK", status=None, amount=(1000, "EUR"), operation=PAYMENT
    )
    assert chargeback == "CHARGEBACK: the provider moved money outside our writes"


def test_an_effect_is_made_again_from_its_fields_alone() -> None:
    """`judge` finishes an effect by making it again from its `__dict__`
    (cheaper than `dataclasses.replace`): that holds only while every field
    is set by `__init__` and kept in the instance's `__dict__`."""
    assert not hasattr(Effect, "__slots__")
    assert all(f.init for f in fields(Effect))
    effect = Effect(Move.SETTLE, "r", verify=True, rule="x", not_final="y")
    assert Effect(**effect.__dict__) == effect
    assert set(effect.__dict__) == {f.name for f in fields(Effect)}
