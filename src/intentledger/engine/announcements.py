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
from intentledger.domain.states import state_of
from intentledger.store import merchant_events
from intentledger.store.batches import BatchLedger
from intentledger.store.direct import current_transaction
from intentledger.store.ledger import Ledger
from intentledger.store.records import OperationRecord, WebhookEndpointRecord


def new_event_id() -> str:
    return "evt_" + secrets.token_hex(12)


def view_of(record: OperationRecord, changed: Mapping[str, Any] | None = None) -> OperationView:
    """The record's parts whose change is news, with `changed` (a change's
    values) applied: read off the record, not a copy of all its columns."""
    changed = changed or {}
    return OperationView(
        state=state_of(changed.get("state", record.state)),
        duplicate_detected=bool(changed.get("duplicate_detected", record.duplicate_detected)),
        outcome_contradicted=bool(changed.get("outcome_contradicted", record.outcome_contradicted)),
    )


async def operations_changed(
    ledger: Ledger, changes: Sequence[tuple[OperationRecord, Mapping[str, Any]]], now: datetime
) -> None:
    """Announce what each change of a record (`before`, and the values the
    change sets) is news of, if anything. However many changes there are, the
    endpoints of every actor with news are read once, the announced operations
    as the transaction leaves them in four reads, and the events written with
    their deliveries in one statement (two on SQLite): a group record settling
    many payments must not pay a round trip per payment for its news
    (docs/benchmarks.md, "News in a group record, and the merchant webhooks'
    sender")."""
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
    announced = [
        (before, types, endpoints)
        for before, types in news
        if (endpoints := listening.get(before.actor, []))
        and any(subscribed(t, e.events) for t in types for e in endpoints)
    ]
    if not announced:
        return
    # The rows as committed with these changes, and their attempts: what GET shows.
    parts = await BatchLedger(ledger.conn).parts_of(
        before.operation_id for before, _, _ in announced
    )
    events: list[merchant_events.NewEvent] = []
    for before, types, endpoints in announced:
        current = parts[before.operation_id]
        data = operation_document(
            current.operation, current.attempts, current.submit_results, current.refunds
        )
        for event_type in types:
            event = _event(before.actor, event_type, before.operation_id, data, now, endpoints)
            if event is not None:
                events.append(event)
    await merchant_events.add_events(ledger.conn, events, now)


async def mandates_changed(ledger: Ledger, mandate_ids: Sequence[str], now: datetime) -> None:
    """One `mandate.updated` per mandate per transaction (see `_announce_once`),
    for each of `mandate_ids` whose owner has an endpoint that takes it; the
    owners' endpoints and the mandates are read once each, whatever their number."""
    if not mandate_ids:
        return
    owners = await merchant_events.endpoints_of_mandate_owners(ledger.conn, mandate_ids)
    wanted = [
        mandate_id
        for mandate_id in dict.fromkeys(mandate_ids)
        if any(subscribed(MANDATE_UPDATED, e.events) for e in owners.get(mandate_id, []))
    ]
    if not wanted:
        return
    found = await merchant_events.mandates_by_id(ledger.conn, wanted)
    await _announce_once(
        ledger,
        [
            (
                found[mandate_id].actor,
                MANDATE_UPDATED,
                mandate_id,
                mandate_document(found[mandate_id]),
                owners[mandate_id],
            )
            for mandate_id in wanted
        ],
        now,
    )


async def mandate_changed(ledger: Ledger, mandate_id: str, now: datetime) -> None:
    await mandates_changed(ledger, [mandate_id], now)


async def card_changed(ledger: Ledger, card_id: str, now: datetime) -> None:
    endpoints = await merchant_events.endpoints_of_card_owner(ledger.conn, card_id)
    if not any(subscribed(CARD_UPDATED, e.events) for e in endpoints):
        return
    card = await ledger.get_card(card_id)
    assert card is not None
    data = card_document(card)
    await _announce_once(ledger, [(card.actor, CARD_UPDATED, card_id, data, endpoints)], now)


# What `_announce_once` announces: the actor, the event's type, the object's id,
# its document and the actor's live endpoints.
_ObjectNews = tuple[str, str, str, Mapping[str, Any], Sequence[WebhookEndpointRecord]]


async def _announce_once(ledger: Ledger, news: Sequence[_ObjectNews], now: datetime) -> None:
    """One `*.updated` event per object per transaction, showing the object as
    the transaction leaves it: suspending a mandate that cancels ten payments is
    one change to the merchant, not eleven states nobody will see again."""
    # The transaction itself (the async wrapper may be another object each time).
    transaction = current_transaction(ledger.conn)
    fresh: list[merchant_events.NewEvent] = []
    for actor, event_type, object_id, data, endpoints in news:
        earlier = ledger.announced.get((event_type, object_id))
        if earlier is not None and transaction is not None and earlier[1] is transaction:
            # Not yet committed, so not yet sent to anyone: it can still change.
            await merchant_events.replace_payload(
                ledger.conn, earlier[0], _payload(event_type, now, data)
            )
            continue
        event = _event(actor, event_type, object_id, data, now, endpoints)
        if event is not None:
            fresh.append(event)
    await merchant_events.add_events(ledger.conn, fresh, now)
    for event in fresh:
        ledger.announced[(event.type, event.object_id)] = (event.event_id, transaction)


def _event(
    actor: str,
    event_type: str,
    object_id: str,
    data: Mapping[str, Any],
    now: datetime,
    endpoints: Sequence[WebhookEndpointRecord],
) -> merchant_events.NewEvent | None:
    """The event and the endpoints that take it; None if none does."""
    targets = sorted(e.endpoint_id for e in endpoints if subscribed(event_type, e.events))
    if not targets:
        return None
    return merchant_events.NewEvent(
        event_id=new_event_id(),
        actor=actor,
        type=event_type,
        object_id=object_id,
        payload=_payload(event_type, now, data),
        endpoint_ids=targets,
    )


def _payload(event_type: str, now: datetime, data: Mapping[str, Any]) -> str:
    """The Standard Webhooks payload: type, timestamp, data."""
    return json.dumps(
        {"type": event_type, "timestamp": json_value(now), "data": data},
        separators=(",", ":"),
        ensure_ascii=False,
    )
