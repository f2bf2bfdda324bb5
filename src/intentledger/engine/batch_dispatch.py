"""Batched first attempts: the dispatcher's steps 3-5 for many payments at once.

The common delivery — the first attempt of an ACCEPTED payment — done
set-at-a-time, in the same order and with the same rows as
`Dispatcher.deliver_submit`:

    one pre-submit transaction commits SUBMITTING + attempt 1 for the batch
    -> the provider calls run concurrently, outside any transaction
    -> one record transaction settles every answer that settles plainly

Everything else takes the one-at-a-time path, whose rules stay the reference:
a resumed SUBMITTING, a resubmission, a mandate no longer active, a lost lease,
other kinds of operation, and every answer that does not plainly settle its
operation (unknown, not executed, or one arriving after the state moved on).
So the batch never decides anything the reference path would not.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from intentledger.domain.dispatch_plan import (
    FIRST_ATTEMPT,
    AttemptPlan,
    batchable_first_attempt,
    mandate_stop,
    provider_key,
)
from intentledger.domain.evidence import AttemptFacts, Facts, Limits, Move, SubmitAnswer, judge
from intentledger.domain.retry_after import parse_retry_after
from intentledger.domain.states import State
from intentledger.domain.transport import ProviderAnswer, classify
from intentledger.engine import changes
from intentledger.engine.dispatcher import (
    Dispatcher,
    Submission,
    as_evidence,
    begin_attempt,
    request_for,
    submit_result,
)
from intentledger.engine.evidence import settlement
from intentledger.store.batches import BatchLedger
from intentledger.store.ledger import Ledger
from intentledger.store.records import OperationRecord, OutboxRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prepared:
    """A first attempt the pre-submit transaction committed, and the operation's
    version it left behind: if the version is still that when the answer is
    recorded, nothing else has touched the operation in between."""

    row: OutboxRecord
    submission: Submission
    version: int


@dataclass(frozen=True)
class Sent:
    prepared: Prepared
    answer: ProviderAnswer

    @property
    def row(self) -> OutboxRecord:
        return self.prepared.row

    @property
    def submission(self) -> Submission:
        return self.prepared.submission


async def deliver_submits(dispatcher: Dispatcher, rows: Sequence[OutboxRecord]) -> None:
    """Deliver leased `submit` rows; first attempts together, the rest one by one."""
    batch, others = await _pre_submit(dispatcher, rows)
    sending = asyncio.create_task(_send_all(dispatcher, batch))
    one_by_one = await asyncio.gather(
        *(dispatcher.deliver_submit(row) for row in others), return_exceptions=True
    )
    for failure in one_by_one:
        if isinstance(failure, Exception):
            log.error("delivery failed; its lease will make it due again", exc_info=failure)
    sent = await sending
    await _record(dispatcher, sent)


async def _send_all(dispatcher: Dispatcher, batch: Sequence[Prepared]) -> list[Sent]:
    answers = await asyncio.gather(
        *(dispatcher.provider.submit(item.submission.request) for item in batch)
    )
    return [Sent(item, answer) for item, answer in zip(batch, answers, strict=True)]


async def _pre_submit(
    dispatcher: Dispatcher, rows: Sequence[OutboxRecord]
) -> tuple[list[Prepared], list[OutboxRecord]]:
    """Commit SUBMITTING + attempt 1 for every row that is a plain first attempt;
    return those with what to send, and the rows left to the reference path."""
    if not rows:
        return [], []
    async with dispatcher.engine.begin() as conn:
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
                    State(operation.state),
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
            batch.append(Prepared(row, submission, operation.version + 1))
            beginning.append((attempt, change))
        if beginning:
            await ledger.begin_attempts(
                [attempt for attempt, _ in beginning],
                changes.alike([change for _, change in beginning]),
                now,
            )
            await changes.follow(
                Ledger(conn), [change for _, change in beginning], stage="pre_submit"
            )
    return batch, others


def _plain_settlement(
    operation: OperationRecord,
    item: Sent,
    evidence: SubmitAnswer,
    now: datetime,
    limits: Limits,
    source: str,
) -> changes.OperationChange | None:
    """The change the funnel makes of this answer, if it settles the operation
    with nothing but the outcome; only for an operation still as our pre-submit
    left it (one attempt, no other evidence: what the ledger knows is what this
    batch holds)."""
    if State(operation.state) is not State.SUBMITTING:
        return None
    if operation.version != item.prepared.version:
        return None
    facts = Facts(
        state=State.SUBMITTING,
        attempts=(AttemptFacts(FIRST_ATTEMPT, item.submission.key),),
        unresolved_since=operation.first_attempt_at,
    )
    effect = judge(facts, evidence, now, limits)
    plain = (
        effect.move is Move.SETTLE
        and not (effect.duplicate or effect.contradiction or effect.verify)
        and effect.adopt_reference == evidence.reference
    )
    return settlement(operation, facts, effect, now=now, source=source) if plain else None


async def _record(dispatcher: Dispatcher, sent: Sequence[Sent]) -> None:
    if not sent:
        return
    try:
        rest = await _record_together(dispatcher, sent)
    except Exception:
        # One bad row must not turn every answer of the batch into UNKNOWN (their
        # leases would expire into resumed deliveries): record each on its own.
        log.exception("batch record failed; recording its %d answers one by one", len(sent))
        rest = list(sent)
    for item in rest:
        try:
            await dispatcher.record(item.row, item.submission, item.answer)
        except Exception:
            log.exception("recording %s failed; its lease will make it due again", item.row.id)


async def _record_together(dispatcher: Dispatcher, sent: Sequence[Sent]) -> list[Sent]:
    """Settle, in one transaction, every answer the funnel settles plainly; return
    the others for the one-by-one path."""
    rest: list[Sent] = []
    async with dispatcher.engine.begin() as conn:
        ledger = BatchLedger(conn)
        now = dispatcher.clock()
        limits = Limits(dispatcher.settings.recheck_backoff)
        locked = await ledger.lock(item.row.operation_id for item in sent)
        observed: list[dict[str, Any]] = []
        settled: list[changes.OperationChange] = []
        delivered: list[int] = []
        for item in sent:
            operation = locked.operations[item.row.operation_id]
            answer = item.answer
            classification = classify(answer)
            retry_after = parse_retry_after(answer.retry_after, now)
            evidence = as_evidence(
                item.submission.attempt_number, answer, classification, retry_after
            )
            change = _plain_settlement(operation, item, evidence, now, limits, dispatcher.worker_id)
            if change is None:
                rest.append(item)
                continue
            observed.append(
                submit_result(
                    operation,
                    now,
                    dispatcher.worker_id,
                    item.submission.attempt_number,
                    answer,
                    classification,
                    retry_after,
                )
            )
            settled.append(change)
            delivered.append(item.row.id)
        if settled:
            await ledger.settle(observed, changes.alike(settled), delivered, now)
            await changes.follow(Ledger(conn), settled, stage="settle")
    return rest
