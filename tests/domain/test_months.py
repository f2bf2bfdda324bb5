"""The UTC months the provider answers are partitioned by, and which answers
outlive their month's drop (decision 0018)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

from intentledger.domain.months import add_months, month_start, months_from
from intentledger.domain.reaping import outlives_its_partition


def test_a_month_starts_at_midnight_utc_whatever_the_instant_s_zone() -> None:
    # 00:30 on 1 December in Berlin is still November in UTC.
    berlin = timezone(timedelta(hours=1))
    assert month_start(datetime(2026, 12, 1, 0, 30, tzinfo=berlin)) == datetime(
        2026, 11, 1, tzinfo=UTC
    )
    assert month_start(datetime(2026, 12, 31, 23, 59, 59, tzinfo=UTC)) == datetime(
        2026, 12, 1, tzinfo=UTC
    )


def test_months_carry_over_the_year_both_ways() -> None:
    december = datetime(2026, 12, 1, tzinfo=UTC)
    assert add_months(december, 1) == datetime(2027, 1, 1, tzinfo=UTC)
    assert add_months(december, -12) == datetime(2025, 12, 1, tzinfo=UTC)
    assert add_months(datetime(2027, 1, 1, tzinfo=UTC), -1) == december
    assert months_from(datetime(2026, 11, 30, 12, tzinfo=UTC), 2) == [
        datetime(2026, 11, 1, tzinfo=UTC),
        december,
        datetime(2027, 1, 1, tzinfo=UTC),
    ]


def test_an_answer_goes_with_its_month_only_if_its_operation_was_reaped_after_it() -> None:
    assert outlives_its_partition(None, 7)  # not reaped (yet): maybe still needed
    assert not outlives_its_partition(9, 7)  # the reap saw up to 9: 7 was given up
    assert not outlives_its_partition(7, 7)
    assert outlives_its_partition(7, 8)  # written after the reap: late evidence
    assert outlives_its_partition(0, 1)  # reaped with no observations at all
