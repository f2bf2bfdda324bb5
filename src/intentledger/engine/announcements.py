"""Merchant events, written in the transaction of the change they report.

The outbox rule again: a change and the news of it commit together or not at
all, so an event is never sent for a change that rolled back and never lost for
one that committed. Each piece of news is one `merchant_events` row (its body
fixed now, so every retry sends the same bytes) and one pending delivery per
endpoint of the actor that takes its type. An actor with no endpoint costs one
indexed read, and only on a change that is news. What is news is the domain's
(domain/merchant_events.py); the rows are the store's (store/merchant_events.py).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from intentledger.documents import card_document, json_value, mandate_document, operation_document
from intentledger.domain.merchant_events import (
    CARD_UPDATED,
    MANDATE_UPDATED,
    OperationView,
    operation_events,
    subscribed,
)
from intentledger.domain.states import State
from intentledger.store import merchant_events
from intentledger.store.ledger import Ledger
from intentledger.store.records import OperationRecord, WebhookEndpointRecord


def new_event_id() -> str:
    return "evt_" + secrets.token_hex(12)


def view_of(record: OperationRecord, changed: Mapping[str, Any] | None = None) -> OperationView:
    """The record's parts whose change is news, with `changed` (a change's
    values) applied: read off the record, not a copy of all its columns."""
    changed = changed or {}
    return OperationView(
        state=State(changed.get("state", record.state)),
        duplicate_detected=bool(changed.get("duplicate_detected", record.duplicate_detected)),
        outcome_contradicted=bool(changed.get("outcome_contradicted", record.outcome_contradicted)),
    )


async def operations_changed(
    ledger: Ledger, changes: Sequence[tuple[OperationRecord, Mapping[str, Any]]], now: datetime
) -> None:
    """Announce what each change of a record (`before`, and the values the
    change sets) is news of, if anything; the endpoints of every actor with
    news are read once."""
    news = [
        (before, types)
        for before, changed in changes
        if (types := operation_events(view_of(before), view_of(before, changed)))
    ]
    if not news:
        return
    listening = await merchant_events.listening_endpoints(
        ledger.conn, (before.actor for before, _ in news)
    )
    for before, types in news:
        endpoints = listening.get(before.actor, [])
        if any(subscribed(t, e.events) for t in types for e in endpoints):
            await _operation_news(ledger, before, types, endpoints, now)


async def _operation_news(
    ledger: Ledger,
    before: OperationRecord,
    types: Sequence[str],
    endpoints: Sequence[WebhookEndpointRecord],
    now: datetime,
) -> None:
    # The row as committed with this change, and its attempts: what GET shows.
    current = await ledger.get_operation(before.operation_id)
    assert current is not None
    data = operation_document(
        current,
        await ledger.attempts_of(before.operation_id),
        await ledger.submit_results_of(before.operation_id),
        await ledger.refunds_of(before.operation_id) if current.kind == "payment" else (),
    )
    for event_type in types:
        await _write(ledger, before.actor, event_type, before.operation_id, data, now, endpoints)


async def mandate_changed(ledger: Ledger, mandate_id: str, now: datetime) -> None:
    endpoints = await merchant_events.endpoints_of_mandate_owner(ledger.conn, mandate_id)
    if not any(subscribed(MANDATE_UPDATED, e.events) for e in endpoints):
        return
    mandate = await ledger.get_mandate(mandate_id)
    assert mandate is not None
    data = mandate_document(mandate)
    await _write_once(ledger, mandate.actor, MANDATE_UPDATED, mandate_id, data, now, endpoints)


async def card_changed(ledger: Ledger, card_id: str, now: datetime) -> None:
    endpoints = await merchant_events.endpoints_of_card_owner(ledger.conn, card_id)
    if not any(subscribed(CARD_UPDATED, e.events) for e in endpoints):
        return
    card = await ledger.get_card(card_id)
    assert card is not None
    data = card_document(card)
    await _write_once(ledger, card.actor, CARD_UPDATED, card_id, data, now, endpoints)


async def _write_once(
    ledger: Ledger,
    actor: str,
    event_type: str,
    object_id: str,
    data: Mapping[str, Any],
    now: datetime,
    endpoints: Sequence[WebhookEndpointRecord],
) -> None:
    """One `*.updated` event per object per transaction, showing the object as
    the transaction leaves it: suspending a mandate that cancels ten payments is
    one change to the merchant, not eleven states nobody will see again."""
    # The transaction itself (the async wrapper may be another object each time).
    transaction = (
        ledger.conn.sync_connection.get_transaction() if ledger.conn.sync_connection else None
    )
    earlier = ledger.announced.get((event_type, object_id))
    if earlier is not None and transaction is not None and earlier[1] is transaction:
        # Not yet committed, so not yet sent to anyone: it can still change.
        await merchant_events.replace_payload(
            ledger.conn, earlier[0], _payload(event_type, now, data)
        )
        return
    event_id = await _write(ledger, actor, event_type, object_id, data, now, endpoints)
    if event_id is not None:
        ledger.announced[(event_type, object_id)] = (event_id, transaction)


async def _write(
    ledger: Ledger,
    actor: str,
    event_type: str,
    object_id: str,
    data: Mapping[str, Any],
    now: datetime,
    endpoints: Sequence[WebhookEndpointRecord],
) -> str | None:
    """Write the event and its deliveries; its id, or None if no endpoint takes it."""
    targets = sorted(e.endpoint_id for e in endpoints if subscribed(event_type, e.events))
    if not targets:
        return None
    event_id = new_event_id()
    await merchant_events.add_event(
        ledger.conn,
        event_id=event_id,
        actor=actor,
        event_type=event_type,
        object_id=object_id,
        payload=_payload(event_type, now, data),
        endpoint_ids=targets,
        now=now,
    )
    return event_id


def _payload(event_type: str, now: datetime, data: Mapping[str, Any]) -> str:
    """The Standard Webhooks payload: type, timestamp, data."""
    return json.dumps(
        {"type": event_type, "timestamp": json_value(now), "data": data},
        separators=(",", ":"),
        ensure_ascii=False,
    )
