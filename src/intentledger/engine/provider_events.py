"""Provider webhooks as evidence: a provider's signed word about one of its objects.

`POST /v1/provider-webhooks/{provider}` hands the raw body to the adapter,
which verifies its signature and reads the event (`WebhookReader`). Here, in
one transaction under the operation's lock, the event is stored once by its
id and, when it names an operation of ours at this provider and the adapter
maps its type, recorded as an observation and judged by the evidence funnel
like any other evidence (`domain.evidence.ProviderNotice`): it may settle the
operation or raise a flag, and never sends anything.

A redelivery (the same event id) finds its row and changes nothing; an event
about a reference we do not know is stored and reported, and acknowledged so
the provider stops retrying. So is an event about another kind of object than
the operation it names (`wrong_kind`: a charge's event naming a refund or a
card of ours, or a refund's naming a payment; domain/evidence.py, `speaks_for`):
it is never judged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.evidence import (
    Limits,
    Move,
    NamedOperation,
    ProviderNotice,
    event_disposition,
    flag_reason,
)
from intentledger.engine import changes
from intentledger.engine.clock import Clock
from intentledger.engine.evidence import weigh
from intentledger.observability.metrics import PROVIDER_EVENTS_FLAGGED
from intentledger.providers.base import WebhookEvent
from intentledger.store import provider_events as event_store
from intentledger.store.ledger import OPERATION_ID, Ledger
from intentledger.store.records import OperationRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Receipt:
    event_id: str
    # applied | recorded | flagged | unknown_reference | unmapped_type | wrong_kind
    disposition: str
    duplicate: bool
    operation_id: str | None = None


async def receive(
    engine: AsyncEngine, clock: Clock, provider: str, event: WebhookEvent, backoff: timedelta
) -> Receipt:
    """Store `event` once and let the funnel judge it; see the module docstring."""
    async with engine.begin() as conn:
        ledger = Ledger(conn)
        now = clock()
        operation = await _ours(ledger, provider, event.reference)
        named = _named(operation)
        disposition: str = event_disposition(
            object_id=event.object_id,
            status=event.status,
            needs_person=event.needs_person,
            object_kind=event.object_kind,
            amount=event.amount,
            operation=named,
        )
        why: str | None = None  # for a flagged event: why a person must see it
        stored = await event_store.store_once(
            conn,
            provider=provider,
            event_id=event.event_id,
            type=event.type,
            received_at=now,
            signed_at=event.signed_at,
            object_id=event.object_id,
            reference=event.reference,
            operation_id=operation.operation_id if operation is not None else None,
            disposition=disposition,
            payload=event.payload,
        )
        if not stored:
            # Stored before (a redelivery, or the same event racing itself): once is enough.
            row = await event_store.stored_event(conn, provider, event.event_id)
            return Receipt(event.event_id, row.disposition, True, row.operation_id)
        if disposition == "recorded":
            assert operation is not None
            disposition = await _judge(ledger, operation, provider, event, now, backoff)
            await event_store.set_disposition(conn, provider, event.event_id, disposition)
        elif disposition == "flagged":
            assert operation is not None and named is not None
            why = flag_reason(
                event_type=event.type, status=event.status, amount=event.amount, operation=named
            )
            await _flag(ledger, operation, provider, event, now, why)
    if disposition == "unknown_reference":
        log.warning(
            "provider %s event %s (%s) names no operation of ours: %r; stored, acknowledged",
            provider,
            event.event_id,
            event.type,
            event.reference,
        )
    elif disposition == "flagged":
        assert operation is not None
        log.warning(
            "provider %s event %s (%s) about %s %s needs a person (%s): recorded on it, "
            "changes nothing",
            provider,
            event.event_id,
            event.type,
            operation.kind,
            operation.operation_id,
            why,
            extra={"event": "provider_event.flagged", "provider": provider, "reason": why},
        )
        PROVIDER_EVENTS_FLAGGED.labels(provider).inc()
    elif disposition == "wrong_kind":
        assert operation is not None
        log.warning(
            "provider %s event %s (%s) is about a %s but names %s %s; stored, not judged, "
            "acknowledged",
            provider,
            event.event_id,
            event.type,
            event.object_kind or "object of no declared kind",
            operation.kind,
            operation.operation_id,
        )
    return Receipt(
        event.event_id,
        disposition,
        False,
        operation.operation_id if operation is not None else None,
    )


async def _ours(ledger: Ledger, provider: str, reference: str | None) -> OperationRecord | None:
    """The operation the event names, if it is ours and was sent to this provider."""
    if reference is None or not OPERATION_ID.fullmatch(reference):
        return None
    operation = await ledger.lock_operation(reference)
    if operation is None or operation.provider != provider:
        return None
    return operation


def _named(operation: OperationRecord | None) -> NamedOperation | None:
    """What the domain weighs of the operation an event names."""
    if operation is None:
        return None
    return NamedOperation(operation.kind, operation.amount, operation.currency)


async def _flag(
    ledger: Ledger,
    operation: OperationRecord,
    provider: str,
    event: WebhookEvent,
    now: datetime,
    why: str,
) -> None:
    """An event a person must see on the operation it names (a chargeback, or
    an outcome for another amount than the operation's): an observation in its
    history, and nothing judged."""
    planned = changes.Writes(now)
    planned.observe(
        operation_id=operation.operation_id,
        actor=operation.actor,
        at=now,
        kind="provider_event",
        source=f"webhook:{provider}",
        verdict="flagged",
        reason=f"{event.type} {event.event_id} about {event.object_id}, for a person: {why}",
        provider_reference=event.object_id,
        detail={
            "event_id": event.event_id,
            "type": event.type,
            "signed_at": event.signed_at.isoformat(),
            "needs_person": True,
        },
    )
    await planned.save(ledger)


async def _judge(
    ledger: Ledger,
    operation: OperationRecord,
    provider: str,
    event: WebhookEvent,
    now: datetime,
    backoff: timedelta,
) -> str:
    assert event.status is not None and event.object_id is not None
    reason = f"{event.type} {event.event_id}: {event.object_id} is {event.status}"
    source = f"webhook:{provider}"
    planned = changes.Writes(now)
    observation = planned.observe(
        operation_id=operation.operation_id,
        actor=operation.actor,
        at=now,
        kind="provider_event",
        source=source,
        verdict=event.status.split(":")[0][:16],
        reason=reason,
        provider_reference=event.object_id,
        detail={
            "event_id": event.event_id,
            "type": event.type,
            "status": event.status,
            "signed_at": event.signed_at.isoformat(),
        },
    )
    effect = await weigh(
        ledger,
        operation,
        ProviderNotice(event.status, event.object_id, reason),
        now=now,
        limits=Limits(backoff),
        source=source,
        observation_id=observation,
        writes=planned,
    )
    changed = effect.move is not Move.RECORD or effect.contradiction or effect.duplicate
    return "applied" if changed else "recorded"
