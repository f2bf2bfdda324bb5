"""A worker's slots under its adaptive limit: how many rows it may have in flight.

The domain's limit (domain/concurrency_limit.py) says how many provider calls
may be in flight; the loop's lag (engine/loop_lag.py) is one of its signals.
Here they meet the worker: its claimer asks `free(in_flight)` how many due rows
it may take now, and every first attempt's call reports how it went with
`record(...)`.

The limit is applied **at the claim, never between a pre-submit and its
call**. A row claimed is pre-submitted (`SUBMITTING` committed) at once and
its call starts at once: a call held back waiting for a slot would start
later than the ledger says it may have, past what the sweeper and a resumed
delivery assume (no call outlives `INTENTLEDGER_STALE_SUBMITTING`). A limit
that shrinks therefore lets the calls in flight finish and claims nothing more
until they are under it.

A timeout is an overload — a halving — only when our own loop lagged in the
last second's samples (`recent_max`): then it may be our starvation, not the
provider's answer, that ran out the clock. A timeout on a loop that kept up
is the provider's, and teaches the limit nothing: its call held a slot while
it hung, and counting it as a slow answer would let a provider's few hanging
calls throttle the many it answers. Likewise an answer off the provider's
usual path (a refusal, a connection never made, any non-2xx) teaches nothing
unless our loop lagged: its quick time would teach the limit a provider
faster than it is, and the gradient would then read every usual answer as a
slowdown.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from intentledger.domain.concurrency_limit import ConcurrencyLimit, overload_of_call
from intentledger.engine.loop_lag import LoopLag
from intentledger.observability.metrics import WORKER_CONCURRENCY_LIMIT

__all__ = ["AdaptiveSlots", "CallReport"]


class CallReport:
    """What one call told the limit: for the log line beside its observation."""

    __slots__ = ("loop_lag_s", "ours", "slots")

    def __init__(self, loop_lag_s: float, ours: bool, slots: int) -> None:
        self.loop_lag_s = loop_lag_s
        # The loop lagged past the limit's threshold: a timeout may be our own.
        self.ours = ours
        self.slots = slots


class AdaptiveSlots:
    """The adaptive limit as a worker's claimer sees it (module doc).

    ``loop_lag`` must be measuring (entered) while calls are recorded; ``now``
    is the monotonic clock the calls' times are measured on.
    """

    def __init__(
        self,
        limit: ConcurrencyLimit,
        loop_lag: LoopLag,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self._limit = limit
        self._loop_lag = loop_lag
        self._now = now
        WORKER_CONCURRENCY_LIMIT.set(limit.limit)

    @property
    def limit(self) -> float:
        """The adaptive limit, unrounded (the metric's value)."""
        return self._limit.limit

    @property
    def slots(self) -> int:
        """How many rows may be in flight at once now."""
        return self._limit.slots

    def loop_lag(self) -> float:
        """The event loop's lag now, in seconds."""
        return self._loop_lag.current()

    def free(self, in_flight: int) -> int:
        """How many more rows may be claimed now, with `in_flight` running."""
        return max(0, self._limit.slots - in_flight)

    def record(self, rtt_s: float, in_flight: int, *, timed_out: bool, typical: bool) -> CallReport:
        """Learn from a provider call that finished (`rtt_s` from send to answer),
        with `in_flight` rows running beside it. `timed_out`: no response;
        `typical`: an answer that took the provider's usual path (a 2xx), whose
        time says how fast the provider is."""
        threshold = self._limit.settings.loop_lag_threshold_s
        lag = max(self._loop_lag.current(), self._loop_lag.recent_max())
        ours = lag > threshold
        overload = overload_of_call(timed_out=timed_out, usual=typical, loop_lagged=ours)
        if overload is None:
            return CallReport(lag, ours, self._limit.slots)
        limit = self._limit.on_sample(
            rtt_s, in_flight, overload, self._loop_lag.current(), self._now()
        )
        WORKER_CONCURRENCY_LIMIT.set(limit)
        return CallReport(lag, ours, self._limit.slots)
