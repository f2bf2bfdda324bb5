"""Merchant events, written in the transaction of the change they report.

The outbox rule again: a change and the news of it commit together or not at
all, so an event is never sent for a change that rolled back and never lost for
one that committed. Each piece of news is one `merchant_events` row (its body
fixed now, so every retry sends the same bytes) and one pending delivery per
endpoint of the actor that takes its type. An actor with no endpoint costs one
indexed read, and only on a change that is news.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import Column, insert, select, update

from intentledger.documents import card_document, json_value, mandate_document, operation_document
from intentledger.domain.merchant_events import (
    CARD_UPDATED,
    MANDATE_UPDATED,
    OperationView,
    operation_events,
    subscribed,
)
from intentledger.domain.states import State
from intentledger.store.tables import (
    Record,
    cards,
    mandates,
    merchant_events,
    webhook_deliveries,
    webhook_endpoints,
)

if TYPE_CHECKING:
    from intentledger.store.ledger import Ledger


def new_event_id() -> str:
    return "evt_" + secrets.token_hex(12)


def view_of(values: Mapping[str, Any]) -> OperationView:
    return OperationView(
        state=State(values["state"]),
        duplicate_detected=bool(values["duplicate_detected"]),
        outcome_contradicted=bool(values["outcome_contradicted"]),
    )


async def listening_endpoints(ledger: Ledger, actors: Iterable[str]) -> dict[str, list[Record]]:
    """The live endpoints of each of `actors` that has any."""
    wanted = sorted(set(actors))
    if not wanted:
        return {}
    rows = await ledger.conn.execute(
        select(webhook_endpoints).where(
            webhook_endpoints.c.actor.in_(wanted), webhook_endpoints.c.deleted_at.is_(None)
        )
    )
    found: dict[str, list[Record]] = {}
    for row in rows:
        found.setdefault(row.actor, []).append(row)
    return found


async def operation_changed(
    ledger: Ledger,
    before: Record,
    after: Mapping[str, Any],
    now: datetime,
    endpoints: Sequence[Record] | None = None,
) -> None:
    """Announce what the change from `before` to `after` is news of, if anything.
    `endpoints`: the actor's, when the caller has read them already."""
    types = operation_events(view_of(dict(before._mapping)), view_of(after))
    if not types:
        return
    if endpoints is None:
        endpoints = (await listening_endpoints(ledger, [before.actor])).get(before.actor, [])
    if not any(subscribed(t, e.events) for t in types for e in endpoints):
        return
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
    owner, key = mandates.c.actor, mandates.c.mandate_id
    endpoints = await _endpoints_of_owner(ledger, owner, key, mandate_id)
    if not any(subscribed(MANDATE_UPDATED, e.events) for e in endpoints):
        return
    mandate = await ledger.get_mandate(mandate_id)
    assert mandate is not None
    data = mandate_document(mandate)
    await _write_once(ledger, mandate.actor, MANDATE_UPDATED, mandate_id, data, now, endpoints)


async def card_changed(ledger: Ledger, card_id: str, now: datetime) -> None:
    endpoints = await _endpoints_of_owner(ledger, cards.c.actor, cards.c.card_id, card_id)
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
    endpoints: Sequence[Record],
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
        await ledger.conn.execute(
            update(merchant_events)
            .where(merchant_events.c.event_id == earlier[0])
            .values(payload=_payload(event_type, now, data))
        )
        return
    event_id = await _write(ledger, actor, event_type, object_id, data, now, endpoints)
    if event_id is not None:
        ledger.announced[(event_type, object_id)] = (event_id, transaction)


async def _endpoints_of_owner(
    ledger: Ledger, owner: Column[Any], key: Column[Any], value: str
) -> Sequence[Record]:
    """The live endpoints of whoever owns the mandate or card `value`, in one read."""
    result = await ledger.conn.execute(
        select(webhook_endpoints)
        .join(owner.table, owner == webhook_endpoints.c.actor)
        .where(key == value, webhook_endpoints.c.deleted_at.is_(None))
    )
    return result.all()


async def _write(
    ledger: Ledger,
    actor: str,
    event_type: str,
    object_id: str,
    data: Mapping[str, Any],
    now: datetime,
    endpoints: Sequence[Record],
) -> str | None:
    """Write the event and its deliveries; its id, or None if no endpoint takes it."""
    targets = sorted(e.endpoint_id for e in endpoints if subscribed(event_type, e.events))
    if not targets:
        return None
    event_id = new_event_id()
    payload = _payload(event_type, now, data)
    await ledger.conn.execute(
        insert(merchant_events).values(
            event_id=event_id,
            actor=actor,
            type=event_type,
            object_id=object_id,
            payload=payload,
            created_at=now,
        )
    )
    await ledger.conn.execute(
        insert(webhook_deliveries),
        [
            {
                "event_id": event_id,
                "endpoint_id": endpoint_id,
                "status": "pending",
                "due_at": now,
                "lease_owner": None,
                "attempts": 0,
                "created_at": now,
            }
            for endpoint_id in targets
        ],
    )
    return event_id


def _payload(event_type: str, now: datetime, data: Mapping[str, Any]) -> str:
    """The Standard Webhooks payload: type, timestamp, data."""
    return json.dumps(
        {"type": event_type, "timestamp": json_value(now), "data": data},
        separators=(",", ":"),
        ensure_ascii=False,
    )
