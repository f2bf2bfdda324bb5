"""A deadline on the running task: `asyncio.timeout` at a fraction of its CPU.

`asyncio.timeout(within)` builds a Timeout object whose entry and exit do
bookkeeping around its timer; on uvloop that cost more than the timer itself.
The edge's body read and every provider call take a deadline that nearly
always is met, so what they need is a timer that cancels the task if it
fires, and a way to tell, once the task sees CancelledError, whether that
cancellation was the deadline's alone — the rule `asyncio.timeout` applies:
a cancellation from outside at the same moment stays a cancellation.
"""

from __future__ import annotations

import asyncio

__all__ = ["Deadline"]


class Deadline:
    """Cancels the current task `within` seconds from now, unless `cancel()`
    comes first (`None`: never). Use it as::

        deadline = Deadline(within)
        try:
            ...  # the awaits it bounds
        except asyncio.CancelledError:
            if not deadline.expired():
                raise
            ...  # the deadline's: the work ran out of time
        finally:
            deadline.cancel()
    """

    __slots__ = ("_before", "_fired", "_taken_back", "_task", "_timer")

    def __init__(self, within: float | None) -> None:
        task = asyncio.current_task()
        if task is None:
            # As `asyncio.timeout`: a deadline cancels a task, so there must be one.
            raise RuntimeError("a Deadline must be set inside a task")
        self._task = task
        # Cancellations already requested when the deadline began are not its
        # own: the rule of `asyncio.timeout` in later 3.11 releases (3.11.7
        # here); earlier ones (3.11.2 among them) took them for its own.
        self._before = task.cancelling()
        self._fired = False
        self._taken_back = False
        # The task's own loop, not `asyncio.get_running_loop()`: in CPython 3.11
        # each lookup of the running loop is a getpid() system call (its check
        # against a fork), and `current_task()` above made one already
        # (docs/benchmarks.md, "Native frames").
        self._timer = None if within is None else task.get_loop().call_later(within, self._fire)

    def _fire(self) -> None:
        self._fired = True
        self._task.cancel()

    def expired(self) -> bool:
        """Whether the CancelledError being handled is this deadline's alone.
        Call it while handling that error: it takes back the deadline's
        cancellation request (`Task.uncancel`), as `asyncio.timeout` does, and
        what is left is someone else's."""
        return self._take_back() and self._task.cancelling() <= self._before

    def cancel(self) -> None:
        """Stop the timer. If it fired and the work ended some other way (a
        library turned the cancellation into its own error), its request is
        taken back all the same, as `asyncio.timeout` takes it back whatever
        the error: a request left behind would make the task's next deadline
        read an outside cancellation into its own."""
        if self._timer is not None:
            self._timer.cancel()
        self._take_back()

    def _take_back(self) -> bool:
        """Withdraw the fired deadline's request once; whether it had fired."""
        if self._fired and not self._taken_back:
            self._taken_back = True
            self._task.uncancel()
        return self._fired
