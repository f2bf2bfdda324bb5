"""Recording first attempts' answers as they arrive, grouped by arrival time.

A provider's answer is known the moment it arrives; until it is committed it
lives only in this process, where a crash turns a known outcome into UNKNOWN
(and a reconciliation, perhaps a person). So an answer never waits for a
sibling's provider call: each call's task hands its answer to this queue and
the queue commits what has arrived — after a short window (a few
milliseconds, like group commit) or as soon as a group is full. Up to two
groups commit at once; while they run, the answers that arrive queue up and
form the next one, so a busy worker commits many answers per round trip and
an idle one each answer within the window. Groups form by arrival only, never by claim:
one may mix answers of many claims, and `BatchLedger.lock` takes its rows in
key order, as every pre-submit does, so two transactions cannot deadlock.

The queue decides nothing itself; it chooses when the group record runs and
with whom. The group record loads, asks the domain and writes once: it
settles in one transaction every answer the funnel settles plainly — a
success or a decline, the operation still exactly as its pre-submit left it.
Every other answer (unknown, not executed, one that arrives after the state
moved on), and every answer of a group whose transaction failed, goes back to
its own task, which records it through `Dispatcher.record`, the reference
path, at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from intentledger.domain.dispatch_plan import FIRST_ATTEMPT
from intentledger.domain.evidence import AttemptFacts, Facts, Limits, Move, SubmitAnswer, judge
from intentledger.domain.quick_init import quick_init
from intentledger.domain.retry_after import parse_retry_after
from intentledger.domain.states import State, state_of
from intentledger.domain.transport import ProviderAnswer, classify
from intentledger.engine import changes
from intentledger.engine.dispatcher import Dispatcher, Submission, as_evidence, submit_result
from intentledger.engine.evidence import settlement
from intentledger.observability import ledger_events
from intentledger.store.batches import BatchLedger
from intentledger.store.direct import LedgerConnection
from intentledger.store.ledger import ConcurrentUpdate, Ledger
from intentledger.store.records import OperationRecord, OutboxRecord

log = logging.getLogger(__name__)

# Answers one transaction settles at most: the group statement stays small
# enough for SQLite's bound parameters and a short lock hold.
MAX_GROUP = 64
# How long the first answer of a group waits for company. The provider's
# answers of a busy worker arrive a fraction of a millisecond apart; 2 ms
# gathers 20-30 of them into one commit against the bench's stand-in and
# 10-12 through its sandbox, which answers in turn (docs/benchmarks.md, steps
# 49 and 50), and is nothing beside a provider call.
DEFAULT_WINDOW = timedelta(milliseconds=2)
# Group commits under way at once (on PostgreSQL; SQLite has one writer): an
# answer arriving just after a group began its commit is not held for that
# commit to end, only for its own. Their
# operations are distinct (one answer per operation in flight) and each locks
# in key order, so two groups wait on each other at most, never deadlock.
GROUPS_IN_FLIGHT = 2


@quick_init
@dataclass(frozen=True)
class Prepared:
    """A first attempt the pre-submit transaction committed, and the operation
    as it left it: if the operation's version is still this one's when the
    answer is recorded, nothing else has touched it in between (every write to
    an unfinished operation is planned by `changes.plan`, which moves the
    version), so this record is what a read of the row would return."""

    row: OutboxRecord
    submission: Submission
    operation: OperationRecord

    @property
    def version(self) -> int:
        return self.operation.version


@quick_init
@dataclass(frozen=True)
class Sent:
    prepared: Prepared
    answer: ProviderAnswer
    # time.monotonic() when the answer arrived: the record delay starts here.
    answered: float

    @property
    def row(self) -> OutboxRecord:
        return self.prepared.row

    @property
    def submission(self) -> Submission:
        return self.prepared.submission


@dataclass
class _Waiting:
    sent: Sent
    # True: settled by its group; False: its task records it on its own.
    settled: asyncio.Future[bool]


class SettlementQueue:
    def __init__(
        self,
        dispatcher: Dispatcher,
        window: timedelta = DEFAULT_WINDOW,
        max_group: int = MAX_GROUP,
    ) -> None:
        self.dispatcher = dispatcher
        self.window = window.total_seconds()
        self.max_group = max_group
        self._waiting: deque[_Waiting] = deque()
        self._committer: asyncio.Task[None] | None = None
        self._company = asyncio.Event()
        # Group commits under way, and how many may be: SQLite takes one writer
        # at a time, and a second group would only sleep in its busy handler,
        # starting later than it would after the first.
        self._groups: set[asyncio.Task[None]] = set()
        one_writer = dispatcher.engine.dialect.name == "sqlite"
        self._groups_in_flight = 1 if one_writer else GROUPS_IN_FLIGHT
        # The loop the queue's committer and groups run on, looked up once: in
        # CPython 3.11 each lookup is a getpid() system call, and this would be
        # one an answer. A queue serves one worker's loop; one that closed
        # (a test's) is let go for the next.
        self._loop: asyncio.AbstractEventLoop | None = None

    async def record(self, sent: Sent) -> None:
        """Commit this answer's outcome: with the answers that arrive beside it
        when it settles plainly, else on its own through the reference path.
        Returns once it is committed; raises if it could not be (the row's
        lease then makes it due again, and the resumed delivery finds it
        SUBMITTING)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            loop = self._loop = asyncio.get_running_loop()
        waiting = _Waiting(sent, loop.create_future())
        self._waiting.append(waiting)
        if len(self._waiting) >= self.max_group:
            self._company.set()
        if self._committer is None or self._committer.done():
            self._committer = asyncio.create_task(self._commit_while_waiting())
        # A cancelled caller (a stopping worker) cancels only this future, and
        # every `set_result` below skips a future already done. Its answer
        # stays where it was, waiting or in its group, and is written if its
        # group settles it; one left to its task is then recorded by no one
        # (the row's lease makes it due again, and the resumed delivery finds
        # it SUBMITTING), as when the wait was shielded. Not `asyncio.shield`,
        # whose second future and callback cost every answer 2-3 µs.
        if await waiting.settled:
            return
        await self.dispatcher.record(sent.row, sent.submission, sent.answer, sent.answered)

    async def _commit_while_waiting(self) -> None:
        try:
            while self._waiting:
                # The oldest answer waits at most the window from its arrival
                # (one that came during the last commit has waited already).
                waited = answered_now() - self._waiting[0].sent.answered
                if waited < self.window and len(self._waiting) < self.max_group:
                    self._company.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._company.wait(), self.window - waited)
                if len(self._groups) >= self._groups_in_flight:
                    # Both commits under way: the next group forms meanwhile.
                    await asyncio.wait(self._groups, return_when=asyncio.FIRST_COMPLETED)
                    continue
                group = self._next_group()
                if group:
                    committing = asyncio.create_task(self._commit(group))
                    self._groups.add(committing)
                    committing.add_done_callback(self._groups.discard)
        finally:
            # Cancelled (the process is going down): every answer still here
            # goes back to its own task, which records it on its own rather
            # than wait for a committer that is gone.
            for waiting in self._waiting:
                if not waiting.settled.done():
                    waiting.settled.set_result(False)
            self._waiting.clear()

    async def _commit(self, group: list[_Waiting]) -> None:
        settled: set[int] = set()
        try:
            settled = await record_together(self.dispatcher, [w.sent for w in group])
        except Exception:
            # One bad row must not keep every answer of the group from the
            # ledger (their leases would expire into resumed deliveries and
            # UNKNOWN): each is recorded on its own.
            log.exception("a group record failed; recording its %d answers alone", len(group))
        finally:
            # Settled by this group, or back to its own task (also when this
            # commit is cancelled: the task then records it on its own).
            for waiting in group:
                if not waiting.settled.done():
                    waiting.settled.set_result(id(waiting.sent) in settled)

    def _next_group(self) -> list[_Waiting]:
        """Up to `max_group` waiting answers, one per operation: a second answer
        for an operation already in the group goes to its own task, where the
        reference path judges it against what the first one wrote."""
        group: list[_Waiting] = []
        operations: set[str] = set()
        while self._waiting and len(group) < self.max_group:
            waiting = self._waiting.popleft()
            if waiting.sent.row.operation_id in operations:
                if not waiting.settled.done():
                    waiting.settled.set_result(False)
            else:
                operations.add(waiting.sent.row.operation_id)
                group.append(waiting)
        return group


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
    answer's task holds)."""
    if state_of(operation.state) is not State.SUBMITTING:
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


async def record_together(dispatcher: Dispatcher, sent: Sequence[Sent]) -> set[int]:
    """Settle, in one transaction, every answer the funnel settles plainly;
    return the `id()`s of those it settled (the others are for the reference
    path).

    On PostgreSQL a group of payments without a mandate is planned from the
    operations as their pre-submits left them, with no read: each change is
    written only where its operation is still at the version it was planned
    from, and the one statement counts the changes it wrote. If any operation
    moved on (a webhook, an operator), nothing of the group is kept and it is
    planned again from its rows read under their locks, as every group is on
    SQLite (whose statement-by-statement write cannot always count) and every
    group with a mandate (whose lock is taken before its operations')."""
    if dispatcher.engine.dialect.name == "postgresql" and all(
        item.prepared.operation.mandate_id is None for item in sent
    ):
        try:
            return await record_group(dispatcher, sent, read_under_lock=False)
        except ConcurrentUpdate:
            ledger_events.group_replanned()
    return await record_group(dispatcher, sent, read_under_lock=True)


async def record_group(
    dispatcher: Dispatcher, sent: Sequence[Sent], *, read_under_lock: bool
) -> set[int]:
    """`record_together`'s transaction, planned from the rows read under their
    locks or (`read_under_lock=False`, only where the write counts what it
    changed) from the records the pre-submits handed on."""
    settled_ids, answered = await dispatcher.hot_transaction(
        lambda conn: _record_group_in(dispatcher, conn, sent, read_under_lock)
    )
    ledger_events.answers_recorded("payment", "grouped", answered)
    return settled_ids


async def _record_group_in(
    dispatcher: Dispatcher, conn: LedgerConnection, sent: Sequence[Sent], read_under_lock: bool
) -> tuple[set[int], list[float]]:
    settled_ids: set[int] = set()
    ledger = BatchLedger(conn)
    now = dispatcher.clock()
    limits = Limits(dispatcher.settings.recheck_backoff)
    if read_under_lock:
        locked = await ledger.lock(item.row.operation_id for item in sent)
        operations = locked.operations
    else:
        # Unlocked until the write, which takes the locks in key order.
        operations = {item.row.operation_id: item.prepared.operation for item in sent}
    observed: list[dict[str, Any]] = []
    settled: list[changes.OperationChange] = []
    delivered: list[int] = []
    answered: list[float] = []
    for item in sent:
        operation = operations[item.row.operation_id]
        answer = item.answer
        classification = classify(answer)
        retry_after = parse_retry_after(answer.retry_after, now)
        evidence = as_evidence(item.submission.attempt_number, answer, classification, retry_after)
        change = _plain_settlement(operation, item, evidence, now, limits, dispatcher.worker_id)
        if change is None:
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
        answered.append(item.answered)
        settled_ids.add(id(item))
    if settled:
        await ledger.settle(
            observed, changes.alike(settled), delivered, now, unlocked=not read_under_lock
        )
        await changes.follow(Ledger(conn), settled, stage="settle")
    return settled_ids, answered


def answered_now() -> float:
    """The instant an answer arrived, on the clock the record delay is measured by."""
    return time.monotonic()
