"""Intake: an idempotent intent, durable before any provider work (ADR 0005, step 1).

One transaction writes the idempotency record, the operation (ACCEPTED) and its
outbox row. An equal retry returns the original operation; the same key with a
different request is refused. A lost race for the key is retried as a read, so
it becomes a replay or a conflict like any other retry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.states import NextAction, State
from intentledger.engine.clock import Clock
from intentledger.engine.mandates import reserve_for_payment
from intentledger.store.ledger import Ledger, new_operation_id
from intentledger.store.tables import Record

# Losing a unique-key race costs one retry; more than a few means something else.
_MAX_KEY_RACES = 3


class IdempotencyKeyReused(Exception):
    """The key was used for a different request by this actor on this route."""

    def __init__(self, operation_id: str) -> None:
        super().__init__(operation_id)
        self.operation_id = operation_id


@dataclass(frozen=True)
class PaymentIntent:
    actor: str
    route: str
    idempotency_key: str
    request_hash: str
    body: dict[str, Any]  # validated and normalised request body
    provider: str


@dataclass(frozen=True)
class IntakeResult:
    operation: Record | dict[str, Any]
    replayed: bool


def _operation_values(intent: PaymentIntent, now: Any) -> dict[str, Any]:
    return {
        "operation_id": new_operation_id(),
        "idempotency_key": intent.idempotency_key,
        "state": State.ACCEPTED,
        "request_context": {"route": intent.route, "body": intent.body},
        "next_action": NextAction.SUBMIT,
        "actor": intent.actor,
        "route": intent.route,
        "kind": "payment",
        "request_hash": intent.request_hash,
        "provider": intent.provider,
        "amount": intent.body["amount"],
        "currency": intent.body["currency"],
        "mandate_id": intent.body.get("mandate_id"),
        "version": 1,
        "duplicate_detected": False,
        "created_at": now,
        "updated_at": now,
    }


async def accept_payment(engine: AsyncEngine, clock: Clock, intent: PaymentIntent) -> IntakeResult:
    for _ in range(_MAX_KEY_RACES):
        try:
            async with engine.begin() as conn:
                ledger = Ledger(conn)
                existing = await ledger.find_idempotency_record(
                    intent.actor, intent.route, intent.idempotency_key
                )
                if existing is not None:
                    if existing.request_hash != intent.request_hash:
                        raise IdempotencyKeyReused(existing.resource_id)
                    operation = await ledger.get_operation(existing.resource_id)
                    assert operation is not None, "an idempotency record names its operation"
                    return IntakeResult(operation, replayed=True)
                now = clock()
                mandate_id = intent.body.get("mandate_id")
                if mandate_id is not None:
                    # Refused here, nothing is written and the key stays unused.
                    await reserve_for_payment(
                        ledger,
                        intent.actor,
                        mandate_id,
                        intent.body["amount"],
                        intent.body["currency"],
                        now,
                    )
                values = _operation_values(intent, now)
                await ledger.insert_intent(values, outbox_kind="submit", due_at=now)
                await ledger.record_initial_transition(
                    values["operation_id"], now, "intent accepted", source=f"api:{intent.actor}"
                )
                return IntakeResult(values, replayed=False)
        except IntegrityError:
            # Another request with this key committed first: read it next time round.
            continue
    raise RuntimeError("idempotency key race did not settle")
