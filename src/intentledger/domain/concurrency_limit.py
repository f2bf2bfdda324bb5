"""How many provider calls a worker may have in flight: an adaptive limit.

A worker that starts more calls than its process can serve does not get more
done: its event loop falls behind, every call waits longer for its turn, and a
call that waits past its timeout becomes UNKNOWN although the provider may have
answered in time. The limit learns from every finished call, after the
gradient limit of Netflix's concurrency-limits ("Gradient2") with AIMD's
multiplicative decrease for hard signals:

1. **Overload** — the call timed out, or the event loop's lag when it finished
   was over ``loop_lag_threshold_s``: the limit is multiplied by
   ``backoff_ratio``, at most once per window: only a call sent after the last
   decrease, and finished ``decrease_interval_s`` or more after it, can decrease
   it again. The calls already in flight were sent under the old limit and say
   nothing about the new one (TCP halves its window once per round trip, not
   once per lost packet), and the loop's lag is measured a sleep at a time, so
   a lag read just after a cut still tells of the load before it. Overloaded
   samples teach the baseline nothing.
2. Otherwise the provider's round-trip time is the call's measured time less
   the loop's lag, and it feeds a long-term baseline (the mean of the first
   ``warmup_samples``, then an exponential average over ``long_window``
   samples). The gradient is ``rtt_tolerance * baseline / rtt`` clamped to
   ``[0.5, 1]``: 1 while the provider answers within the tolerance of its
   usual time, lower as its answers slow down (a queue is forming).
3. A limit not in use is not tested: while fewer than half of it is in flight,
   only overload changes it.
4. Else the limit moves a ``smoothing`` share of the way to
   ``limit * gradient + sqrt(limit)``: it grows by a fraction of its square
   root per healthy call up to ``max_limit`` and sinks toward ``sqrt(limit) /
   (1 - gradient)`` while the provider is slow.

The limit always lies in ``[min_limit, max_limit]``. The domain reads no clock:
the caller passes the time a call finished, on any monotonic clock, in seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["ConcurrencyLimit", "LimitSettings", "overload_of_call"]

# The gradient's floor: one sample never cuts the smoothed step below half the
# limit (Gradient2's own bound); harder cuts are overload's to make.
_GRADIENT_FLOOR = 0.5
# When the baseline is over twice the call's time, the provider got faster
# (often: an overload ended and the baseline learned slow answers as normal);
# the baseline drops this share per sample rather than waiting out its window.
_BASELINE_DRIFT_RATIO = 2.0
_BASELINE_DRIFT_DECAY = 0.95
# No round trip is measured below this (a loopback call takes more): it keeps
# the ratio finite when the loop's lag is as long as the call itself.
_RTT_FLOOR_S = 1e-4


@dataclass(frozen=True)
class LimitSettings:
    """The limit's bounds and how fast it moves.

    ``max_limit`` is the worker's configured concurrency: the limiter only ever
    takes away from it what the samples show the process cannot carry.
    """

    max_limit: int
    # One call at a time still makes progress, and the limit climbs again by a
    # share of a slot per healthy call; a higher floor would keep an overload going.
    min_limit: int = 1
    # None: start at max_limit, as a worker without the limiter runs; a worker the
    # machine can carry never loses a slot, and one it cannot is cut by the first
    # window of overloaded calls.
    initial_limit: float | None = None
    # Answers up to twice the usual time are the provider's own variation, not
    # a queue we made. Gradient2's default is 1.5; through a provider that
    # serves calls in turn, 1.5 read the queue of a worker's own claims as a
    # slowing provider and held each worker to 10-25 slots, its claims to
    # 11-15 payments and its record groups to 6-8 (docs/benchmarks.md, step
    # 41); 2 met the peer and the scaling goals together where 1.5 missed the
    # first and 2.5 the second (step 49). Overload (a lagging loop, our own
    # timeouts) halves the limit whatever the tolerance.
    rtt_tolerance: float = 2.0
    # Gradient2's default: a fifth of the step per sample damps one odd answer.
    smoothing: float = 0.2
    # TCP's halving, not AIMD's 0.9: an overload here turns calls into UNKNOWN
    # operations, each one a lookup or a person's time, so it is cut fast; the
    # decrease comes at most once per window, and growth is per call.
    backoff_ratio: float = 0.5
    # Gradient2's long window and warm-up, in samples.
    long_window: int = 600
    warmup_samples: int = 10
    # A loop that lags 50 ms is behind, not merely busy: a callback that is ready
    # waits for more than a full round of a worker's other tasks, on every await
    # of every call (an answer already in the socket buffer among them). It is
    # far below any sensible provider timeout, so the limit drops well before
    # the lag alone can push a call past its timeout.
    loop_lag_threshold_s: float = 0.05
    # Two of the lag monitor's 50 ms sleeps (engine/loop_lag.py): after a cut, a
    # whole sleep measured under the new limit is in before the next one.
    decrease_interval_s: float = 0.1

    def __post_init__(self) -> None:
        if self.min_limit < 1:
            raise ValueError(f"min_limit must be at least 1, not {self.min_limit}")
        if self.max_limit < self.min_limit:
            raise ValueError(
                f"max_limit ({self.max_limit}) must be at least min_limit ({self.min_limit})"
            )
        initial = self.initial_limit
        if initial is not None and not self.min_limit <= initial <= self.max_limit:
            raise ValueError(
                f"initial_limit ({initial}) must lie in [{self.min_limit}, {self.max_limit}]"
            )
        if not (math.isfinite(self.rtt_tolerance) and self.rtt_tolerance >= 1):
            raise ValueError(f"rtt_tolerance must be at least 1, not {self.rtt_tolerance}")
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"smoothing must lie in (0, 1], not {self.smoothing}")
        if not 0 < self.backoff_ratio < 1:
            raise ValueError(f"backoff_ratio must lie in (0, 1), not {self.backoff_ratio}")
        if self.long_window < 1 or self.warmup_samples < 1:
            raise ValueError("long_window and warmup_samples must be at least 1")
        if not (math.isfinite(self.loop_lag_threshold_s) and self.loop_lag_threshold_s > 0):
            raise ValueError(
                f"loop_lag_threshold_s must be positive, not {self.loop_lag_threshold_s}"
            )
        if not (math.isfinite(self.decrease_interval_s) and self.decrease_interval_s >= 0):
            raise ValueError(
                f"decrease_interval_s must be at least 0, not {self.decrease_interval_s}"
            )


class ConcurrencyLimit:
    """The limit's state; `on_sample` after each finished call moves it (module doc)."""

    __slots__ = ("_baseline_s", "_last_decrease_at", "_limit", "_samples", "_settings")

    def __init__(self, settings: LimitSettings) -> None:
        self._settings = settings
        initial = settings.initial_limit
        self._limit = float(settings.max_limit if initial is None else initial)
        self._baseline_s = 0.0
        self._samples = 0
        self._last_decrease_at: float | None = None

    @property
    def settings(self) -> LimitSettings:
        return self._settings

    @property
    def limit(self) -> float:
        return self._limit

    @property
    def slots(self) -> int:
        """How many calls may be in flight at once: the limit, whole."""
        return max(self._settings.min_limit, math.floor(self._limit))

    @property
    def baseline_s(self) -> float | None:
        """The provider's usual round-trip time, once a sample has taught one."""
        return self._baseline_s if self._samples else None

    def overloaded(self, timed_out: bool, loop_lag_s: float) -> bool:
        return timed_out or loop_lag_s > self._settings.loop_lag_threshold_s

    def on_sample(
        self,
        rtt_s: float,
        in_flight: int,
        dropped: bool,
        loop_lag_s: float,
        now_s: float,
    ) -> float:
        """Learn from one finished call; return the new limit.

        ``rtt_s``: the call's time from send to answer (or to giving up on one),
        as the worker measured it; ``in_flight``: calls in flight as it finished,
        itself included; ``dropped``: it timed out; ``loop_lag_s``: the event
        loop's lag as it finished; ``now_s``: when it finished, on the monotonic
        clock the caller uses for every sample.
        """
        _check_sample(rtt_s, in_flight, loop_lag_s, now_s)
        settings = self._settings
        if self.overloaded(dropped, loop_lag_s):
            last = self._last_decrease_at
            if last is None or (
                now_s - rtt_s >= last and now_s - last >= settings.decrease_interval_s
            ):
                self._limit = max(settings.min_limit, self._limit * settings.backoff_ratio)
                self._last_decrease_at = now_s
            return self._limit
        # The time we measure runs until our coroutine resumes with the answer,
        # and an answer that arrived waits in the socket buffer for as long as
        # the loop lags: uncorrected, our own starvation would read as a slower
        # provider. The gradient would then answer a CPU shortage with its gentle
        # smoothed step, and the baseline would learn the starved times as the
        # provider's normal and stop seeing the queue at all. So the lag comes
        # off the time (an estimate: a call may wait on the loop more than once,
        # hence the tolerance), and lag past the threshold is overload in its
        # own right (above), whatever the provider's time looks like.
        rtt = max(rtt_s - loop_lag_s, _RTT_FLOOR_S)
        self._learn_baseline(rtt)
        if in_flight < self._limit / 2:
            return self._limit
        gradient = max(_GRADIENT_FLOOR, min(1.0, settings.rtt_tolerance * self._baseline_s / rtt))
        target = self._limit * gradient + math.sqrt(self._limit)
        smoothed = self._limit * (1 - settings.smoothing) + target * settings.smoothing
        self._limit = min(float(settings.max_limit), max(float(settings.min_limit), smoothed))
        return self._limit

    def _learn_baseline(self, rtt: float) -> None:
        settings = self._settings
        self._samples += 1
        if self._samples <= settings.warmup_samples:
            self._baseline_s += (rtt - self._baseline_s) / self._samples
            return
        weight = 2 / (settings.long_window + 1)
        self._baseline_s += (rtt - self._baseline_s) * weight
        if self._baseline_s > _BASELINE_DRIFT_RATIO * rtt:
            self._baseline_s *= _BASELINE_DRIFT_DECAY


def _check_sample(rtt_s: float, in_flight: int, loop_lag_s: float, now_s: float) -> None:
    if not (math.isfinite(rtt_s) and rtt_s >= 0):
        raise ValueError(f"rtt_s must be a finite time of at least 0, not {rtt_s}")
    if in_flight < 0:
        raise ValueError(f"in_flight must be at least 0, not {in_flight}")
    if not (math.isfinite(loop_lag_s) and loop_lag_s >= 0):
        raise ValueError(f"loop_lag_s must be a finite time of at least 0, not {loop_lag_s}")
    if not math.isfinite(now_s):
        raise ValueError(f"now_s must be finite, not {now_s}")


def overload_of_call(*, timed_out: bool, usual: bool, loop_lagged: bool) -> bool | None:
    """What one finished call tells the limit: None, nothing; else whether it is
    overload. A timeout or an answer off the provider's usual path (a refusal,
    a connection never made) teaches nothing unless our own loop lagged: the
    hang held its slot while it lasted, and a refusal's quick time would teach
    a provider faster than it is. When our loop lagged, either is overload; a
    usual answer is a sample the rule above weighs with its instant's lag."""
    off_path = timed_out or not usual
    if off_path and not loop_lagged:
        return None
    return off_path
