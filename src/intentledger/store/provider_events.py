"""Provider webhook events, stored once each by (provider, event id)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from intentledger.store.tables import provider_events


class StoredEvent(NamedTuple):
    """What became of an event stored before."""

    disposition: str
    operation_id: str | None


async def store_once(
    conn: AsyncConnection,
    *,
    provider: str,
    event_id: str,
    type: str,
    received_at: datetime,
    signed_at: datetime,
    object_id: str | None,
    reference: str | None,
    operation_id: str | None,
    disposition: str,
    payload: Any,
) -> bool:
    """Store the event unless it is stored already; True when this call stored it."""
    stored = await conn.execute(
        _insert_once(conn.dialect.name)
        .returning(provider_events.c.id)
        .values(
            provider=provider,
            event_id=event_id,
            type=type,
            received_at=received_at,
            signed_at=signed_at,
            object_id=object_id,
            reference=reference,
            operation_id=operation_id,
            disposition=disposition,
            payload=payload,
        )
    )
    # RETURNING, not rowcount: a driver may report -1 for an insert that did nothing.
    return stored.first() is not None


def _insert_once(dialect: str) -> Any:
    """An insert that does nothing for an event already stored (both dialects
    spell ON CONFLICT DO NOTHING; the unique key is (provider, event_id))."""
    if dialect == "postgresql":
        return postgresql_insert(provider_events).on_conflict_do_nothing(
            index_elements=["provider", "event_id"]
        )
    return sqlite_insert(provider_events).on_conflict_do_nothing(
        index_elements=["provider", "event_id"]
    )


async def stored_event(conn: AsyncConnection, provider: str, event_id: str) -> StoredEvent:
    """The disposition and operation of an event stored before."""
    result = await conn.execute(
        select(provider_events.c.disposition, provider_events.c.operation_id)
        .where(provider_events.c.provider == provider)
        .where(provider_events.c.event_id == event_id)
    )
    return StoredEvent(*result.one())


async def set_disposition(
    conn: AsyncConnection, provider: str, event_id: str, disposition: str
) -> None:
    await conn.execute(
        provider_events.update()
        .where(provider_events.c.provider == provider)
        .where(provider_events.c.event_id == event_id)
        .values(disposition=disposition)
    )
