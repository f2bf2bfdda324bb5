"""Intake: an idempotent intent, durable before any provider work (docs/decisions/0005,
step 1; docs/design.md#intent-before-provider-work).

One transaction writes the idempotency record, the operation (ACCEPTED) and its
outbox row. An equal retry returns the original operation; the same key with a
different request is refused. The key is claimed first, by an INSERT that does
nothing if the key has a record; a request that loses the race for its key
becomes a replay or a conflict like any other retry (`claim_or_replay`). Then
the kind's own checks and writes (`Prepare`), then the rest of the intent's
rows, written by intake's one writer (store/intake.py) as a group of one; a
group of concurrent intents goes through the same writer
(engine/group_intake.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.replay_window import DEFAULT_REPLAY_WINDOW
from intentledger.domain.states import NextAction, State
from intentledger.engine.clock import Clock
from intentledger.engine.mandates import reserve_for_payment
from intentledger.engine.refusal import claim_or_replay
from intentledger.observability import ledger_events
from intentledger.store.direct import engine_connection
from intentledger.store.intake import IntakeLedger
from intentledger.store.ledger import Ledger, new_operation_id
from intentledger.store.records import OperationRecord


@dataclass(frozen=True)
class Intent:
    actor: str
    route: str
    idempotency_key: str
    request_hash: str
    body: dict[str, Any]  # validated and normalised request body
    provider: str
    # payment | beneficiary | card_issue | card_freeze | card_unfreeze
    kind: str = "payment"
    # How long an equal retry of this request's key replays (decision 0018).
    replay_window: timedelta = DEFAULT_REPLAY_WINDOW


# Kind-specific checks and writes inside the intake transaction (a mandate's
# reservation, a card's projection). Raising refuses the request: nothing is
# written and the key stays unused.
Prepare = Callable[[Ledger, datetime, dict[str, Any]], Awaitable[None]]


@dataclass(frozen=True)
class IntakeResult:
    operation: OperationRecord | dict[str, Any]
    replayed: bool
    # The operation's submit row, when the caller holds its lease (synchronous writes).
    held_row_id: int | None = None

    @property
    def operation_id(self) -> str:
        """The operation's id, whether it was just written (a dict) or read back (a row)."""
        operation = self.operation
        return str(
            operation["operation_id"] if isinstance(operation, dict) else operation.operation_id
        )


ACCEPTED_REASON = "intent accepted"


def accepted_by(intent: Intent) -> str:
    """The source of an intent's first transition."""
    return f"api:{intent.actor}"


def operation_values(intent: Intent, now: datetime) -> dict[str, Any]:
    return {
        "operation_id": new_operation_id(),
        "idempotency_key": intent.idempotency_key,
        "state": State.ACCEPTED,
        "request_context": {"route": intent.route, "body": intent.body},
        "next_action": NextAction.SUBMIT,
        "actor": intent.actor,
        "route": intent.route,
        "kind": intent.kind,
        "request_hash": intent.request_hash,
        "provider": intent.provider,
        "amount": intent.body.get("amount"),
        "currency": intent.body.get("currency"),
        "mandate_id": intent.body.get("mandate_id"),
        "parent_operation_id": None,  # a refund's payment, set by its `Prepare`
        "version": 1,
        "duplicate_detected": False,
        "outcome_contradicted": False,
        "created_at": now,
        "updated_at": now,
    }


async def reserve_under_mandate(ledger: Ledger, now: datetime, values: dict[str, Any]) -> None:
    if values["mandate_id"] is not None:
        await reserve_for_payment(
            ledger, values["actor"], values["mandate_id"], values["amount"], values["currency"], now
        )


async def accept(
    engine: AsyncEngine,
    clock: Clock,
    intent: Intent,
    *,
    prepare: Prepare = reserve_under_mandate,
    hold: tuple[str, timedelta] | None = None,
) -> IntakeResult:
    """Make `intent` durable (or find the original). With `hold=(owner, lease)`
    the submit row is created already leased to `owner`, which delivers it in
    the request path; if that process dies, the lease runs out and a worker's
    resumed delivery (or the sweeper) makes the outcome UNKNOWN."""

    async with engine.begin() as conn:
        ledger = Ledger(conn)
        now = clock()
        values = operation_values(intent, now)
        original = await claim_or_replay(
            ledger,
            intent.actor,
            intent.route,
            intent.idempotency_key,
            intent.request_hash,
            values["operation_id"],
            now,
            intent.replay_window,
        )
        if original is not None:
            operation = await ledger.get_operation(original)
            assert operation is not None, "an idempotency record names its operation"
            return IntakeResult(operation, replayed=True)
        await prepare(ledger, now, values)
        row_id = await write_accepted(
            ledger, values, accepted_by(intent), ACCEPTED_REASON, now, hold=hold
        )
        return IntakeResult(values, replayed=False, held_row_id=row_id if hold else None)


async def write_accepted(
    ledger: Ledger,
    values: dict[str, Any],
    by: str,
    reason: str,
    now: datetime,
    *,
    hold: tuple[str, timedelta] | None = None,
) -> int:
    """One accepted operation, its first transition and its submit row (the
    store's one accept path), announced as a transition into ACCEPTED. The id
    of the submit row."""
    row_id = await IntakeLedger(engine_connection(ledger.conn)).accept_one(
        values, by, reason, now, hold=hold
    )
    ledger_events.transition(
        ledger.conn, values["operation_id"], None, State.ACCEPTED, NextAction.SUBMIT, reason
    )
    return row_id
