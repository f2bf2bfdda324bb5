"""How far behind the event loop runs: the lag of a worker's own process.

One task sleeps ``interval_s`` at a time; how much later than asked it wakes is
the loop's lag, the time a callback that is ready waits before it runs. A lag
well above zero means the process has more ready work than CPU (too many tasks
of its own, or a machine shared with more processes than cores), and every
await of every task pays it, a provider call's answer among them.

One wake-up per interval costs next to nothing; `current()` is a clock read and
a comparison, cheap enough to call after every provider call.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from types import TracebackType

from intentledger.observability.metrics import EVENT_LOOP_LAG

__all__ = ["LoopLag"]

# Short enough to see a lag within a provider call's time, long enough that the
# wake-ups are no load: twenty a second.
_INTERVAL_S = 0.05
# recent_max's memory: a second of samples while the loop keeps up.
_RECENT_SAMPLES = 20


class LoopLag:
    """The event loop's lag, measured while entered (``async with LoopLag() as lag``)."""

    def __init__(self, interval_s: float = _INTERVAL_S) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be positive, not {interval_s}")
        self._interval_s = interval_s
        self._latest_s = 0.0
        self._recent: deque[float] = deque(maxlen=_RECENT_SAMPLES)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._due_at: float | None = None
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LoopLag:
        if self._task is not None:
            raise RuntimeError("this LoopLag is already measuring")
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._measure(), name="intentledger-loop-lag")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        task, self._task = self._task, None
        self._due_at = None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def current(self) -> float:
        """The lag now, in seconds: the last sleep's overshoot, or, if the sleep
        under way is already overdue, how overdue it is (a loop that was just
        blocked shows it to the first callback that runs after, before the
        measuring task has had its turn)."""
        due_at = self._due_at
        if due_at is None or self._loop is None:
            return self._latest_s
        return max(self._latest_s, self._loop.time() - due_at)

    def recent_max(self) -> float:
        """The longest lag of the last 20 sleeps (0 before the first): a second
        while the loop keeps up, longer while it lags. The adaptive limit reads
        it to tell whether a timeout may have been our own starvation."""
        return max(self._recent, default=0.0)

    async def _measure(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due_at = loop.time() + self._interval_s
            self._due_at = due_at
            await asyncio.sleep(self._interval_s)
            # A timer may fire up to the clock's resolution early: that is no lag.
            lag = max(0.0, loop.time() - due_at)
            self._latest_s = lag
            self._recent.append(lag)
            EVENT_LOOP_LAG.observe(lag)
