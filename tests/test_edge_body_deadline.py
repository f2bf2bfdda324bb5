"""The body's deadline (api/edge.py: `_read_body`) decides as asyncio.timeout
does: its own expiry is a 408, a cancellation from outside stays one, and a
body that arrives in time leaves nothing scheduled. The 408 over real sockets
is tests/test_edge.py's slow-clients test."""

from __future__ import annotations

import asyncio

import pytest
from starlette.types import Message

from intentledger.api.edge import _read_body
from intentledger.web.problems import Problem


async def never() -> Message:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def test_a_body_that_never_arrives_is_408_after_the_deadline() -> None:
    with pytest.raises(Problem) as refused:
        await _read_body({}, never, 0.05)
    assert refused.value.status == 408
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0


async def test_a_cancellation_from_outside_stays_a_cancellation() -> None:
    reading = asyncio.create_task(_read_body({}, never, 30.0))
    await asyncio.sleep(0.01)
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading


async def test_a_body_in_time_leaves_no_deadline_behind() -> None:
    async def whole() -> Message:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    assert await _read_body({}, whole, 0.05) == b"{}"
    await asyncio.sleep(0.1)  # a deadline left behind would cancel this sleep
