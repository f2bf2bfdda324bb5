"""The sweeper: SUBMITTING for too long means the caller died mid-call.

A process that committed SUBMITTING and vanished left an operation whose
provider call may or may not have executed. The sweeper makes that visible as
UNKNOWN (with a check scheduled); it never sends anything again.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from datetime import timedelta

from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.evidence import Limits, SubmitAnswer
from intentledger.domain.states import State
from intentledger.domain.transport import Verdict
from intentledger.engine import changes
from intentledger.engine.clock import Clock
from intentledger.engine.evidence import weigh
from intentledger.observability import ledger_events
from intentledger.store.ledger import Ledger

BATCH = 100


class Sweeper:
    def __init__(
        self,
        engine: AsyncEngine,
        clock: Clock,
        stale_after: timedelta,
        recheck_backoff: timedelta,
        worker_id: str,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self.engine = engine
        self.clock = clock
        self.stale_after = stale_after
        self.recheck_backoff = recheck_backoff
        self.worker_id = worker_id
        self.jitter = jitter

    async def sweep(self) -> int:
        """Mark every stale SUBMITTING operation UNKNOWN; return how many."""
        cutoff = self.clock() - self.stale_after
        async with self.engine.connect() as conn:
            candidates = await Ledger(conn).stale_submitting(cutoff, BATCH)
        swept = 0
        for operation_id in candidates:
            async with self.engine.begin() as conn:
                ledger = Ledger(conn)
                now = self.clock()
                operation = await ledger.lock_operation(operation_id)
                cutoff = now - self.stale_after
                if operation is None or operation.state != State.SUBMITTING:
                    continue
                if operation.updated_at > cutoff:
                    continue
                attempt = await ledger.last_attempt(operation_id)
                assert attempt is not None, "SUBMITTING is committed with its attempt"
                reason = (
                    f"SUBMITTING since {operation.updated_at.isoformat()}, longer than "
                    f"{self.stale_after}: the caller died mid-call; not sending again"
                )
                planned = changes.Writes(now)
                observation = planned.observe(
                    operation_id=operation_id,
                    actor=operation.actor,
                    at=now,
                    kind="sweeper",
                    source=self.worker_id,
                    attempt_number=attempt.number,
                    verdict=Verdict.UNKNOWN,
                    reason=reason,
                )
                # No answer is evidence of nothing: the funnel makes it UNKNOWN.
                await weigh(
                    ledger,
                    operation,
                    SubmitAnswer(attempt.number, Verdict.UNKNOWN, reason),
                    now=now,
                    limits=Limits(self.recheck_backoff, jitter=self.jitter()),
                    source=self.worker_id,
                    observation_id=observation,
                    writes=planned,
                )
                ledger_events.swept(conn, operation_id, attempt.number)
                swept += 1
        return swept
