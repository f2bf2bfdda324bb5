"""The reads the entry points render: the API's documents and the console's
pages ask here, so neither opens a connection nor builds a repository itself.

Each function reads its parts on one connection, back to back, as the routes
and pages did when they read the store themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.work_queue import Cursor
from intentledger.store import work_queue as queue_store
from intentledger.store.database import ping
from intentledger.store.ledger import Ledger
from intentledger.store.records import (
    AttemptRecord,
    CardRecord,
    ListedDeliveryRecord,
    MandateRecord,
    MerchantEventRecord,
    ObservationWithDetailRecord,
    OperationRecord,
    QueueRow,
    TimelineRecord,
    WebhookAttemptRecord,
    WebhookEndpointRecord,
)
from intentledger.store.tables import ACTOR_LENGTH
from intentledger.store.work_queue import QueueFilter, QueuePage

__all__ = [
    "ACTOR_LENGTH",
    "CardRecord",
    "CardView",
    "ListedDeliveryRecord",
    "MandateRecord",
    "MandateView",
    "MerchantEventRecord",
    "OperationRecord",
    "OperationView",
    "QueueFilter",
    "QueuePage",
    "QueueRow",
    "Surroundings",
    "WebhookAttemptRecord",
    "WebhookEndpointRecord",
    "card_of",
    "card_view",
    "cards",
    "check_database",
    "first_use_of_key",
    "mandate_view",
    "mandates",
    "operation_events",
    "operation_view",
    "payment_refunds",
    "queue",
    "surroundings",
]


@dataclass(frozen=True)
class OperationView:
    operation: OperationRecord
    attempts: Sequence[AttemptRecord]
    submit_results: Sequence[ObservationWithDetailRecord]
    refunds: Sequence[OperationRecord]


async def check_database(engine: AsyncEngine) -> None:
    """Raise unless the database answers."""
    async with engine.connect() as conn:
        await ping(conn)


async def operation_view(engine: AsyncEngine, operation_id: str) -> OperationView | None:
    """The record with its attempts, their results and (for a payment) its refunds."""
    async with engine.connect() as conn:
        ledger = Ledger(conn)
        operation = await ledger.get_operation(operation_id)
        if operation is None:
            return None
        attempts = await ledger.attempts_of(operation_id)
        results = await ledger.submit_results_of(operation_id)
        refunds = await ledger.refunds_of(operation_id) if operation.kind == "payment" else ()
    return OperationView(operation, attempts, results, refunds)


async def operation_events(
    engine: AsyncEngine, operation_id: str
) -> tuple[OperationRecord, list[tuple[str, TimelineRecord]]] | None:
    """The record and its tagged timeline, or None for no such operation."""
    async with engine.connect() as conn:
        ledger = Ledger(conn)
        operation = await ledger.get_operation(operation_id)
        if operation is None:
            return None
        return operation, await ledger.events_of(operation_id)


async def payment_refunds(
    engine: AsyncEngine, payment_id: str
) -> tuple[OperationRecord, Sequence[OperationRecord]] | None:
    """The operation and its refunds, or None for no such operation."""
    async with engine.connect() as conn:
        ledger = Ledger(conn)
        payment = await ledger.get_operation(payment_id)
        if payment is None:
            return None
        return payment, await ledger.refunds_of(payment_id)


async def card_of(engine: AsyncEngine, card_id: str) -> CardRecord | None:
    async with engine.connect() as conn:
        return await Ledger(conn).get_card(card_id)


async def first_use_of_key(engine: AsyncEngine, operation_id: str, key: str) -> datetime:
    """When the operation first sent this provider idempotency key."""
    async with engine.connect() as conn:
        return await Ledger(conn).first_use_of_key(operation_id, key)


async def queue(
    engine: AsyncEngine,
    now: datetime,
    waiting_threshold: timedelta,
    chosen: QueueFilter,
    cursor: Cursor | None,
    page_size: int,
) -> tuple[QueuePage, list[str]]:
    """One page of the operator's work queue, and the providers it may be filtered by."""
    async with engine.connect() as conn:
        page = await queue_store.work_queue(conn, now, waiting_threshold, chosen, cursor, page_size)
        return page, await queue_store.queue_providers(conn)


@dataclass(frozen=True)
class Surroundings:
    """What an operation's page shows beside its own record."""

    merchant_events: Sequence[MerchantEventRecord]
    mandate: MandateRecord | None
    card: CardRecord | None


async def surroundings(engine: AsyncEngine, operation: OperationRecord) -> Surroundings:
    async with engine.connect() as conn:
        ledger = Ledger(conn)
        events = await queue_store.merchant_events_of(conn, operation.operation_id)
        mandate = await ledger.get_mandate(operation.mandate_id) if operation.mandate_id else None
        card_id = (
            operation.request_context.get("card_id") if operation.kind.startswith("card") else None
        )
        card = await ledger.get_card(card_id) if isinstance(card_id, str) else None
    return Surroundings(events, mandate, card)


async def mandates(
    engine: AsyncEngine, status: str | None, actor: str | None, after: str | None, limit: int
) -> Sequence[MandateRecord]:
    async with engine.connect() as conn:
        return await queue_store.list_mandates(conn, status, actor, after, limit)


@dataclass(frozen=True)
class MandateView:
    mandate: MandateRecord
    open_operations: Sequence[QueueRow]
    merchant_events: Sequence[MerchantEventRecord]


async def mandate_view(engine: AsyncEngine, mandate_id: str, limit: int) -> MandateView | None:
    """The mandate, up to `limit` of its open operations and its announced events."""
    async with engine.connect() as conn:
        mandate = await Ledger(conn).get_mandate(mandate_id)
        if mandate is None:
            return None
        open_operations = await queue_store.open_operations_of_mandate(conn, mandate_id, limit)
        events = await queue_store.merchant_events_of(conn, mandate_id)
    return MandateView(mandate, open_operations, events)


async def cards(
    engine: AsyncEngine,
    indeterminate: bool | None,
    actor: str | None,
    after: str | None,
    limit: int,
) -> Sequence[CardRecord]:
    async with engine.connect() as conn:
        return await queue_store.list_cards(conn, indeterminate, actor, after, limit)


@dataclass(frozen=True)
class CardView:
    card: CardRecord
    merchant_events: Sequence[MerchantEventRecord]


async def card_view(engine: AsyncEngine, card_id: str) -> CardView | None:
    async with engine.connect() as conn:
        card = await Ledger(conn).get_card(card_id)
        if card is None:
            return None
        events = await queue_store.merchant_events_of(conn, card_id)
    return CardView(card, events)
