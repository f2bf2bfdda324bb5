"""A payment's refundable amount: taken while unknown, given back only by a known failure."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from intentledger.domain.refunds import (
    DuplicateProblem,
    RefundAsk,
    RefundProblem,
    RefundTotals,
    RefundView,
    ask_refund,
    captured_by_charge,
    duplicate_problem,
    duplicates_of,
    refund_mandate_share,
    refund_totals,
    taken_by,
    unrefunded_duplicates,
)
from intentledger.domain.states import FINAL, Outcome, State


def refund(amount: int, state: State, outcome: Outcome | None = None, *executed: str) -> RefundView:
    return RefundView(amount, state, outcome, frozenset(executed))


def test_every_refund_not_known_failed_holds_its_amount() -> None:
    refunds = [
        refund(10, State.ACCEPTED),
        refund(10, State.SUBMITTING),
        refund(10, State.UNKNOWN),
        refund(10, State.SAFETY_REVIEW),
        refund(10, State.MANUAL_REVIEW),
        refund(10, State.OUTCOME_KNOWN, Outcome.SUCCEEDED, "re_1"),
        refund(10, State.OUTCOME_KNOWN, Outcome.FAILED),  # gives its amount back
        refund(10, State.CANCELLED),
    ]
    totals = refund_totals(100, refunds)
    assert (totals.refunded, totals.taken, totals.refundable) == (10, 60, 40)


def test_the_providers_evidence_counts_whatever_the_outcome_says() -> None:
    # Settled failed, yet the provider showed it executed (a contradiction): refunded.
    contradicted = refund(30, State.OUTCOME_KNOWN, Outcome.FAILED, "re_1")
    # Executed twice (a duplicate refund): both count.
    twice = refund(20, State.OUTCOME_KNOWN, Outcome.SUCCEEDED, "re_2", "re_3")
    totals = refund_totals(100, [contradicted, twice])
    assert (totals.refunded, totals.taken, totals.refundable) == (70, 70, 30)


def test_a_mandate_gets_back_what_moved_and_only_that() -> None:
    assert refund_mandate_share(50, State.UNKNOWN, None, frozenset()).spent == 0
    succeeded = refund_mandate_share(50, State.OUTCOME_KNOWN, Outcome.SUCCEEDED, frozenset())
    assert (succeeded.reserved, succeeded.spent) == (0, -50)
    failed = refund_mandate_share(50, State.OUTCOME_KNOWN, Outcome.FAILED, frozenset())
    assert (failed.reserved, failed.spent) == (0, 0)


STATES = st.sampled_from(list(State))
OUTCOMES = st.sampled_from([None, Outcome.SUCCEEDED, Outcome.FAILED])
REFUNDS = st.builds(
    RefundView,
    amount=st.integers(min_value=1, max_value=10**6),
    state=STATES,
    outcome=OUTCOMES,
    executed=st.frozensets(st.sampled_from(["re_1", "re_2", "re_3"]), max_size=3),
    live_keys=st.integers(min_value=0, max_value=3),
    watched=st.booleans(),
)


@given(captured=st.integers(min_value=0, max_value=10**7), refunds=st.lists(REFUNDS, max_size=12))
def test_totals_hold_their_invariants(captured: int, refunds: list[RefundView]) -> None:
    totals = refund_totals(captured, refunds)
    assert 0 <= totals.refunded <= totals.taken
    assert totals.refundable == max(captured - totals.taken, 0)
    for one in refunds:
        # Every key that may still execute is held until the outcome is final
        # and the provider quiet ...
        if one.state not in FINAL:
            assert taken_by(one) >= one.amount * max(one.live_keys, 1)
        if one.watched:
            assert taken_by(one) >= one.amount * one.live_keys
        # ... and what executed is never given back.
        if one.executed:
            assert taken_by(one) >= one.amount * len(one.executed)


def test_a_person_s_failed_holds_until_the_provider_is_quiet() -> None:
    quiet = refund(10, State.OUTCOME_KNOWN, Outcome.FAILED)
    assert taken_by(RefundView(10, State.OUTCOME_KNOWN, Outcome.FAILED, frozenset(), 1, True)) == 10
    assert taken_by(quiet) == 0
    # Two keys sent, outcome open: both may have executed.
    assert taken_by(RefundView(10, State.UNKNOWN, None, frozenset(), 2, False)) == 20


# -- what may be refunded ---------------------------------------------------------------------


def settled_payment(amount: int = 100, outcome: Outcome = Outcome.SUCCEEDED) -> dict[str, Any]:
    return {
        "amount": amount,
        "state": State.OUTCOME_KNOWN,
        "outcome": outcome,
        "provider_reference": "ch_1",
    }


def refund_row(amount: int, state: State, charge: str = "ch_1") -> dict[str, Any]:
    return {
        "amount": amount,
        "state": state,
        "outcome": None,
        "executed_references": [],
        "provider_reference": None,
        "live_keys": 0,
        "watch": None,
        "request_context": {"charge": charge},
    }


def test_only_a_payment_known_succeeded_is_refundable() -> None:
    assert ask_refund(settled_payment(), [], None) == RefundAsk(100, RefundTotals(0, 0, 100), None)
    failed = ask_refund(settled_payment(outcome=Outcome.FAILED), [], None)
    assert failed.problem is RefundProblem.NOT_REFUNDABLE
    unknown = {**settled_payment(), "state": State.UNKNOWN, "outcome": None}
    assert ask_refund(unknown, [], 10).problem is RefundProblem.NOT_REFUNDABLE


def test_a_refund_in_flight_holds_its_amount_and_another_charges_refunds_do_not() -> None:
    refunds = [refund_row(60, State.UNKNOWN), refund_row(100, State.UNKNOWN, charge="ch_2")]
    assert ask_refund(settled_payment(), refunds, None).amount == 40
    assert ask_refund(settled_payment(), refunds, 41).problem is RefundProblem.EXCEEDS_REFUNDABLE
    everything = [refund_row(100, State.ACCEPTED)]
    assert ask_refund(settled_payment(), everything, None).problem is RefundProblem.NOTHING_LEFT


@given(
    captured=st.integers(1, 1_000),
    in_flight=st.lists(st.integers(1, 300), max_size=5),
    asked=st.none() | st.integers(1, 1_500),
)
def test_what_is_granted_never_takes_more_than_the_charge_took(
    captured: int, in_flight: list[int], asked: int | None
) -> None:
    refunds = [refund_row(amount, State.UNKNOWN) for amount in in_flight]
    ask = ask_refund(settled_payment(captured), refunds, asked)
    assert ask.totals.refundable == max(captured - sum(in_flight), 0)
    if ask.problem is None:
        assert 0 < ask.amount <= ask.totals.refundable
    else:
        assert ask.amount <= 0 or ask.amount > ask.totals.refundable


def test_a_duplicate_charge_took_the_payments_amount() -> None:
    payment = {**settled_payment(), "outcome": Outcome.FAILED}
    assert captured_by_charge(payment, "ch_1") == 0  # the settled charge: by its outcome
    assert captured_by_charge(payment, "ch_2") == 100


def test_only_an_executed_charge_beyond_the_settled_one_is_a_duplicate_to_refund() -> None:
    executed = frozenset({"ch_1", "ch_2"})
    assert duplicate_problem(True, "ch_1", "ch_2", executed) is None
    assert duplicate_problem(False, "ch_1", "ch_2", executed) is DuplicateProblem.NOT_FLAGGED
    assert duplicate_problem(True, None, "ch_2", executed) is DuplicateProblem.NO_SETTLED_CHARGE
    assert duplicate_problem(True, "ch_1", "ch_1", executed) is DuplicateProblem.SETTLED_CHARGE
    assert duplicate_problem(True, "ch_1", "ch_3", executed) is DuplicateProblem.NOT_EXECUTED


def test_the_duplicate_flag_stays_until_every_extra_charge_is_wholly_refunded() -> None:
    payment = {**settled_payment(), "executed_references": ["ch_1", "ch_2", "ch_3"]}
    assert duplicates_of(payment) == {"ch_2", "ch_3"}

    def refunded(amount: int, charge: str) -> dict[str, Any]:
        return {
            **refund_row(amount, State.OUTCOME_KNOWN, charge),
            "outcome": Outcome.SUCCEEDED,
            "provider_reference": f"re_{charge}",
        }

    assert unrefunded_duplicates(payment, []) == ["ch_2", "ch_3"]
    # The settled charge's refunds do not count for a duplicate.
    assert unrefunded_duplicates(payment, [refunded(100, "ch_1")]) == ["ch_2", "ch_3"]
    partly = [refunded(100, "ch_2"), refunded(40, "ch_3")]
    assert unrefunded_duplicates(payment, partly) == ["ch_3"]
    in_flight = [refunded(100, "ch_2"), refund_row(100, State.UNKNOWN, "ch_3")]
    assert unrefunded_duplicates(payment, in_flight) == ["ch_3"]
    assert unrefunded_duplicates(payment, [*partly, refunded(60, "ch_3")]) == []
