"""The loop's lag (engine/loop_lag.py) and the slots it feeds (engine/adaptive_slots.py),
on a real event loop with real tasks."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import REGISTRY

from intentledger.domain.concurrency_limit import ConcurrencyLimit, LimitSettings
from intentledger.engine.adaptive_slots import AdaptiveSlots
from intentledger.engine.loop_lag import LoopLag


def lag_samples() -> float:
    return REGISTRY.get_sample_value("intentledger_event_loop_lag_seconds_count") or 0.0


def blocking_sleep(seconds: float) -> None:
    """A task that hogs the loop, as too much work of a process's own does."""
    time.sleep(seconds)


async def test_the_lag_of_a_blocked_loop_is_seen_at_once_and_then_kept() -> None:
    before = lag_samples()
    async with LoopLag() as lag:
        await asyncio.sleep(0.12)
        assert lag_samples() >= before + 2
        assert lag.current() < 0.1
        asyncio.get_running_loop().call_soon(blocking_sleep, 0.2)
        await asyncio.sleep(0)  # the hog runs in this round; we resume after it
        # Overdue by the block before the measuring task has had its turn.
        assert lag.current() >= 0.15
        await asyncio.sleep(0.06)
        assert lag.recent_max() >= 0.15
    assert lag.current() == lag._latest_s  # no sleep under way once left


async def test_a_task_that_blocks_the_loop_shows_as_lag() -> None:
    async with LoopLag() as lag:
        await asyncio.sleep(0.06)
        await asyncio.create_task(_block(0.2))
        assert lag.current() >= 0.15


async def test_leaving_stops_the_measuring_task() -> None:
    async with LoopLag() as lag:
        await asyncio.sleep(0)
        assert any(task.get_name() == "intentledger-loop-lag" for task in asyncio.all_tasks())
    assert not any(task.get_name() == "intentledger-loop-lag" for task in asyncio.all_tasks())
    assert lag._task is None


async def test_a_monitor_measures_once_at_a_time() -> None:
    async with LoopLag() as lag:
        with pytest.raises(RuntimeError, match="already measuring"):
            await lag.__aenter__()


def test_an_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="interval_s must be positive"):
        LoopLag(interval_s=0)


def slots_of(
    max_limit: int, initial: float | None = None, lag: LoopLag | None = None
) -> AdaptiveSlots:
    settings = LimitSettings(max_limit=max_limit, initial_limit=initial)
    return AdaptiveSlots(ConcurrencyLimit(settings), lag or LoopLag())


async def test_no_more_calls_run_at_once_than_the_limit() -> None:
    slots = slots_of(4)
    running = peak = 0

    async def call() -> None:
        nonlocal running, peak
        async with slots.acquire():
            running += 1
            peak = max(peak, running)
            await asyncio.sleep(0.01)
            running -= 1

    assert slots.free() == 4
    await asyncio.gather(*(call() for _ in range(40)))
    assert peak == 4
    assert (slots.in_flight, slots.waiting, slots.free()) == (0, 0, 4)


async def test_free_counts_what_may_start_now() -> None:
    slots = slots_of(3)
    release = asyncio.Event()

    async def hold() -> None:
        async with slots.acquire():
            await release.wait()

    holders = [asyncio.create_task(hold()) for _ in range(4)]
    await asyncio.sleep(0.01)
    assert (slots.in_flight, slots.waiting, slots.free()) == (3, 1, 0)
    release.set()
    await asyncio.gather(*holders)
    assert slots.free() == 3


async def test_timeouts_shrink_the_slots_and_new_calls_wait_under_the_new_limit() -> None:
    async with LoopLag() as lag:
        slots = slots_of(8, lag=lag)
        release = asyncio.Event()
        started = 0

        async def call() -> None:
            nonlocal started
            async with slots.acquire():
                started += 1
                await release.wait()
                slots.record(5.0, timed_out=True)

        first = [asyncio.create_task(call()) for _ in range(8)]
        await asyncio.sleep(0.01)
        assert started == 8
        later = [asyncio.create_task(call()) for _ in range(8)]
        await asyncio.sleep(0.01)
        assert (started, slots.waiting) == (8, 8)
        release.set()
        await asyncio.gather(*first)
        # One window of timeouts: the limit halved once, to 4.
        assert slots.slots == 4
        await asyncio.gather(*later)
        value = REGISTRY.get_sample_value("intentledger_worker_concurrency_limit")
        assert value == slots.limit


async def test_a_growing_limit_wakes_waiters_without_a_call_ending() -> None:
    async with LoopLag() as lag:
        slots = slots_of(8, initial=1, lag=lag)
        release = asyncio.Event()
        started = 0

        async def call() -> None:
            nonlocal started
            async with slots.acquire():
                started += 1
                await release.wait()

        tasks = [asyncio.create_task(call()) for _ in range(3)]
        await asyncio.sleep(0.01)
        assert started == 1
        for _ in range(20):
            slots.record(0.001, timed_out=False)
        assert slots.slots >= 3
        await asyncio.sleep(0.01)
        assert started == 3
        release.set()
        await asyncio.gather(*tasks)


async def test_a_cancelled_waiter_leaks_no_slot() -> None:
    slots = slots_of(1)
    release = asyncio.Event()

    async def hold() -> None:
        async with slots.acquire():
            await release.wait()

    holder = asyncio.create_task(hold())
    waiter = asyncio.create_task(hold())
    await asyncio.sleep(0.01)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    assert slots.waiting == 0
    release.set()
    await holder
    assert (slots.in_flight, slots.free()) == (0, 1)


async def test_a_waiter_cancelled_as_it_is_given_a_slot_passes_it_on() -> None:
    slots = slots_of(1)
    release = asyncio.Event()
    ran = []
    unlucky: asyncio.Task[None]

    async def hold(name: str) -> None:
        async with slots.acquire():
            ran.append(name)
            await release.wait()
        if name == "holder":
            # Its exit just gave the slot to `unlucky`, which has not run yet.
            unlucky.cancel()

    holder = asyncio.create_task(hold("holder"))
    await asyncio.sleep(0)
    unlucky = asyncio.create_task(hold("unlucky"))
    next_in_line = asyncio.create_task(hold("next"))
    await asyncio.sleep(0.01)
    release.set()
    await asyncio.wait_for(
        asyncio.gather(holder, unlucky, next_in_line, return_exceptions=True), timeout=2
    )
    assert unlucky.cancelled()
    assert ran == ["holder", "next"]
    assert (slots.in_flight, slots.free()) == (0, 1)


async def test_a_call_that_finishes_on_a_lagging_loop_cuts_the_limit_and_says_why() -> None:
    async with LoopLag() as lag:
        slots = slots_of(16, lag=lag)
        async with slots.acquire():
            sent = time.monotonic()
            await asyncio.sleep(0.06)
            # The answer is in; a task of ours hogs the loop before we read it.
            await asyncio.create_task(_block(0.2))
            seen = slots.record(time.monotonic() - sent, timed_out=False)
        assert seen >= 0.15
        assert slots.loop_lag() >= 0.15
        assert slots.slots == 8


async def _block(seconds: float) -> None:
    time.sleep(seconds)
