"""Record retention carried out: `intentledger reap`, and every worker on a
schedule, remove settled operations' bulky rows past the retention in bounded
batches (decision 0018). Each batch is its own short transaction, so reaping a
year of backlog never holds a lock for long; what was removed is counted
(`intentledger_reaped_total`) and logged.

On PostgreSQL a pass also keeps the provider answers' partitions ready (as
wide as the retention calls for: domain/widths.py), and after reaping drops
those past the retention (store/partitions.py): after, so that the operations
reaped in this pass give up their answers in it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta

from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.engine.clock import Clock
from intentledger.observability.metrics import REAPED
from intentledger.store.partitions import ensure_ahead, retire_expired
from intentledger.store.reaping import Reaped, reap_batch

log = logging.getLogger(__name__)

DEFAULT_REAP_BATCH = 500


class Reaper:
    def __init__(
        self,
        engine: AsyncEngine,
        clock: Clock,
        retention: timedelta,
        batch: int = DEFAULT_REAP_BATCH,
    ) -> None:
        self.engine = engine
        self.clock = clock
        self.retention = retention
        self.batch = batch

    async def reap(self, progress: Callable[[Reaped], None] | None = None) -> Reaped:
        """Batches until none is full: everything reapable now is reaped."""
        partitioned = self.engine.dialect.name == "postgresql"
        if partitioned:
            created = await ensure_ahead(self.engine, self.clock(), self.retention)
            if created:
                log.info(
                    "created partition(s) of observation details: %s",
                    ", ".join(created),
                    extra={"event": "partitions_created", "partitions": ", ".join(created)},
                )
        total = Reaped()
        while True:
            async with self.engine.begin() as conn:
                now = self.clock()
                done = await reap_batch(conn, now, now - self.retention, self.batch)
            # Counted once the batch committed.
            REAPED.labels(what="operations").inc(done.operations)
            REAPED.labels(what="observation_details").inc(done.observation_details)
            REAPED.labels(what="outbox_rows").inc(done.outbox_rows)
            total += done
            if progress is not None:
                progress(total)
            if done.operations < self.batch:
                break
        if partitioned:
            now = self.clock()
            retired = await retire_expired(self.engine, now, now - self.retention, self.batch)
            REAPED.labels(what="detail_partitions").inc(retired.partitions_dropped)
            REAPED.labels(what="details_moved_out").inc(retired.details_moved_out)
            total += Reaped(
                detail_partitions=retired.partitions_dropped,
                details_moved_out=retired.details_moved_out,
            )
            if retired.partitions_dropped or retired.details_moved_out:
                log.info(
                    "dropped %d partition(s) of observation details past the record "
                    "retention, %d detail(s) still needed moved out of them first",
                    retired.partitions_dropped,
                    retired.details_moved_out,
                    extra={
                        "event": "reap_partitions",
                        "detail_partitions": retired.partitions_dropped,
                        "details_moved_out": retired.details_moved_out,
                    },
                )
        if total.operations:
            log.info(
                "reaped %d operation(s) past the record retention: %d observation detail(s) "
                "cleared, %d done outbox row(s) deleted",
                total.operations,
                total.observation_details,
                total.outbox_rows,
                extra={
                    "event": "reap",
                    "operations": total.operations,
                    "observation_details": total.observation_details,
                    "outbox_rows": total.outbox_rows,
                },
            )
        return total
