"""Each provider answer is recorded when it arrives, grouped only by arrival.

In-process, on both databases, against the sandbox provider's own process:
a quick answer is committed while a sibling of its claim still hangs; answers
of different claims share a transaction; a failed group still records every
answer on its own; an answer that arrives after its operation moved on is
judged by the reference path; a stopping worker records every answer it is
waiting for; and the record delay is observed only once the commit returned.
(`tests/test_record_delay.py` shows the same through real `serve` and
`worker` processes, and that the batching it replaced failed it.)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from prometheus_client import REGISTRY
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.concurrency_limit import LimitSettings
from intentledger.engine import worker as worker_module
from intentledger.engine.batch_dispatch import pre_submit
from intentledger.engine.settlement_queue import Sent, answered_now
from intentledger.engine.worker import Worker, run_worker
from intentledger.store.batches import BatchLedger
from intentledger.store.tables import observations
from tests.test_dispatch import MovableClock, accept, make_worker, operation, rows, sandbox_submits


def recorded(by: str, kind: str = "payment") -> float:
    """How many answers the record-delay histogram has seen recorded this way."""
    value = REGISTRY.get_sample_value(
        "intentledger_record_delay_seconds_count", {"kind": kind, "recorded_by": by}
    )
    return value or 0.0


async def states(engine: AsyncEngine, operation_ids: list[str]) -> list[str]:
    return [(await operation(engine, op_id)).state for op_id in operation_ids]


async def until_states(
    engine: AsyncEngine, operation_ids: list[str], state: str, within: float
) -> None:
    deadline = time.monotonic() + within
    while (seen := await states(engine, operation_ids)) != [state] * len(operation_ids):
        assert time.monotonic() < deadline, f"not all {state} after {within} s: {seen}"
        await asyncio.sleep(0.02)


async def test_a_quick_answer_is_committed_while_a_sibling_of_its_claim_hangs(
    engine: AsyncEngine, sandbox: str
) -> None:
    clock = MovableClock()
    hanging = await accept(engine, clock, "pm_blackhole", key="hanging")
    quick = [await accept(engine, clock, "pm_ok", key=f"quick-{i}") for i in range(3)]
    # The hanging call gives up at 6 s; answers held for their claim's sibling
    # would be recorded only then, past the bound below (which leaves a loaded
    # machine seconds for three calls at once).
    worker = make_worker(engine, sandbox, clock, timeout=6.0)
    started_at = time.monotonic()
    started = await worker.start_due(10)
    assert len(started) == 4  # one claim, one pre-submit

    await until_states(engine, quick, "OUTCOME_KNOWN", within=4.0)
    # Committed while the hanging call of the same claim is still out.
    assert (await operation(engine, hanging)).state == "SUBMITTING"
    assert worker.in_flight == 1
    await asyncio.gather(*started)
    assert (await operation(engine, hanging)).state == "UNKNOWN"
    assert time.monotonic() - started_at >= 6.0


async def test_answers_of_different_claims_settle_in_one_transaction(
    engine: AsyncEngine, sandbox: str
) -> None:
    clock = MovableClock()
    first = await accept(engine, clock, "pm_ok", key="first")
    second = await accept(engine, clock, "pm_declined", key="second")
    worker = make_worker(engine, sandbox, clock, record_window=timedelta(seconds=1))
    before = recorded("grouped")
    # Two claims, two pre-submit transactions: the window gathers their answers.
    started = await worker.start_due(1) + await worker.start_due(1)
    await asyncio.gather(*started)

    settled = [(await rows(engine, observations, op))[0].at for op in (first, second)]
    assert settled[0] == settled[1]  # one record transaction's instant
    assert [(await operation(engine, op)).outcome for op in (first, second)] == [
        "succeeded",
        "failed",
    ]
    assert recorded("grouped") - before == 2


async def test_a_failed_group_records_each_answer_on_its_own(
    engine: AsyncEngine, sandbox: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    settle = BatchLedger.settle
    failures: list[int] = []

    async def fails_once(self: BatchLedger, *args: Any, **kwargs: Any) -> None:
        if not failures:
            failures.append(1)
            raise RuntimeError("the group's transaction fails")
        await settle(self, *args, **kwargs)

    monkeypatch.setattr(BatchLedger, "settle", fails_once)
    clock = MovableClock()
    made = [await accept(engine, clock, "pm_ok", key=f"k{i}") for i in range(3)]
    worker = make_worker(engine, sandbox, clock, record_window=timedelta(seconds=1))
    grouped, alone = recorded("grouped"), recorded("alone")
    assert await worker.deliver_batch(10) == 3

    assert failures == [1]
    assert [(await operation(engine, op)).outcome for op in made] == ["succeeded"] * 3
    assert [len(await rows(engine, observations, op)) for op in made] == [1, 1, 1]
    # The failed group observed nothing; each answer was timed on its own path.
    assert recorded("grouped") == grouped
    assert recorded("alone") - alone == 3


async def test_an_answer_after_its_operation_moved_on_is_judged_by_the_reference_path(
    engine: AsyncEngine, sandbox: str
) -> None:
    clock = MovableClock()
    op_id = await accept(engine, clock, "pm_ok", key="late")
    worker = make_worker(engine, sandbox, clock)
    async with engine.begin() as conn:
        claimed = await BatchLedger(conn).claim_outbox_rows(
            clock(), timedelta(minutes=5), worker.worker_id, 10
        )
    prepared, others = await pre_submit(worker.dispatcher, claimed)
    assert [p.row.operation_id for p in prepared] == [op_id] and others == []
    # The call outlives `stale_submitting`: the sweeper makes it UNKNOWN first.
    clock.advance(timedelta(minutes=3))
    assert await worker.sweeper.sweep() == 1
    answer = await worker.dispatcher.provider.submit(prepared[0].submission.request)
    grouped = recorded("grouped")
    await worker.settlements.record(Sent(prepared[0], answer, answered_now()))

    op = await operation(engine, op_id)
    assert (op.state, op.outcome) == ("OUTCOME_KNOWN", "succeeded")
    kinds = [o.kind for o in await rows(engine, observations, op_id)]
    assert kinds == ["sweeper", "submit_result"], kinds
    assert recorded("grouped") == grouped  # not the plain group settlement
    assert len(sandbox_submits(sandbox, op_id)) == 1


async def slow_calls_in_flight(
    engine: AsyncEngine, sandbox: str
) -> tuple[list[str], Worker, asyncio.Event, asyncio.Task[None]]:
    """A running worker with four calls out: pm_slow answers after the
    sandbox's 1 s, so a stop now comes while every call is in flight."""
    clock = MovableClock()
    slow = [await accept(engine, clock, "pm_slow", key=f"slow-{i}") for i in range(4)]
    worker = make_worker(engine, sandbox, clock, timeout=3.0)
    stop = asyncio.Event()
    running = asyncio.create_task(
        run_worker(worker, stop, 8, timedelta(milliseconds=20), timedelta(minutes=1), batch=8)
    )
    await until_states(engine, slow, "SUBMITTING", within=2.0)
    return slow, worker, stop, running


async def test_a_stopping_worker_records_every_answer_it_waits_for(
    engine: AsyncEngine, sandbox: str
) -> None:
    slow, worker, stop, running = await slow_calls_in_flight(engine, sandbox)
    stop.set()
    await asyncio.wait_for(running, 10)
    assert await states(engine, slow) == ["OUTCOME_KNOWN"] * 4
    assert worker.in_flight == 0


def fixed_limit(max_limit: int) -> LimitSettings:
    """The concurrency limit's settings with no room to move: it stays at the
    worker's configured concurrency."""
    return LimitSettings(max_limit=max_limit, min_limit=max_limit)


async def test_free_slots_are_claimed_at_once_beside_calls_that_hang(
    engine: AsyncEngine, sandbox: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three of four slots held by hanging calls: the fourth takes the quick
    payments one after the other without waiting for a poll (3 s here) each."""
    # Four slots throughout. On a loaded machine (make test's other process
    # beside it) the loop lagged past 50 ms and the adaptive limit halved to 2,
    # as it should: then the hanging calls held every slot and the last quick
    # payments waited for them, which is the limit's test to judge
    # (tests/test_adaptive_worker.py), not this one's.
    monkeypatch.setattr(worker_module, "LimitSettings", fixed_limit)
    clock = MovableClock()
    hanging = [await accept(engine, clock, "pm_blackhole", key=f"h{i}") for i in range(3)]
    quick = [await accept(engine, clock, "pm_ok", key=f"q{i}") for i in range(4)]
    # The hanging calls hold their slots past the bound below: a worker that
    # waited for a poll would claim the second quick payment at 3 s and the
    # last only when the hanging calls gave up at 6 s.
    worker = make_worker(engine, sandbox, clock, timeout=6.0)
    stop = asyncio.Event()
    started = time.monotonic()
    most_in_flight = 0
    limits: set[int] = set()

    async def watch() -> None:
        nonlocal most_in_flight
        while not stop.is_set():
            most_in_flight = max(most_in_flight, worker.in_flight)
            if worker.slots is not None:
                limits.add(worker.slots.slots)
            await asyncio.sleep(0.005)

    running = asyncio.create_task(
        run_worker(worker, stop, 4, timedelta(seconds=3), timedelta(minutes=1), batch=4)
    )
    watching = asyncio.create_task(watch())
    try:
        # Four quick calls in turn take a fraction of a second (a loaded
        # machine has taken 2 s); a worker that waited for the poll before a
        # second quick claim and again before a third would take 6 s or more.
        # (One lost wake-up, 3 s, would pass: the bound catches two.)
        await until_states(engine, quick, "OUTCOME_KNOWN", within=4.0)
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(running, watching), 15)
    assert time.monotonic() - started >= 6.0  # the hanging calls ran their course
    assert most_in_flight <= 4  # a free slot is taken, never more than the slots
    assert limits == {4}  # the limit held still
    assert await states(engine, hanging) == ["UNKNOWN"] * 3


async def test_a_worker_cancelled_while_it_drains_still_records_every_answer(
    engine: AsyncEngine, sandbox: str
) -> None:
    """A cancellation landing on the graceful drain (a sibling task failing
    after the stop, the parent cancelled) must not abandon calls in flight."""
    slow, worker, stop, running = await slow_calls_in_flight(engine, sandbox)
    stop.set()
    await asyncio.sleep(0.05)  # the claimer is in its drain now
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    # The cancellation waited for the drain: every answer is recorded already.
    assert await states(engine, slow) == ["OUTCOME_KNOWN"] * 4
    assert worker.in_flight == 0


async def answered_outside_the_queue(
    engine: AsyncEngine, clock: MovableClock, worker: Worker, operation_ids: list[str]
) -> Callable[[str], Sent]:
    """Claim and pre-submit the due rows, and call the provider for each of
    `operation_ids`, outside any queue: each answer's `Sent`, made when asked
    (its arrival instant then), for a test to hand to the queue itself."""
    async with engine.begin() as conn:
        claimed = await BatchLedger(conn).claim_outbox_rows(
            clock(), timedelta(minutes=5), worker.worker_id, 10
        )
    prepared, _ = await pre_submit(worker.dispatcher, claimed)
    by_operation = {p.row.operation_id: p for p in prepared}
    answers = {
        op: await worker.dispatcher.provider.submit(by_operation[op].submission.request)
        for op in operation_ids
    }
    return lambda op: Sent(by_operation[op], answers[op], answered_now())


async def test_an_answer_is_not_held_for_a_group_already_committing(
    engine: AsyncEngine, sandbox: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two groups commit at once on PostgreSQL: an answer arriving while a slow
    group commits is committed by a group of its own meanwhile. SQLite has one
    writer: there the second group waits for the first, as any two writes do."""
    settle = BatchLedger.settle
    calls: list[float] = []

    async def first_one_slow(self: BatchLedger, *args: Any, **kwargs: Any) -> None:
        calls.append(time.monotonic())
        if len(calls) == 1:
            await asyncio.sleep(1.0)  # a commit held up (a slow disk, a lock)
        await settle(self, *args, **kwargs)

    monkeypatch.setattr(BatchLedger, "settle", first_one_slow)
    clock = MovableClock()
    slow = await accept(engine, clock, "pm_ok", key="slow")
    quick = await accept(engine, clock, "pm_ok", key="quick")
    worker = make_worker(engine, sandbox, clock, record_window=timedelta(0))
    sent = await answered_outside_the_queue(engine, clock, worker, [slow, quick])
    queue = worker.settlements
    first = asyncio.create_task(queue.record(sent(slow)))
    await asyncio.sleep(0.2)  # the first group is in its slow commit
    await queue.record(sent(quick))
    quick_done_while_slow_committed = not first.done()
    await first
    assert [(await operation(engine, op)).outcome for op in (slow, quick)] == ["succeeded"] * 2
    if engine.dialect.name == "postgresql":
        assert quick_done_while_slow_committed
    else:
        assert not quick_done_while_slow_committed


async def test_a_cancelled_caller_leaves_its_answer_to_its_group(
    engine: AsyncEngine, sandbox: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller of `record` cancelled (a stopping worker) cancels only its own
    wait: an answer already in a committing group is written all the same,
    and one still waiting beside a second answer for its operation leaves the
    queue forming and committing groups."""
    settle = BatchLedger.settle
    calls: list[float] = []

    async def first_one_slow(self: BatchLedger, *args: Any, **kwargs: Any) -> None:
        calls.append(time.monotonic())
        if len(calls) == 1:
            await asyncio.sleep(0.5)  # the group is mid-commit when its caller goes
        await settle(self, *args, **kwargs)

    monkeypatch.setattr(BatchLedger, "settle", first_one_slow)
    clock = MovableClock()
    committing = await accept(engine, clock, "pm_ok", key="committing")
    twice = await accept(engine, clock, "pm_ok", key="twice")
    worker = make_worker(engine, sandbox, clock, record_window=timedelta(milliseconds=300))
    sent = await answered_outside_the_queue(engine, clock, worker, [committing, twice])
    queue = worker.settlements

    gone = asyncio.create_task(queue.record(sent(committing)))
    deadline = time.monotonic() + 5
    while not calls:  # until its group is in the slow commit
        assert time.monotonic() < deadline, "the group never began its commit"
        await asyncio.sleep(0.01)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    # The same operation's answer twice, the second's caller gone before the
    # group forms: the queue must still commit the first.
    first = asyncio.create_task(queue.record(sent(twice)))
    second = asyncio.create_task(queue.record(sent(twice)))
    await asyncio.sleep(0.05)
    second.cancel()
    await asyncio.wait_for(first, 10)
    with pytest.raises(asyncio.CancelledError):
        await second
    await until_states(engine, [committing, twice], "OUTCOME_KNOWN", within=5.0)
    assert [len(await rows(engine, observations, op)) for op in (committing, twice)] == [1, 1]
    assert len(calls) == 2  # the cancelled caller's group, then the twice-sent's
