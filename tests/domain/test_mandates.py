"""Mandate statuses and what a payment under a mandate may reserve."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from intentledger.domain.mandates import (
    STATUS_CHANGES,
    Books,
    MandateStatus,
    cancels_unsubmitted,
    is_active,
    reserve_refusal,
    status_after,
)


def test_the_database_keeps_the_same_strings() -> None:
    assert [status.value for status in MandateStatus] == ["active", "suspended", "revoked"]
    assert is_active("active")
    assert not is_active("suspended")
    assert not is_active(None)  # a missing mandate sends nothing


def test_each_action_starts_only_where_it_may() -> None:
    assert status_after("suspend", "active") is MandateStatus.SUSPENDED
    assert status_after("suspend", "suspended") is None
    assert status_after("resume", "suspended") is MandateStatus.ACTIVE
    assert status_after("resume", "active") is None
    assert status_after("revoke", "active") is MandateStatus.REVOKED
    assert status_after("revoke", "suspended") is MandateStatus.REVOKED
    # Revoked is the end: nothing starts from it.
    assert all(status_after(action, "revoked") is None for action in STATUS_CHANGES)


def test_only_leaving_active_cancels_what_was_not_submitted() -> None:
    assert not cancels_unsubmitted(MandateStatus.ACTIVE)
    assert cancels_unsubmitted(MandateStatus.SUSPENDED)
    assert cancels_unsubmitted(MandateStatus.REVOKED)


BOOKS = Books("EUR", max_amount=500, total_limit=1000, reserved=300, spent=200)


def test_refusals_in_the_order_a_payment_meets_them() -> None:
    def code(status: str, amount: int, currency: str = "EUR") -> str | None:
        refused = reserve_refusal("md_1", status, BOOKS, amount, currency)
        return None if refused is None else refused.code

    assert code("suspended", 1) == "mandate-not-active"
    assert code("active", 1, "USD") == "mandate-currency"
    assert code("active", 501) == "mandate-max-amount"
    assert code("active", 500) is None  # exactly what is free
    assert code("active", 1) is None
    tighter = Books("EUR", max_amount=500, total_limit=1000, reserved=300, spent=201)
    refused = reserve_refusal("md_1", "active", tighter, 500, "EUR")
    assert refused is not None
    assert (refused.status, refused.code) == (422, "mandate-limit")
    assert "(499)" in refused.detail


@given(
    total_limit=st.integers(1, 10_000),
    reserved=st.integers(0, 10_000),
    spent=st.integers(0, 10_000),
    amount=st.integers(1, 10_000),
)
def test_a_payment_fits_exactly_when_reserving_it_keeps_the_books_within_the_limit(
    total_limit: int, reserved: int, spent: int, amount: int
) -> None:
    books = Books("EUR", total_limit, total_limit, reserved, spent)
    refused = reserve_refusal("md_1", "active", books, amount, "EUR")
    within = reserved + amount + spent <= total_limit
    assert (refused is None) == within
    if refused is not None:
        assert refused.code in {"mandate-limit", "mandate-max-amount"}
