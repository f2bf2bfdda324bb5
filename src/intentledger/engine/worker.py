"""A worker process's loop: claim a due outbox row, hand it to its handler.

Delivery is at least once: a row whose holder dies falls due again when its
lease runs out, and every handler is idempotent against the operation's state.
The sweeper and the merchant webhooks' sender run beside the delivery loops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from datetime import timedelta

from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.engine.batch_dispatch import deliver_submits
from intentledger.engine.clock import Clock
from intentledger.engine.dispatcher import Dispatcher
from intentledger.engine.reaper import Reaper
from intentledger.engine.reconciler import Reconciler
from intentledger.engine.sweeper import Sweeper
from intentledger.engine.webhook_sender import WebhookSender
from intentledger.observability import ledger_events
from intentledger.observability.logs import log_context
from intentledger.store.batches import BatchLedger
from intentledger.store.database import lost_connection
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

    async def deliver_batch(self, limit: int) -> int:
        """Claim up to `limit` due rows and deliver them: submits through the
        batched first-attempt path, the other kinds one by one, concurrently."""
        async with self.engine.begin() as conn:
            rows = await BatchLedger(conn).claim_outbox_rows(
                self.clock(), self.lease, self.worker_id, limit
            )
            ledger_events.claimed(conn, rows)
        if not rows:
            return 0
        submits = [row for row in rows if row.kind == "submit"]
        others = [row for row in rows if row.kind != "submit"]
        results = await asyncio.gather(
            deliver_submits(self.dispatcher, submits),
            *(self.deliver(row) for row in others),
            return_exceptions=True,
        )
        for failure in results:
            if isinstance(failure, Exception):
                log.error("delivery failed; its lease will make it due again", exc_info=failure)
        return len(rows)

    async def drain(self) -> int:
        """Deliver until nothing is due (tests and the demo use this)."""
        delivered = 0
        while await self.deliver_next():
            delivered += 1
        return delivered

    async def close(self) -> None:
        await self.dispatcher.provider.aclose()
        if self.webhooks is not None:
            await self.webhooks.aclose()


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
    """Deliver up to `concurrency` rows at once, in loops that each claim up to
    `batch` rows at a time, and run the sweeper, until `stop` is set."""
    per_loop = max(1, min(batch, concurrency))

    async def deliveries() -> None:
        while not stop.is_set():
            try:
                delivered = await worker.deliver_batch(per_loop)
            except Exception as exc:
                if lost_connection(exc):
                    # A restart or failover: expected, and every loop meets it
                    # at each poll until a node takes writes again.
                    log.warning(
                        "delivery failed, the database is not answering (%s); "
                        "the rows' leases will make them due again",
                        type(exc).__name__,
                    )
                else:
                    log.exception("delivery failed; the rows' leases will make them due again")
                delivered = 0
            if not delivered:
                await _pause(stop, poll_interval)

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

    async with asyncio.TaskGroup() as group:
        for _ in range(math.ceil(concurrency / per_loop)):
            group.create_task(deliveries())
        group.create_task(sweeps())
        if worker.webhooks is not None:
            group.create_task(worker.webhooks.run(stop, poll_interval))
        if worker.reaper is not None:
            group.create_task(reaps(worker.reaper))
