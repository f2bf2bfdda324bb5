"""The loop's lag (engine/loop_lag.py) and the claim-side slots it feeds
(engine/adaptive_slots.py), on a real event loop."""

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


def gauge() -> float | None:
    return REGISTRY.get_sample_value("intentledger_worker_concurrency_limit")


def test_free_counts_the_rows_that_may_be_claimed_now() -> None:
    slots = slots_of(4)
    assert [slots.free(n) for n in (0, 3, 4, 9)] == [4, 1, 0, 0]
    assert gauge() == slots.limit == 4


def test_a_timeout_on_a_loop_that_kept_up_is_the_providers_and_halves_nothing() -> None:
    # A monitor never entered reads no lag: a loop that kept up, whatever the
    # machine running this test is doing.
    slots = slots_of(16, lag=LoopLag())
    for _ in range(10):
        slots.record(0.02, timed_out=False, in_flight=16)
    report = slots.record(5.0, timed_out=True, in_flight=16)
    assert not report.ours and report.loop_lag_s == 0
    # A very slow answer for the gradient to weigh, not a halving.
    assert slots.slots > 8
    assert gauge() == slots.limit


async def test_a_timeout_after_our_loop_lagged_halves_the_limit_and_says_it_was_ours() -> None:
    async with LoopLag() as lag:
        slots = slots_of(16, lag=lag)
        sent = time.monotonic()
        await asyncio.sleep(0.06)
        # A task of ours hogs the loop while the call's clock runs out.
        await asyncio.create_task(_block(0.2))
        report = slots.record(time.monotonic() - sent, timed_out=True, in_flight=16)
        assert report.ours and report.loop_lag_s >= 0.15
        assert report.slots == slots.slots == 8
        assert slots.free(8) == 0
        assert gauge() == slots.limit


async def _block(seconds: float) -> None:
    time.sleep(seconds)
