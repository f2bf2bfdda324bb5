"""A worker process's loop: claim a due outbox row, hand it to its handler.

Delivery is at least once: a row whose holder dies falls due again when its
lease runs out, and every handler is idempotent against the operation's state.
The sweeper runs beside the delivery loops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import timedelta

from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.engine.clock import Clock
from intentledger.engine.dispatcher import Dispatcher
from intentledger.engine.reconciler import Reconciler
from intentledger.engine.sweeper import Sweeper
from intentledger.store.ledger import Ledger

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
    ) -> None:
        self.engine = engine
        self.clock = clock
        self.lease = lease
        self.worker_id = worker_id
        self.dispatcher = dispatcher
        self.reconciler = reconciler
        self.sweeper = sweeper

    async def deliver_next(self) -> bool:
        """Claim and deliver one due outbox row; False when nothing was due."""
        async with self.engine.begin() as conn:
            row = await Ledger(conn).claim_outbox_row(self.clock(), self.lease, self.worker_id)
        if row is None:
            return False
        if row.kind == "submit":
            await self.dispatcher.deliver_submit(row)
        elif row.kind == "reconcile":
            await self.reconciler.deliver_reconcile(row)
        elif row.kind == "audit":
            await self.reconciler.deliver_audit(row)
        else:
            log.error("outbox row %s has unknown kind %r; leaving it leased", row.id, row.kind)
        return True

    async def drain(self) -> int:
        """Deliver until nothing is due (tests and the demo use this)."""
        delivered = 0
        while await self.deliver_next():
            delivered += 1
        return delivered

    async def close(self) -> None:
        await self.dispatcher.provider.aclose()


async def _pause(stop: asyncio.Event, interval: timedelta) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), interval.total_seconds())


async def run_worker(
    worker: Worker,
    stop: asyncio.Event,
    concurrency: int,
    poll_interval: timedelta,
    sweep_interval: timedelta,
) -> None:
    """Run `concurrency` delivery loops and the sweeper until `stop` is set."""

    async def deliveries() -> None:
        while not stop.is_set():
            try:
                delivered = await worker.deliver_next()
            except Exception:
                log.exception("delivery failed; the row's lease will make it due again")
                delivered = False
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

    async with asyncio.TaskGroup() as group:
        for _ in range(concurrency):
            group.create_task(deliveries())
        group.create_task(sweeps())
