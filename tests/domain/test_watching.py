"""When watching ends (domain/watching.py through the funnel): the holes a
hostile review found in the first cut, each a look that must not count as quiet."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from intentledger.domain.evidence import (
    AUDIT_LOOKS,
    AttemptFacts,
    Facts,
    Limits,
    LookupResult,
    ProviderNotice,
    judge,
)
from intentledger.domain.states import Outcome, State
from intentledger.domain.transport import (
    ChargeSeen,
    LookupAnswer,
    LookupVerdict,
    ProviderAnswer,
    Transport,
    judge_lookup,
)
from intentledger.domain.watching import Watch

NOW = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)
LIMITS = Limits(timedelta(seconds=30))
# A person said "failed"; two keys were sent; every look so far is spent.
SAID_FAILED = Facts(
    State.OUTCOME_KNOWN,
    Outcome.FAILED,
    attempts=(
        AttemptFacts(1, "op:1", sent_at=NOW - timedelta(hours=1)),
        AttemptFacts(2, "op:2", sent_at=NOW - timedelta(hours=1)),
    ),
    audits=AUDIT_LOOKS - 1,
    watch=Watch.WATCHING,
)
QUIET_LOOK = LookupResult(
    LookupVerdict.FAILED, "pi_1 failed", failed=frozenset({"pi_1"}), audit=True
)


def test_a_quiet_look_after_the_budget_ends_watching() -> None:
    assert judge(SAID_FAILED, QUIET_LOOK, NOW, LIMITS).watch is Watch.QUIET


def test_a_lookup_that_did_not_cover_everything_is_not_quiet() -> None:
    incomplete = replace(QUIET_LOOK, complete=False)
    effect = judge(SAID_FAILED, incomplete, NOW, LIMITS)
    assert effect.watch is Watch.NOT_FINAL and effect.verify
    assert "no complete answer" in str(effect.not_final)


def test_a_look_while_a_submit_is_in_flight_is_not_quiet() -> None:
    in_flight = replace(SAID_FAILED, submit_in_flight=True)
    effect = judge(in_flight, QUIET_LOOK, NOW, LIMITS)
    assert effect.watch is Watch.NOT_FINAL and "in flight" in str(effect.not_final)


def test_a_look_is_as_late_as_its_start() -> None:
    lagging = replace(QUIET_LOOK, lag=timedelta(minutes=2))
    sent = NOW - timedelta(minutes=3)
    facts = replace(SAID_FAILED, attempts=(AttemptFacts(1, "op:1", sent_at=sent),))
    assert judge(facts, lagging, NOW, LIMITS).watch is Watch.QUIET
    started_inside = replace(lagging, looked_at=sent + timedelta(minutes=1))
    assert judge(facts, started_inside, NOW, LIMITS).watch is Watch.NOT_FINAL


def test_a_person_is_told_once_and_the_looks_go_on() -> None:
    told = replace(SAID_FAILED, watch=Watch.NOT_FINAL, audits=20)
    open_look = LookupResult(
        LookupVerdict.PROCESSING, "pi_2 processing", open=frozenset({"pi_2"}), audit=True
    )
    effect = judge(told, open_look, NOW, LIMITS)
    assert effect.verify and effect.not_final is None and effect.watch is None


def test_an_object_waiting_on_someone_is_open_whatever_it_maps_to() -> None:
    answer = ProviderAnswer(Transport.RESPONSE, status=200)
    seen = judge_lookup(
        LookupAnswer(answer, (ChargeSeen("pi_1", "failed", raw_status="requires_action"),))
    )
    assert seen.verdict is LookupVerdict.FAILED and seen.open == {"pi_1"}


def test_a_webhook_that_an_object_is_not_final_looks_at_a_settled_operation_again() -> None:
    quiet = replace(SAID_FAILED, watch=Watch.QUIET)
    effect = judge(quiet, ProviderNotice("processing", "pi_2", "pi_2 processing"), NOW, LIMITS)
    assert effect.verify and effect.watch is Watch.WATCHING
