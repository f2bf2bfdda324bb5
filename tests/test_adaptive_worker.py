"""A worker's adaptive limit, wired: starved, it claims fewer rows and makes no
UNKNOWN of its own; a timeout is logged with whose it was.

In-process `run_worker` against the sandbox provider's own process, on both
databases. A task that hogs the event loop stands for a process with more work
than CPU (issue 39, item 4; the bench's scaling phase measures the same with
four worker processes on two cores).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from datetime import timedelta

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.engine.worker import run_worker
from tests.test_dispatch import MovableClock, accept, make_worker, operation
from tests.test_settlement_queue import until_states

CONCURRENCY = 16


async def test_a_starved_worker_claims_fewer_rows_and_makes_no_unknown(
    engine: AsyncEngine, sandbox: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="intentledger.engine.worker")
    clock = MovableClock()
    made = [await accept(engine, clock, "pm_ok", key=f"k{i}") for i in range(60)]
    worker = make_worker(engine, sandbox, clock, timeout=5.0)
    stop = asyncio.Event()
    limits: list[int] = []

    async def hog() -> None:
        # 200 ms of our own work in every 205: every call that finishes meanwhile
        # finds the loop lagging far past 50 ms. At least 2 s, and on until the
        # limit is halved (or 20 s): on a loaded machine the worker's first calls
        # may finish only seconds in, and a call that finishes after the hog
        # teaches the limit nothing. A limit that ignores the lag is not halved
        # by answers, however long the hog; a timeout would halve it (a timeout
        # on a lagging loop is overload whatever the lag rule), so the test
        # also requires that no call timed out.
        started = time.monotonic()
        while time.monotonic() - started < 20.0:
            if (
                time.monotonic() - started >= 2.0
                and min(limits, default=CONCURRENCY) <= CONCURRENCY // 2
            ):
                break
            time.sleep(0.2)
            await asyncio.sleep(0.005)

    async def watch() -> None:
        while not stop.is_set():
            if worker.slots is not None:
                limits.append(worker.slots.slots)
            await asyncio.sleep(0.005)

    running = asyncio.create_task(
        run_worker(
            worker, stop, CONCURRENCY, timedelta(milliseconds=20), timedelta(minutes=1), batch=4
        )
    )
    watching = asyncio.create_task(watch())
    await hog()
    await until_states(engine, made, "OUTCOME_KNOWN", within=30.0)
    stop.set()
    await asyncio.wait_for(asyncio.gather(running, watching), 10)

    timeouts = [
        r.getMessage()
        for r in caplog.records
        if r.getMessage().startswith("no response from the provider")
    ]
    assert timeouts == []  # the cut below was the lag's, not a timeout's
    # The first cut halved the limit (not a gentler step repeated).
    first_cut = next((limit for limit in limits if limit < CONCURRENCY), CONCURRENCY)
    assert first_cut <= CONCURRENCY // 2, sorted(set(limits))
    assert [(await operation(engine, op)).outcome for op in made] == ["succeeded"] * 60


async def test_a_timeout_is_logged_with_the_loops_lag_and_whose_it_was(
    engine: AsyncEngine, sandbox: str, caplog: pytest.LogCaptureFixture
) -> None:
    clock = MovableClock()
    hanging = await accept(engine, clock, "pm_blackhole", key="hanging")
    worker = make_worker(engine, sandbox, clock, timeout=0.3)
    stop = asyncio.Event()
    caplog.set_level(logging.WARNING, logger="intentledger.engine.worker")
    running = asyncio.create_task(
        run_worker(worker, stop, CONCURRENCY, timedelta(milliseconds=20), timedelta(minutes=1))
    )
    await until_states(engine, [hanging], "UNKNOWN", within=10.0)
    stop.set()
    await asyncio.wait_for(running, 10)
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.getMessage().startswith("no response from the provider")
    ]
    assert len(lines) == 1, lines
    # Whose it was follows the lag it names (50 ms: the limit's threshold); on a
    # busy test machine the loop may really have lagged.
    lag = float(re.search(r"the event loop lagged ([0-9.]+) s", lines[0]).group(1))  # type: ignore[union-attr]
    ours, providers = "(ours: the process was starved)", "(the provider's)"
    if abs(lag - 0.05) > 0.001:  # not rounded onto the threshold
        assert (ours if lag > 0.05 else providers) in lines[0], lines[0]
    assert (ours in lines[0]) != (providers in lines[0]), lines[0]
