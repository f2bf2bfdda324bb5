"""Merchant events and their pending deliveries: the rows, as the engine
decided them (engine/announcements.py says what is news and renders it)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Column, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from intentledger.store.records import WebhookEndpointRecord
from intentledger.store.tables import (
    cards,
    mandates,
    merchant_events,
    webhook_deliveries,
    webhook_endpoints,
)


async def listening_endpoints(
    conn: AsyncConnection, actors: Iterable[str]
) -> dict[str, list[WebhookEndpointRecord]]:
    """The live endpoints of each of `actors` that has any."""
    wanted = sorted(set(actors))
    if not wanted:
        return {}
    rows = await conn.execute(
        select(webhook_endpoints).where(
            webhook_endpoints.c.actor.in_(wanted), webhook_endpoints.c.deleted_at.is_(None)
        )
    )
    found: dict[str, list[WebhookEndpointRecord]] = {}
    for row in rows:
        found.setdefault(row.actor, []).append(WebhookEndpointRecord.of(row))
    return found


async def endpoints_of_mandate_owner(
    conn: AsyncConnection, mandate_id: str
) -> list[WebhookEndpointRecord]:
    return await _endpoints_of_owner(conn, mandates.c.actor, mandates.c.mandate_id, mandate_id)


async def endpoints_of_card_owner(
    conn: AsyncConnection, card_id: str
) -> list[WebhookEndpointRecord]:
    return await _endpoints_of_owner(conn, cards.c.actor, cards.c.card_id, card_id)


async def _endpoints_of_owner(
    conn: AsyncConnection, owner: Column[Any], key: Column[Any], value: str
) -> list[WebhookEndpointRecord]:
    """The live endpoints of whoever owns the mandate or card `value`, in one read."""
    result = await conn.execute(
        select(webhook_endpoints)
        .join(owner.table, owner == webhook_endpoints.c.actor)
        .where(key == value, webhook_endpoints.c.deleted_at.is_(None))
    )
    return [WebhookEndpointRecord.of(row) for row in result]


async def add_event(
    conn: AsyncConnection,
    *,
    event_id: str,
    actor: str,
    event_type: str,
    object_id: str,
    payload: str,
    endpoint_ids: Sequence[str],
    now: datetime,
) -> None:
    """The event, and a pending delivery to each of `endpoint_ids`."""
    await conn.execute(
        insert(merchant_events).values(
            event_id=event_id,
            actor=actor,
            type=event_type,
            object_id=object_id,
            payload=payload,
            created_at=now,
        )
    )
    await conn.execute(
        insert(webhook_deliveries),
        [
            {
                "event_id": event_id,
                "actor": actor,
                "endpoint_id": endpoint_id,
                "status": "pending",
                "due_at": now,
                "lease_owner": None,
                "attempts": 0,
                "created_at": now,
            }
            for endpoint_id in endpoint_ids
        ],
    )


async def replace_payload(conn: AsyncConnection, event_id: str, payload: str) -> None:
    """An event not yet committed (so not yet sent) shows its object's latest state."""
    await conn.execute(
        update(merchant_events)
        .where(merchant_events.c.event_id == event_id)
        .values(payload=payload)
    )
