"""A worker's slots for provider calls, as many as its adaptive limit allows.

The domain's limit (domain/concurrency_limit.py) says how many calls may be in
flight; the loop's lag (engine/loop_lag.py) is one of its signals. Here they
meet the tasks: a call holds a slot while it runs (``async with
slots.acquire():``), reports how it went before it lets go
(``slots.record(rtt_s, timed_out)``), and a claimer asks ``slots.free()`` how
many more rows it may take now, so rows it could not start at once are not
held under lease while they wait.

Waiters are served first come, first served; a limit that grows wakes as many
as it has room for, one that shrinks lets the calls in flight finish and starts
no more until they are under it.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from types import TracebackType

from intentledger.domain.concurrency_limit import ConcurrencyLimit
from intentledger.engine.loop_lag import LoopLag
from intentledger.observability.metrics import WORKER_CONCURRENCY_LIMIT

__all__ = ["AdaptiveSlots"]


class AdaptiveSlots:
    """Slots for provider calls under an adaptive limit (module doc).

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
        self._in_flight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        WORKER_CONCURRENCY_LIMIT.set(limit.limit)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def limit(self) -> float:
        """The adaptive limit, unrounded (the metric's value)."""
        return self._limit.limit

    @property
    def slots(self) -> int:
        """How many calls may be in flight at once now."""
        return self._limit.slots

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def loop_lag(self) -> float:
        """The event loop's lag now, in seconds."""
        return self._loop_lag.current()

    def free(self) -> int:
        """How many more calls may start now without waiting."""
        return max(0, self._limit.slots - self._in_flight - len(self._waiters))

    def acquire(self) -> _Slot:
        """A slot for one call, held inside ``async with``; waits while none is free."""
        return _Slot(self)

    def record(self, rtt_s: float, timed_out: bool) -> float:
        """Learn from a call that finished; call it while still holding its slot.

        Returns the loop's lag the limit was given, for the caller to log with the
        call's observation: a timeout with a high lag beside it was our own.
        """
        lag = self._loop_lag.current()
        before = self._limit.slots
        limit = self._limit.on_sample(rtt_s, self._in_flight, timed_out, lag, self._now())
        WORKER_CONCURRENCY_LIMIT.set(limit)
        if self._limit.slots > before:
            self._wake()
        return lag

    async def _enter(self) -> None:
        if not self._waiters and self._in_flight < self._limit.slots:
            self._in_flight += 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                # Given a slot and cancelled before it could run: pass the slot on.
                self._leave()
            elif waiter in self._waiters:  # not yet passed over by _wake
                self._waiters.remove(waiter)
            raise

    def _leave(self) -> None:
        self._in_flight -= 1
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self._in_flight < self._limit.slots:
            waiter = self._waiters.popleft()
            if not waiter.done():
                # The slot is counted as the waiter is woken, so no newcomer can
                # take it in the meantime.
                self._in_flight += 1
                waiter.set_result(None)


class _Slot:
    __slots__ = ("_slots",)

    def __init__(self, slots: AdaptiveSlots) -> None:
        self._slots = slots

    async def __aenter__(self) -> None:
        await self._slots._enter()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._slots._leave()
