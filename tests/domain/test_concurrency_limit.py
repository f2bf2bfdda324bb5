"""The adaptive concurrency limit's rule (domain/concurrency_limit.py), by property."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from intentledger.domain.concurrency_limit import ConcurrencyLimit, LimitSettings, overload_of_call

THRESHOLD = LimitSettings(max_limit=1).loop_lag_threshold_s
INTERVAL = LimitSettings(max_limit=1).decrease_interval_s

max_limits = st.integers(min_value=1, max_value=512)
# A provider's usual time: a loopback sandbox's millisecond to a slow bank's seconds.
rtts = st.floats(min_value=0.001, max_value=2.0)


class Clock:
    """The caller's monotonic clock: each call starts when the previous one ends."""

    def __init__(self) -> None:
        self.now = 1000.0

    def call(self, limiter: ConcurrencyLimit, rtt: float, **sample: float | bool) -> float:
        self.now += rtt
        return limiter.on_sample(
            rtt,
            in_flight=int(sample.get("in_flight", limiter.slots)),
            dropped=bool(sample.get("dropped", False)),
            loop_lag_s=float(sample.get("loop_lag_s", 0.0)),
            now_s=self.now,
        )

    def healthy(self, limiter: ConcurrencyLimit, rtt: float, count: int) -> float:
        for _ in range(count):
            self.call(limiter, rtt)
        return limiter.limit

    def overloaded(self, limiter: ConcurrencyLimit, rtt: float, count: int, how: str) -> float:
        """`count` overloaded calls, each sent a window after the last: a sustained overload."""
        for _ in range(count):
            self.now += INTERVAL
            if how == "timeout":
                self.call(limiter, rtt, dropped=True)
            else:
                lag = THRESHOLD * 2
                self.call(limiter, rtt + lag, loop_lag_s=lag)
        return limiter.limit


def limiter(max_limit: int, initial: float | None = None, min_limit: int = 1) -> ConcurrencyLimit:
    return ConcurrencyLimit(
        LimitSettings(max_limit=max_limit, min_limit=min_limit, initial_limit=initial)
    )


samples = st.tuples(
    st.floats(min_value=0, max_value=30),  # rtt
    st.integers(min_value=0, max_value=1000),  # in flight
    st.booleans(),  # timed out
    st.floats(min_value=0, max_value=5),  # loop lag
    st.floats(min_value=0, max_value=1),  # time since the previous sample
)


@given(
    st.integers(min_value=1, max_value=64),
    st.integers(min_value=0, max_value=448),
    st.lists(samples, max_size=200),
)
def test_the_limit_never_leaves_its_bounds(min_limit: int, extra: int, sequence: list) -> None:
    limit = limiter(min_limit + extra, min_limit=min_limit)
    now = 0.0
    for rtt, in_flight, dropped, lag, gap in sequence:
        now += gap
        value = limit.on_sample(rtt, in_flight, dropped, lag, now)
        assert min_limit <= value <= min_limit + extra
        assert min_limit <= limit.slots <= min_limit + extra


@given(max_limits, rtts, st.sampled_from(["timeout", "loop_lag"]))
def test_a_sustained_overload_drives_the_limit_to_its_floor(
    max_limit: int, rtt: float, how: str
) -> None:
    limit = limiter(max_limit)
    # Halving from at most 512 reaches 1 in 9 windows.
    assert Clock().overloaded(limit, rtt, 10, how) == 1


@given(max_limits, rtts, st.lists(st.floats(min_value=1, max_value=1.2), min_size=1))
def test_steady_healthy_answers_grow_the_limit_to_its_ceiling(
    max_limit: int, rtt: float, jitter: list[float]
) -> None:
    limit = limiter(max_limit, initial=1)
    clock = Clock()
    # Answers within the tolerance of the usual time: 1 to 1.2 times it.
    for index in range(2000):
        clock.call(limit, rtt * jitter[index % len(jitter)])
    assert limit.limit == max_limit


@given(max_limits, rtts, st.floats(min_value=1.2, max_value=1.99))
def test_answers_within_twice_the_usual_time_keep_every_slot(
    max_limit: int, rtt: float, slower: float
) -> None:
    """The tolerance is 2: answers up to twice the usual time are the provider's
    variation (a provider serving a burst of calls in turn answers its last
    under twice the burst's mean). Gradient2's 1.5 cuts here once the limit is
    large enough for its step to fall (docs/benchmarks.md, step 49)."""
    limit = limiter(max_limit)
    clock = Clock()
    assert clock.healthy(limit, rtt, 50) == max_limit
    assert clock.healthy(limit, rtt * slower, 50) == max_limit


@given(st.integers(min_value=64, max_value=512), rtts, st.floats(min_value=2.5, max_value=3))
def test_answers_past_the_tolerance_lower_a_large_limit(
    max_limit: int, rtt: float, slower: float
) -> None:
    """The tolerance's other side: at 64 slots or more the gradient's step falls
    once answers pass about 2.3 times the usual time (the limit's square root
    holds a smaller one up longer), so 2.5 times lowers it at once and keeps it
    lower."""
    limit = limiter(max_limit)
    clock = Clock()
    assert clock.healthy(limit, rtt, 50) == max_limit
    assert clock.call(limit, rtt * slower) < max_limit
    assert clock.healthy(limit, rtt * slower, 9) < max_limit


@given(
    st.integers(min_value=16, max_value=512),
    rtts,
    st.floats(min_value=3, max_value=100),
)
def test_a_provider_that_slows_down_lowers_the_limit(
    max_limit: int, rtt: float, slower: float
) -> None:
    """Answers three times slower or more: each of the first ten lowers the limit.
    (Later ones teach the baseline the new time, and the limit settles again:
    a provider slower for good is not a reason to starve it.)"""
    limit = limiter(max_limit)
    clock = Clock()
    before = clock.healthy(limit, rtt, 50)
    assert before == max_limit
    for _ in range(10):
        after = clock.call(limit, rtt * slower)
        assert after < before
        before = after


@given(max_limits, rtts, st.floats(min_value=THRESHOLD * 1.01, max_value=5))
def test_our_own_loop_lag_lowers_the_limit_whatever_the_provider_time(
    max_limit: int, rtt: float, lag: float
) -> None:
    limit = limiter(max(max_limit, 2))
    clock = Clock()
    clock.healthy(limit, rtt, 50)
    # The provider answered in its usual time; our loop ran the answer `lag` late.
    clock.call(limit, rtt + lag, loop_lag_s=lag)
    assert limit.limit < max(max_limit, 2)


@given(max_limits, rtts, st.floats(min_value=0, max_value=THRESHOLD))
def test_loop_lag_under_the_threshold_is_not_read_as_a_slower_provider(
    max_limit: int, rtt: float, lag: float
) -> None:
    limit = limiter(max_limit)
    clock = Clock()
    clock.healthy(limit, rtt, 50)
    for _ in range(200):
        clock.call(limit, rtt + lag, loop_lag_s=lag)
    assert limit.limit == max_limit


@given(max_limits, rtts, st.sampled_from(["timeout", "loop_lag"]))
def test_the_limit_recovers_once_the_overload_ends(max_limit: int, rtt: float, how: str) -> None:
    limit = limiter(max_limit)
    clock = Clock()
    clock.healthy(limit, rtt, 50)
    assert clock.overloaded(limit, rtt, 10, how) == 1
    assert clock.healthy(limit, rtt, 2000) == max_limit


def test_one_window_of_timeouts_cuts_the_limit_once() -> None:
    """128 calls sent together time out together: one overload, one cut."""
    limit = limiter(128)
    sent_at, timeout = 1000.0, 5.0
    for index in range(128):
        limit.on_sample(timeout, 128 - index, True, 0.0, sent_at + timeout + index * 0.001)
    assert limit.limit == 64
    # A call sent after the cut that times out too is a second overload.
    limit.on_sample(timeout, 64, True, 0.0, sent_at + 2 * timeout + 1)
    assert limit.limit == 32


def test_a_limit_not_in_use_is_not_grown() -> None:
    limit = limiter(64, initial=8)
    clock = Clock()
    for _ in range(500):
        clock.call(limit, 0.01, in_flight=3)  # under half of 8
    assert limit.limit == 8
    clock.call(limit, 0.01, in_flight=4)
    assert limit.limit > 8


def test_the_baseline_is_the_provider_time_without_the_loop_lag() -> None:
    limit = limiter(16)
    clock = Clock()
    assert limit.baseline_s is None
    for _ in range(10):
        clock.call(limit, 0.030, loop_lag_s=0.020)
    assert limit.baseline_s == pytest.approx(0.010)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"max_limit": 4, "min_limit": 0}, "min_limit must be at least 1"),
        ({"max_limit": 2, "min_limit": 3}, "max_limit (2) must be at least min_limit (3)"),
        ({"max_limit": 4, "initial_limit": 5}, "initial_limit (5) must lie in [1, 4]"),
        ({"max_limit": 4, "rtt_tolerance": 0.9}, "rtt_tolerance must be at least 1"),
        ({"max_limit": 4, "rtt_tolerance": math.inf}, "rtt_tolerance must be at least 1"),
        ({"max_limit": 4, "smoothing": 0}, "smoothing must lie in (0, 1]"),
        ({"max_limit": 4, "backoff_ratio": 1}, "backoff_ratio must lie in (0, 1)"),
        ({"max_limit": 4, "long_window": 0}, "must be at least 1"),
        ({"max_limit": 4, "loop_lag_threshold_s": 0}, "loop_lag_threshold_s must be positive"),
        ({"max_limit": 4, "decrease_interval_s": -1}, "decrease_interval_s must be at least 0"),
    ],
)
def test_settings_out_of_range_are_refused(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=None) as refused:
        LimitSettings(**settings)
    assert message in str(refused.value)


@pytest.mark.parametrize(
    ("sample", "message"),
    [
        ((-0.1, 1, False, 0.0, 0.0), "rtt_s must be a finite time of at least 0"),
        ((math.nan, 1, False, 0.0, 0.0), "rtt_s must be a finite time of at least 0"),
        ((0.1, -1, False, 0.0, 0.0), "in_flight must be at least 0"),
        ((0.1, 1, False, -0.5, 0.0), "loop_lag_s must be a finite time of at least 0"),
        ((0.1, 1, False, 0.0, math.inf), "now_s must be finite"),
    ],
)
def test_samples_out_of_range_are_refused(sample: tuple, message: str) -> None:
    limit = limiter(4)
    with pytest.raises(ValueError) as refused:
        limit.on_sample(*sample)
    assert message in str(refused.value)
    assert limit.limit == 4


@pytest.mark.parametrize(
    ("timed_out", "usual", "loop_lagged", "told"),
    [
        (False, True, False, False),  # a usual answer: a sample
        (False, True, True, False),  # weighed with its instant's lag by on_sample
        (True, False, False, None),  # the provider's hang: nothing
        (False, False, False, None),  # a quick refusal: nothing
        (True, False, True, True),  # a timeout while our loop lagged: overload
        (False, False, True, True),
    ],
)
def test_what_a_call_tells_the_limit(
    timed_out: bool, usual: bool, loop_lagged: bool, told: bool | None
) -> None:
    assert overload_of_call(timed_out=timed_out, usual=usual, loop_lagged=loop_lagged) is told
