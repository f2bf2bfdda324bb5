"""Writes that must finish in the request path: beneficiaries and card actions.

Same rule as the dispatcher, inside the request: the intent is made durable
with its submit row already leased to this API process, then this process
delivers that very row through the dispatcher (commit SUBMITTING, call,
record). If the process dies mid-call, the row's lease runs out and the
sweeper or a worker's resumed delivery makes the outcome UNKNOWN; nothing
ever calls the provider a second time on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.engine.clock import Clock
from intentledger.engine.dispatcher import Dispatcher
from intentledger.engine.intake import Intent, Prepare, accept, reserve_under_mandate
from intentledger.engine.refusal import Refusal
from intentledger.store.ledger import Ledger
from intentledger.store.records import OperationRecord

# Seconds a client is asked to wait before retrying a request still in progress.
IN_PROGRESS_RETRY_AFTER = 1


@dataclass(frozen=True)
class WriteResult:
    operation: OperationRecord
    replayed: bool


class SyncWriter:
    def __init__(
        self, engine: AsyncEngine, clock: Clock, dispatcher: Dispatcher, lease: timedelta
    ) -> None:
        self.engine = engine
        self.clock = clock
        self.dispatcher = dispatcher
        self.lease = lease

    async def write(self, intent: Intent, prepare: Prepare = reserve_under_mandate) -> WriteResult:
        result = await accept(
            self.engine,
            self.clock,
            intent,
            prepare=prepare,
            hold=(self.dispatcher.worker_id, self.lease),
        )
        operation_id = result.operation_id
        if result.replayed:
            await self._refuse_while_in_progress(operation_id)
        else:
            assert result.held_row_id is not None
            async with self.engine.connect() as conn:
                row = await Ledger(conn).get_outbox_row(result.held_row_id)
            assert row is not None
            await self.dispatcher.deliver_submit(row)
        async with self.engine.connect() as conn:
            operation = await Ledger(conn).get_operation(operation_id)
        assert operation is not None
        return WriteResult(operation, result.replayed)

    async def _refuse_while_in_progress(self, operation_id: str) -> None:
        """An equal retry while the original request still waits on the provider
        gets no half-made answer: 409, ask again shortly (as the IETF draft and
        Stripe do). Once the original has answered, retries replay."""
        async with self.engine.connect() as conn:
            waiting = await Ledger(conn).held_by_a_request(operation_id, self.clock())
        if waiting:
            raise Refusal(
                409,
                "request-in-progress",
                "the original request with this Idempotency-Key is still being processed; "
                "retry shortly",
                retry_after_seconds=IN_PROGRESS_RETRY_AFTER,
            )
