"""Group commit for intake: concurrent payment intents share one transaction.

Every intent still gets exactly the rows `accept()` writes — its idempotency
record (claimed first), its ACCEPTED operation, its due outbox row and its
first transition, written by the same writer (store/intake.py) — and its
request still answers only after the commit that made those rows durable.
What changes is that one commit makes a whole group durable: while a group's
transaction runs, the intents that arrive queue up and form the next group,
so a busy process commits often-many intents per round trip and an idle one
commits each intent at once.

On PostgreSQL the writer is one statement, which is a transaction by itself:
given a `group_statement` (store/group_statement.py), it goes over that
connection of its own in autocommit, one round trip where the pool's
pre-ping, BEGIN, the statement and COMMIT were four. Retries among the
group's intents are then judged on the ledger engine, after the commit, as
any retry reads what committed before it.

Intents with work of their own inside the transaction (a mandate's reservation)
take `accept()` itself. If a group's transaction fails, each of its intents is
tried on its own with `accept()` on the ledger engine, so one bad intent (or a
pooled connection that died) cannot fail the others. A group can also fail
after it committed (its connection lost on the way back, the retries' judging
failing): then `accept()` finds the intent's own record, and the operation it
replays is the one the group minted for this very request, so the request is
answered as the first one it is (202, not a replay).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.states import State
from intentledger.engine.clock import Clock
from intentledger.engine.intake import (
    ACCEPTED_REASON,
    IntakeResult,
    Intent,
    accept,
    accepted_by,
    operation_values,
)
from intentledger.engine.refusal import Refusal, replay_of
from intentledger.observability import ledger_events
from intentledger.store.group_statement import GroupStatement
from intentledger.store.intake import IntakeLedger

log = logging.getLogger(__name__)

MAX_GROUP = 64

Key = tuple[str, str, str]  # actor, route, Idempotency-Key


@dataclass
class _Waiting:
    intent: Intent
    answer: asyncio.Future[IntakeResult] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    # The operation id its group tried to create for it (None before a try).
    minted: str | None = None

    @property
    def key(self) -> Key:
        return (self.intent.actor, self.intent.route, self.intent.idempotency_key)

    def own_write(self, outcome: IntakeResult | BaseException) -> IntakeResult | BaseException:
        """`outcome` of accepting this intent on its own after its group failed:
        a "replay" of the operation its group minted for it is its own first
        write, which the group committed before failing."""
        if (
            isinstance(outcome, IntakeResult)
            and outcome.replayed
            and outcome.operation_id == self.minted
        ):
            return IntakeResult(outcome.operation, replayed=False)
        return outcome

    def settle(self, outcome: IntakeResult | BaseException) -> None:
        if self.answer.done():  # its request went away; the intent stays durable
            return
        if isinstance(outcome, BaseException):
            self.answer.set_exception(outcome)
        else:
            self.answer.set_result(outcome)


class IntakeGroups:
    def __init__(
        self,
        engine: AsyncEngine,
        clock: Clock,
        max_group: int = MAX_GROUP,
        group_statement: GroupStatement | None = None,
    ) -> None:
        self.engine = engine
        self.group_statement = group_statement
        self.clock = clock
        self.max_group = max_group
        self._waiting: deque[_Waiting] = deque()
        self._committer: asyncio.Task[None] | None = None

    async def accept(self, intent: Intent) -> IntakeResult:
        """`accept(engine, clock, intent)`, committed together with concurrent intents."""
        if intent.body.get("mandate_id") is not None:
            return await accept(self.engine, self.clock, intent)
        waiting = _Waiting(intent)
        self._waiting.append(waiting)
        if self._committer is None or self._committer.done():
            self._committer = asyncio.create_task(self._commit_while_waiting())
        return await waiting.answer

    async def _commit_while_waiting(self) -> None:
        while self._waiting:
            group = self._next_group()
            try:
                outcomes = await self._commit(group)
            except Exception:
                log.exception(
                    "a grouped intake failed; trying its %d intents one by one", len(group)
                )
                alone = await asyncio.gather(
                    *(accept(self.engine, self.clock, w.intent) for w in group),
                    return_exceptions=True,
                )
                outcomes = [w.own_write(o) for w, o in zip(group, alone, strict=True)]
            for waiting, outcome in zip(group, outcomes, strict=True):
                waiting.settle(outcome)

    def _next_group(self) -> list[_Waiting]:
        """Up to `max_group` waiting intents, one per key: a second request with
        a key already in the group waits for the next one, where it finds the
        first one's record (a replay or a conflict, like any retry)."""
        group: list[_Waiting] = []
        keys: set[Key] = set()
        later: list[_Waiting] = []
        while self._waiting and len(group) < self.max_group:
            waiting = self._waiting.popleft()
            if waiting.key in keys:
                later.append(waiting)
            else:
                keys.add(waiting.key)
                group.append(waiting)
        self._waiting.extendleft(reversed(later))
        return group

    async def _commit(self, group: list[_Waiting]) -> list[IntakeResult | BaseException]:
        now = self.clock()
        values = [operation_values(w.intent, now) for w in group]
        for w, v in zip(group, values, strict=True):
            w.minted = v["operation_id"]
        accepted = [(v, accepted_by(w.intent)) for w, v in zip(group, values, strict=True)]
        outcomes: dict[int, IntakeResult | BaseException] = {}
        statement = self.group_statement
        if statement is not None:
            claimed = await statement.accept_group(accepted, ACCEPTED_REASON, now)
            # Committed by the statement itself: counted now.
            ledger_events.transitions_committed(
                None, State.ACCEPTED, len(claimed), "intake", group_size=len(group)
            )
            self._new_intents(group, values, claimed, outcomes)
            if len(claimed) < len(group):
                async with self.engine.connect() as conn:
                    await self._judge_retries(
                        IntakeLedger(conn), group, claimed, values, outcomes, now
                    )
        else:
            async with self.engine.begin() as conn:
                ledger = IntakeLedger(conn)
                claimed = await ledger.accept_group(accepted, ACCEPTED_REASON, now)
                # The group is every intent in the transaction; the new ones made transitions.
                ledger_events.transitions(
                    conn, None, State.ACCEPTED, len(claimed), "intake", group_size=len(group)
                )
                self._new_intents(group, values, claimed, outcomes)
                if len(claimed) < len(group):
                    await self._judge_retries(ledger, group, claimed, values, outcomes, now)
        return [outcomes[id(w)] for w in group]

    @staticmethod
    def _new_intents(
        group: list[_Waiting],
        values: list[dict[str, object]],
        claimed: set[str],
        outcomes: dict[int, IntakeResult | BaseException],
    ) -> None:
        for w, v in zip(group, values, strict=True):
            if v["operation_id"] in claimed:
                outcomes[id(w)] = IntakeResult(v, replayed=False)

    @staticmethod
    async def _judge_retries(
        ledger: IntakeLedger,
        group: list[_Waiting],
        claimed: set[str],
        values: list[dict[str, object]],
        outcomes: dict[int, IntakeResult | BaseException],
        now: datetime,
    ) -> None:
        """Intents whose key already had a record: a replay of what the equal
        earlier request made, or a refusal when the request differs."""
        retries = [
            w for w, v in zip(group, values, strict=True) if v["operation_id"] not in claimed
        ]
        records = await ledger.idempotency_records([w.key for w in retries])
        originals: dict[int, str] = {}
        for waiting in retries:
            record = records.get(waiting.key)
            if record is None:
                # Records are never deleted: a key that could not be claimed has one.
                raise RuntimeError(f"no idempotency record for a taken key {waiting.key}")
            try:
                originals[id(waiting)] = replay_of(
                    record, waiting.intent.request_hash, now, waiting.intent.replay_window
                )
            except Refusal as refusal:
                outcomes[id(waiting)] = refusal
        found = await ledger.operations(list(originals.values()))
        for waiting in retries:
            if id(waiting) in originals:
                outcomes[id(waiting)] = IntakeResult(found[originals[id(waiting)]], replayed=True)
