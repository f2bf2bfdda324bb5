"""A provider call's whole-call deadline (intentledger/deadline.py under
`providers.http.observe`): a timer in place of `asyncio.timeout`, holding to
the rules `asyncio.timeout` kept — the answer it records when time runs out,
an outside cancellation left a cancellation, no cancellation request left on
the task — on asyncio's loop and on uvloop, which the worker runs."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop
from multidict import CIMultiDict, CIMultiDictProxy

from intentledger.deadline import Deadline
from intentledger.domain.transport import Transport
from intentledger.providers.http import ProviderResponse, observe

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}


def run(loop: str, main: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        return runner.run(main())


async def never_answered() -> ProviderResponse:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def answered_after(seconds: float) -> ProviderResponse:
    await asyncio.sleep(seconds)
    return ProviderResponse(200, _no_headers(), json.dumps({"id": "ch_1"}).encode())


def _no_headers() -> CIMultiDictProxy[str]:
    return CIMultiDictProxy(CIMultiDict())


@pytest.fixture(params=sorted(LOOPS))
def loop(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def requests_left() -> int:
    """Cancellation requests still on the running task."""
    task = asyncio.current_task()
    assert task is not None
    return task.cancelling()


async def slow() -> None:
    await asyncio.sleep(0.2)


async def quick() -> None:
    await asyncio.sleep(0)


async def within_timeout(work: Callable[[], Coroutine[Any, Any, None]]) -> str:
    """`work` under `asyncio.timeout(0.02)`: what became of it."""
    try:
        async with asyncio.timeout(0.02):
            await work()
    except TimeoutError:
        return "timed out"
    return "done"


async def within_deadline(work: Callable[[], Coroutine[Any, Any, None]]) -> str:
    """`work` under `Deadline(0.02)`, used as its docstring says."""
    deadline = Deadline(0.02)
    try:
        await work()
    except asyncio.CancelledError:
        if not deadline.expired():
            raise
        return "timed out"
    finally:
        deadline.cancel()
    return "done"


def test_a_call_past_its_deadline_is_recorded_as_asyncio_timeout_recorded_it(loop: str) -> None:
    async def main() -> tuple[Any, int]:
        answer = await observe(never_answered(), 0.05)
        return answer, requests_left()

    answer, left = run(loop, main)
    assert answer.transport is Transport.NO_RESPONSE
    # What `asyncio.timeout` raised, and so what the ledger has recorded so far.
    assert answer.error_class == "builtins.TimeoutError"
    assert answer.detail == {"error": ""}
    assert left == 0  # the deadline took its request back


def test_a_call_within_its_deadline_is_answered_and_its_timer_stopped(loop: str) -> None:
    async def main() -> tuple[Any, int]:
        # Half a second of margin: a loaded machine may stall the loop a while.
        answer = await observe(answered_after(0.01), 0.5)
        # Past the deadline: a timer left running would cancel this sleep.
        await asyncio.sleep(0.6)
        return answer, requests_left()

    answer, left = run(loop, main)
    assert answer.transport is Transport.RESPONSE
    assert answer.provider_reference == "ch_1"
    assert left == 0


def test_no_deadline_never_cuts_a_call(loop: str) -> None:
    async def main() -> Any:
        return await observe(answered_after(0.05), None)

    assert run(loop, main).transport is Transport.RESPONSE


def test_a_cancellation_from_outside_stays_a_cancellation(loop: str) -> None:
    """A stopping worker cancels its tasks: that must not read as the
    provider's timeout (an answer recorded for a call still unanswered)."""

    async def main() -> None:
        call = asyncio.ensure_future(observe(never_answered(), 5.0))
        await asyncio.sleep(0.01)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call

    run(loop, main)


def test_an_outside_cancellation_as_the_deadline_fires_stays_a_cancellation(loop: str) -> None:
    async def main() -> None:
        async def cancelled_with_the_deadline() -> ProviderResponse:
            task = asyncio.current_task()
            assert task is not None
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                # The deadline's cancellation is being delivered; a stop
                # arrives at the same moment, before anyone has handled it.
                task.cancel()
                raise
            raise AssertionError("unreachable")

        seen: list[Any] = []

        async def dispatcher() -> None:
            # What the caller does with an answer before its next await.
            seen.append(await observe(cancelled_with_the_deadline(), 0.02))

        call = asyncio.ensure_future(dispatcher())
        with pytest.raises(asyncio.CancelledError):
            await call
        assert seen == []

    run(loop, main)


def test_a_deadline_turned_into_a_library_error_leaves_no_request_behind(loop: str) -> None:
    """A library may catch the cancellation and raise its own error: the answer
    is that error's, and the task keeps no cancellation request of the deadline's,
    which would make its next deadline take an outside cancellation for its own."""

    async def converts_cancellation() -> ProviderResponse:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise ConnectionResetError("closed while cancelled") from None
        raise AssertionError("unreachable")

    async def main() -> tuple[Any, int]:
        answer = await observe(converts_cancellation(), 0.02)
        return answer, requests_left()

    answer, left = run(loop, main)
    assert answer.transport is Transport.NO_RESPONSE
    assert answer.error_class == "builtins.ConnectionResetError"
    assert left == 0


def test_a_deadline_expired_reads_as_asyncio_timeout_reads(loop: str) -> None:
    """The same work under `asyncio.timeout` and under `Deadline`: the same outcome."""

    async def main() -> list[str]:
        return [
            await within_timeout(slow),
            await within_deadline(slow),
            await within_timeout(quick),
            await within_deadline(quick),
        ]

    assert run(loop, main) == ["timed out", "timed out", "done", "done"]


def test_a_cancellation_pending_before_the_deadline_is_not_its_own(loop: str) -> None:
    """A task that swallowed an earlier cancellation still carries its request;
    a deadline that then fires is still the deadline, as asyncio.timeout reads
    it (Python 3.11.7), and the earlier request is left where it was."""

    async def under(bounded: Callable[[], Coroutine[Any, Any, str]]) -> tuple[str, int]:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        # Swallowed, not uncancelled: one request stays on the task.
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(1)
        assert task.cancelling() == 1
        return await bounded(), task.cancelling()

    async def by_timeout() -> str:
        return await within_timeout(slow)

    async def by_deadline() -> str:
        return await within_deadline(slow)

    async def by_observe() -> str:
        answer = await observe(never_answered(), 0.02)
        return str(answer.error_class)

    def in_a_task(bounded: Callable[[], Coroutine[Any, Any, str]]) -> tuple[str, int]:
        async def main() -> tuple[str, int]:
            return await asyncio.ensure_future(under(bounded))

        return run(loop, main)  # type: ignore[no-any-return]

    assert in_a_task(by_timeout) == ("timed out", 1)
    assert in_a_task(by_deadline) == ("timed out", 1)
    assert in_a_task(by_observe) == ("builtins.TimeoutError", 1)


def test_a_deadline_needs_a_task(loop: str) -> None:
    """In a callback the loop runs outside any task, as `asyncio.timeout` refuses."""

    async def main() -> str:
        made: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        def callback() -> None:
            try:
                Deadline(1.0)
            except RuntimeError as exc:
                made.set_result(str(exc))
            else:
                made.set_result("made")

        asyncio.get_running_loop().call_soon(callback)
        return await made

    assert "inside a task" in run(loop, main)
