"""The partitions' width follows the record retention (domain/widths.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from intentledger.domain.widths import Width, floor, span_name, step, width_for


def test_the_width_is_the_widest_rung_at_most_a_quarter_of_the_retention() -> None:
    assert width_for(timedelta(days=400)) is Width.MONTH  # production: months, as before
    assert width_for(timedelta(days=124)) is Width.MONTH
    assert width_for(timedelta(days=123)) is Width.DAY
    assert width_for(timedelta(days=30)) is Width.DAY
    assert width_for(timedelta(days=3)) is Width.HOUR
    assert width_for(timedelta(hours=4)) is Width.HOUR
    assert width_for(timedelta(hours=3)) is Width.MINUTE
    assert width_for(timedelta(minutes=5)) is Width.MINUTE
    assert width_for(timedelta(minutes=1)) is Width.MINUTE  # the narrowest there is


def test_floor_and_step_walk_the_grid_in_utc() -> None:
    at = datetime(2026, 12, 31, 23, 59, 59, tzinfo=UTC)
    assert floor(at, Width.MONTH) == datetime(2026, 12, 1, tzinfo=UTC)
    assert floor(at, Width.DAY) == datetime(2026, 12, 31, tzinfo=UTC)
    assert floor(at, Width.HOUR) == datetime(2026, 12, 31, 23, tzinfo=UTC)
    assert floor(at, Width.MINUTE) == datetime(2026, 12, 31, 23, 59, tzinfo=UTC)
    assert step(floor(at, Width.MONTH), Width.MONTH, 2) == datetime(2027, 2, 1, tzinfo=UTC)
    assert step(floor(at, Width.MINUTE), Width.MINUTE) == datetime(2027, 1, 1, tzinfo=UTC)


def test_a_name_states_the_lower_bound_down_to_what_is_not_zero() -> None:
    assert span_name(datetime(2026, 11, 1, tzinfo=UTC)) == "2026_11"
    assert span_name(datetime(2026, 11, 30, tzinfo=UTC)) == "2026_11_30"
    assert span_name(datetime(2026, 11, 30, 12, tzinfo=UTC)) == "2026_11_30_12"
    assert span_name(datetime(2026, 11, 30, 12, 3, tzinfo=UTC)) == "2026_11_30_1203"
    assert span_name(datetime(2026, 11, 1, 0, 3, tzinfo=UTC)) == "2026_11_01_0003"


minutes = st.datetimes(
    min_value=datetime(2000, 1, 1), max_value=datetime(2099, 12, 31), timezones=st.just(UTC)
).map(lambda at: at.replace(second=0, microsecond=0))


@given(minutes, minutes)
def test_names_are_unique_and_sort_as_their_bounds_do(a: datetime, b: datetime) -> None:
    if a == b:
        assert span_name(a) == span_name(b)
    else:
        assert span_name(a) != span_name(b)
        assert (span_name(a) < span_name(b)) == (a < b)
