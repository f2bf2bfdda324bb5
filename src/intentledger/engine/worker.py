"""A worker process's loop: claim due outbox rows into free slots, deliver each
in a task of its own.

One claimer per process takes at most as many due rows as it has free slots
(and at most `batch` at a time), pre-submits the first attempts among them in
one transaction, and starts a task per row. A row's task holds its slot until
its outcome is committed, so a hanging provider call takes one slot and
nothing else: no other row waits for it to be claimed or recorded.

Delivery is at least once: a row whose holder dies falls due again when its
lease runs out, and every handler is idempotent against the operation's state.
The sweeper and the merchant webhooks' sender run beside the claimer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from datetime import timedelta
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.concurrency_limit import ConcurrencyLimit, LimitSettings
from intentledger.domain.transport import ProviderAnswer, Transport, usual_answer
from intentledger.engine.adaptive_slots import AdaptiveSlots
from intentledger.engine.batch_dispatch import start_submits
from intentledger.engine.clock import Clock
from intentledger.engine.dispatcher import Dispatcher
from intentledger.engine.loop_lag import LoopLag
from intentledger.engine.reaper import Reaper
from intentledger.engine.reconciler import Reconciler
from intentledger.engine.settlement_queue import DEFAULT_WINDOW, SettlementQueue
from intentledger.engine.sweeper import Sweeper
from intentledger.engine.webhook_sender import WebhookSender
from intentledger.observability import ledger_events
from intentledger.observability.logs import log_context
from intentledger.store.batches import BatchLedger
from intentledger.store.database import lost_connection
from intentledger.store.direct import LedgerConnection
from intentledger.store.ledger import Ledger
from intentledger.store.records import OutboxRecord

log = logging.getLogger(__name__)


class Worker:
    def __init__(
        self,
        engine: AsyncEngine,
        clock: Clock,
        lease: timedelta,
        worker_id: str,
        dispatcher: Dispatcher,
        reconciler: Reconciler,
        sweeper: Sweeper,
        webhooks: WebhookSender | None = None,
        reaper: Reaper | None = None,
        record_window: timedelta = DEFAULT_WINDOW,
    ) -> None:
        self.engine = engine
        self.clock = clock
        self.lease = lease
        self.worker_id = worker_id
        self.dispatcher = dispatcher
        self.reconciler = reconciler
        self.sweeper = sweeper
        # Merchant webhooks: their own loop and client (engine/webhook_sender.py).
        self.webhooks = webhooks
        # Record retention, on a schedule (engine/reaper.py).
        self.reaper = reaper
        # First attempts' answers, committed as they arrive.
        self.settlements = SettlementQueue(dispatcher, record_window)
        # Deliveries started and not finished: each holds a slot.
        self._running: set[asyncio.Task[None]] = set()
        # The adaptive limit on them, while run_worker runs (None: the
        # configured concurrency alone, as tests driving deliver_batch use).
        self.slots: AdaptiveSlots | None = None
        self._freed = asyncio.Event()
        self._wake_at_in_flight = 0

    async def deliver_next(self) -> bool:
        """Claim and deliver one due outbox row; False when nothing was due."""
        async with self.engine.begin() as conn:
            row = await Ledger(conn).claim_outbox_row(self.clock(), self.lease, self.worker_id)
            if row is not None:
                ledger_events.claimed(conn, [row])
        if row is None:
            return False
        await self.deliver(row)
        return True

    async def deliver(self, row: OutboxRecord) -> None:
        with log_context(operation_id=row.operation_id):
            await self._deliver(row)

    async def _deliver(self, row: OutboxRecord) -> None:
        if row.kind == "submit":
            await self.dispatcher.deliver_submit(row)
        elif row.kind == "reconcile":
            await self.reconciler.deliver_reconcile(row)
        elif row.kind == "audit":
            await self.reconciler.deliver_audit(row)
        else:
            log.error("outbox row %s has unknown kind %r; leaving it leased", row.id, row.kind)

    @property
    def in_flight(self) -> int:
        return len(self._running)

    async def start_due(self, limit: int) -> list[asyncio.Task[None]]:
        """Claim up to `limit` due rows and start a delivery task for each:
        submits through the batched first-attempt path (one pre-submit
        transaction, each answer recorded as it arrives), the other kinds one
        by one. Returns the tasks started."""
        rows = await self.dispatcher.hot_transaction(lambda conn: self._claim(conn, limit))
        # Looked up once a claim, not at every task started: in CPython 3.11
        # each lookup of the running loop is a getpid() system call.
        loop = asyncio.get_running_loop()
        started = [self._start(loop, self.deliver(row)) for row in rows if row.kind != "submit"]
        submits = [row for row in rows if row.kind == "submit"]
        if submits:
            # Once the pre-submit commits, its rows are SUBMITTING and their
            # calls must start: a cancellation meanwhile waits for that.
            starting = asyncio.ensure_future(
                start_submits(self.dispatcher, self.settlements, submits, self._observe_call)
            )
            cancelled = await _despite_cancellation(starting)
            try:
                deliveries = starting.result()
            except Exception as exc:
                # Nothing was sent: the rows stay leased and fall due again.
                _log_failure(exc, "the pre-submit failed; the rows' leases make them due again")
                deliveries = []
            started.extend(self._start(loop, delivery) for delivery in deliveries)
            if cancelled:
                raise asyncio.CancelledError
        return started

    async def _claim(self, conn: LedgerConnection, limit: int) -> list[OutboxRecord]:
        rows = await BatchLedger(conn).claim_outbox_rows(
            self.clock(), self.lease, self.worker_id, limit
        )
        ledger_events.claimed(conn, rows)
        return rows

    async def deliver_batch(self, limit: int) -> int:
        """Claim up to `limit` due rows, deliver them, and return once every one
        is finished: how many were claimed."""
        started = await self.start_due(limit)
        await asyncio.gather(*started, return_exceptions=True)
        return len(started)

    def _observe_call(self, seconds: float, answer: ProviderAnswer) -> None:
        slots = self.slots
        if slots is None:
            return
        timed_out = answer.transport is Transport.NO_RESPONSE
        typical = usual_answer(answer)
        before = slots.slots
        report = slots.record(seconds, self.in_flight, timed_out=timed_out, typical=typical)
        if before < report.slots and self.in_flight < report.slots:
            # The limit grew past what the claimer may be waiting for. Only then:
            # woken by every answer, it would claim the slot or two free at that
            # moment instead of waiting for company.
            self._freed.set()
        if timed_out:
            # Beside the observation the task records next: whose timeout it was.
            log.warning(
                "no response from the provider after %.3f s; the event loop lagged "
                "%.3f s at most in its last second of samples (%s); concurrency limit now %d",
                seconds,
                report.loop_lag_s,
                "ours: the process was starved" if report.ours else "the provider's",
                report.slots,
            )

    def _start(
        self, loop: asyncio.AbstractEventLoop, delivery: Coroutine[Any, Any, None]
    ) -> asyncio.Task[None]:
        task = loop.create_task(delivery)
        self._running.add(task)
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._running.discard(task)
        if len(self._running) <= self._wake_at_in_flight:
            self._freed.set()
        if task.cancelled():
            return
        failure = task.exception()
        if failure is not None:
            _log_failure(failure, "delivery failed; its lease will make it due again")

    async def until_in_flight_at_most(
        self, in_flight: int, stop: asyncio.Event, patience: timedelta
    ) -> None:
        """Wait until at most `in_flight` deliveries run, `stop` is set, or `patience`
        has passed."""
        if len(self._running) <= in_flight:
            return
        self._wake_at_in_flight = in_flight
        self._freed.clear()
        waits = {asyncio.ensure_future(self._freed.wait()), asyncio.ensure_future(stop.wait())}
        try:
            await asyncio.wait(
                waits, timeout=patience.total_seconds(), return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for wait in waits:
                wait.cancel()
            self._wake_at_in_flight = 0

    async def wait_idle(self) -> None:
        """Until every delivery started has finished (a graceful stop)."""
        while self._running:
            await asyncio.gather(*self._running, return_exceptions=True)

    async def drain(self) -> int:
        """Deliver until nothing is due (tests and the demo use this)."""
        delivered = 0
        while await self.deliver_next():
            delivered += 1
        return delivered

    async def close(self) -> None:
        try:
            await self.dispatcher.provider.aclose()
            if self.webhooks is not None:
                await self.webhooks.aclose()
        finally:
            if self.dispatcher.direct is not None:
                await self.dispatcher.direct.close()


# How long the claimer waits, once a slot has freed, for half a claim's worth to
# free with it. Each claim is two transactions (the claim and the pre-submit),
# and a claim's answers tend to arrive together and settle in one group: at
# 5 ms a busy worker claimed 6 rows at a time in most drains (5-11), at 20 ms
# 13-15, and its CPU and the server's per payment fell by a third
# (docs/benchmarks.md, step 39). A slot that frees beside calls that hang
# waits this long, never a poll.
CLAIM_COMPANY = timedelta(milliseconds=20)


async def _despite_cancellation(work: asyncio.Future[Any]) -> bool:
    """Wait for `work` to finish even if this task is cancelled meanwhile;
    whether it was (the caller raises CancelledError once it is safe to)."""
    cancelled = False
    while not work.done():
        try:
            await asyncio.shield(work)
        except asyncio.CancelledError:
            cancelled = True
        except Exception:
            break  # the work's own failure: its caller reads it
    return cancelled


async def _finish_started(worker: Worker) -> None:
    """Let every delivery started finish, even if this task is cancelled while
    it waits: a call in flight may have moved money, and its answer is only
    safe once recorded. (Each ends by its call's deadline and one commit.)"""
    if await _despite_cancellation(asyncio.ensure_future(worker.wait_idle())):
        raise asyncio.CancelledError


def _log_failure(failure: BaseException, what: str) -> None:
    if lost_connection(failure):
        # A restart or failover: expected, and met at every poll until a node
        # takes writes again; one line, no traceback.
        log.warning("%s: the database is not answering (%s)", what, type(failure).__name__)
    else:
        log.error("%s", what, exc_info=failure)


async def _pause(stop: asyncio.Event, interval: timedelta) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), interval.total_seconds())


async def run_worker(
    worker: Worker,
    stop: asyncio.Event,
    concurrency: int,
    poll_interval: timedelta,
    sweep_interval: timedelta,
    batch: int = 1,
    reap_interval: timedelta = timedelta(hours=1),
) -> None:
    """Deliver up to `concurrency` rows at once (fewer while the adaptive limit
    says the process or the provider cannot carry them), claiming up to `batch`
    due rows at a time into free slots, and run the sweeper, until `stop` is
    set; then let every delivery started finish."""
    per_claim = max(1, min(batch, concurrency))

    def refill_at(slots: AdaptiveSlots) -> int:
        # A claim for a slot or two at a time would cost a transaction per row
        # under load: with half a claim's worth free, claim at once.
        return max(0, slots.slots - max(1, per_claim // 2))

    async def deliveries(slots: AdaptiveSlots) -> None:
        try:
            while not stop.is_set():
                limit = min(per_claim, slots.free(worker.in_flight))
                if limit <= 0:
                    # Every slot taken (or the limit fell below what runs):
                    # until one frees under the limit.
                    await worker.until_in_flight_at_most(slots.slots - 1, stop, poll_interval)
                    continue
                try:
                    claimed = len(await worker.start_due(limit))
                except Exception as exc:
                    _log_failure(exc, "claiming due rows failed; trying again after the poll")
                    claimed = 0
                if claimed < limit:
                    # Nothing more is due (or the claim failed): look again later.
                    await _pause(stop, poll_interval)
                elif worker.in_flight > refill_at(slots):
                    # Wait for a slot to free, then at most a moment for half a
                    # claim's worth: under load slots free by the dozen and are
                    # claimed together; beside calls that hang, a free slot is
                    # taken after that moment, never after a poll.
                    await worker.until_in_flight_at_most(worker.in_flight - 1, stop, poll_interval)
                    if worker.in_flight > refill_at(slots):
                        await worker.until_in_flight_at_most(refill_at(slots), stop, CLAIM_COMPANY)
        finally:
            await _finish_started(worker)

    async def sweeps() -> None:
        while not stop.is_set():
            try:
                swept = await worker.sweeper.sweep()
                if swept:
                    log.warning("sweeper marked %d stale SUBMITTING operation(s) UNKNOWN", swept)
            except Exception:
                log.exception("sweep failed; trying again next interval")
            await _pause(stop, sweep_interval)

    async def reaps(reaper: Reaper) -> None:
        # Every worker reaps; two at once take disjoint batches (SKIP LOCKED on
        # PostgreSQL, one writer at a time on SQLite), so none needs electing.
        while not stop.is_set():
            await _pause(stop, reap_interval)
            if stop.is_set():
                break
            try:
                await reaper.reap()
            except Exception:
                log.exception("reaping failed; trying again next interval")

    async with LoopLag() as loop_lag, asyncio.TaskGroup() as group:
        # At most `concurrency` rows in flight, fewer while the calls show the
        # process (or the provider) cannot carry them (engine/adaptive_slots.py).
        slots = AdaptiveSlots(ConcurrencyLimit(LimitSettings(max_limit=concurrency)), loop_lag)
        worker.slots = slots
        group.create_task(deliveries(slots))
        group.create_task(sweeps())
        if worker.webhooks is not None:
            group.create_task(worker.webhooks.run(stop, poll_interval))
        if worker.reaper is not None:
            group.create_task(reaps(worker.reaper))
