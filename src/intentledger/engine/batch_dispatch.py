"""Batched first attempts: the dispatcher's steps 3-5 for many payments at once.

The common delivery — the first attempt of an ACCEPTED payment — done
set-at-a-time, in the same order and with the same rows as
`Dispatcher.deliver_submit`:

    one pre-submit transaction commits SUBMITTING + attempt 1 for a claim
    -> each provider call runs in its own task, outside any transaction
    -> each answer is recorded as it arrives (engine/settlement_queue.py):
       answers that arrive together settle in one transaction, and none
       waits for another's provider call

Everything else takes the one-at-a-time path, whose rules stay the reference:
a resumed SUBMITTING, a resubmission, a mandate no longer active, a lost lease,
other kinds of operation, and every answer that does not plainly settle its
operation (unknown, not executed, or one arriving after the state moved on).
So the batch never decides anything the reference path would not.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from intentledger.domain.dispatch_plan import (
    FIRST_ATTEMPT,
    AttemptPlan,
    batchable_first_attempt,
    mandate_stop,
    provider_key,
)
from intentledger.domain.states import state_of
from intentledger.domain.transport import ProviderAnswer
from intentledger.engine import changes
from intentledger.engine.dispatcher import Dispatcher, Submission, begin_attempt, request_for
from intentledger.engine.settlement_queue import Prepared, Sent, SettlementQueue, answered_now
from intentledger.observability.logs import log_context
from intentledger.store.batches import BatchLedger
from intentledger.store.direct import LedgerConnection
from intentledger.store.ledger import Ledger
from intentledger.store.records import OutboxRecord

log = logging.getLogger(__name__)


async def deliver_submits(
    dispatcher: Dispatcher,
    rows: Sequence[OutboxRecord],
    settlements: SettlementQueue | None = None,
) -> None:
    """Deliver leased `submit` rows and return when every one is finished: first
    attempts pre-submitted together and each recorded as its answer arrives,
    the rest one by one, all concurrently."""
    queue = settlements or SettlementQueue(dispatcher)
    failures = await asyncio.gather(
        *await start_submits(dispatcher, queue, rows), return_exceptions=True
    )
    for failure in failures:
        if isinstance(failure, Exception):
            log.error("delivery failed; its lease will make it due again", exc_info=failure)


# Told of every first attempt's call as its answer arrives: seconds from send
# to answer, and the answer (the worker's adaptive limit learns from it).
CallObserver = Callable[[float, ProviderAnswer], None]


async def start_submits(
    dispatcher: Dispatcher,
    settlements: SettlementQueue,
    rows: Sequence[OutboxRecord],
    observe: CallObserver | None = None,
) -> list[Coroutine[Any, Any, None]]:
    """Pre-submit the plain first attempts among `rows` in one transaction and
    return one delivery per row, not yet awaited: a first attempt's call and
    the recording of its answer, or the reference path for any other row."""
    prepared, others = await pre_submit(dispatcher, rows)
    deliveries: list[Coroutine[Any, Any, None]] = [
        send_and_record(dispatcher, settlements, item, observe) for item in prepared
    ]
    deliveries.extend(dispatcher.deliver_submit(row) for row in others)
    return deliveries


async def send_and_record(
    dispatcher: Dispatcher,
    settlements: SettlementQueue,
    item: Prepared,
    observe: CallObserver | None = None,
) -> None:
    with log_context(operation_id=item.row.operation_id, attempt=FIRST_ATTEMPT):
        sent_at = answered_now()
        answer = await dispatcher.provider.submit(item.submission.request)
        answered = answered_now()
        if observe is not None:
            observe(answered - sent_at, answer)
        await settlements.record(Sent(item, answer, answered))


async def pre_submit(
    dispatcher: Dispatcher, rows: Sequence[OutboxRecord]
) -> tuple[list[Prepared], list[OutboxRecord]]:
    """Commit SUBMITTING + attempt 1 for every row that is a plain first attempt;
    return those with what to send, and the rows left to the reference path."""
    if not rows:
        return [], []
    return await dispatcher.hot_transaction(lambda conn: _pre_submit_in(dispatcher, conn, rows))


async def _pre_submit_in(
    dispatcher: Dispatcher, conn: LedgerConnection, rows: Sequence[OutboxRecord]
) -> tuple[list[Prepared], list[OutboxRecord]]:
    ledger = BatchLedger(conn)
    now = dispatcher.clock()
    locked = await ledger.lock(row.operation_id for row in rows)
    held = await ledger.leases_held((row.id for row in rows), dispatcher.worker_id, now)
    batch: list[Prepared] = []
    beginning: list[tuple[dict[str, Any], changes.OperationChange]] = []
    others: list[OutboxRecord] = []
    taken: set[str] = set()
    for row in rows:
        operation = locked.operations[row.operation_id]
        mandate = locked.mandates.get(operation.mandate_id) if operation.mandate_id else None
        stop = mandate_stop(
            operation.kind, operation.mandate_id, mandate.status if mandate else None
        )
        plain = (
            row.id in held
            and operation.operation_id not in taken
            and batchable_first_attempt(
                operation.kind,
                state_of(operation.state),
                # Written with attempt 1, by every path that adds attempts, in the
                # same transaction: unset means no attempt was ever committed.
                attempted=operation.first_attempt_at is not None,
                delivered_decision_id=row.decision_id,
                stop=stop,
            )
        )
        if not plain:
            others.append(row)
            continue
        taken.add(operation.operation_id)
        plan = AttemptPlan(FIRST_ATTEMPT, provider_key(operation.operation_id), None)
        attempt, change = begin_attempt(operation, plan, None, now, dispatcher.worker_id)
        submission = Submission(FIRST_ATTEMPT, request_for(operation, plan.key))
        batch.append(Prepared(row, submission, operation.updated(change.values)))
        beginning.append((attempt, change))
    if beginning:
        await ledger.begin_attempts(
            [attempt for attempt, _ in beginning],
            changes.alike([change for _, change in beginning]),
            now,
        )
        await changes.follow(Ledger(conn), [change for _, change in beginning], stage="pre_submit")
    return batch, others
