"""Merchant events and their pending deliveries: the rows, as the engine
decided them (engine/announcements.py says what is news and renders it)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from typing import Any

from sqlalchemy import Column, Select, TextClause, bindparam, insert, select, text, update
from sqlalchemy.engine import Dialect

from intentledger.store.batches import json_rows, recordset_columns
from intentledger.store.direct import LedgerConnection
from intentledger.store.ids import among_ids, id_reads
from intentledger.store.records import MandateRecord, WebhookEndpointRecord
from intentledger.store.tables import (
    UTCDateTime,
    cards,
    mandates,
    merchant_events,
    webhook_deliveries,
    webhook_endpoints,
)


@dataclass(frozen=True)
class _Statements:
    listening: Select[Any]
    owners_listening: Select[Any]
    mandates: Select[Any]


@cache
def _statements(is_postgres: bool) -> _Statements:
    """Built once: a group record asks `listening` every time, and building a
    select and its cache key cost about as much CPU as its round trip."""
    live = webhook_endpoints.c.deleted_at.is_(None)
    return _Statements(
        listening=select(webhook_endpoints).where(
            among_ids(webhook_endpoints.c.actor, is_postgres), live
        ),
        owners_listening=select(mandates.c.mandate_id, webhook_endpoints)
        .join(mandates, mandates.c.actor == webhook_endpoints.c.actor)
        .where(among_ids(mandates.c.mandate_id, is_postgres), live),
        mandates=select(mandates).where(among_ids(mandates.c.mandate_id, is_postgres)),
    )


async def listening_endpoints(
    conn: LedgerConnection, actors: Iterable[str]
) -> dict[str, list[WebhookEndpointRecord]]:
    """The live endpoints of each of `actors` that has any."""
    statement = _statements(conn.dialect.name == "postgresql").listening
    found: dict[str, list[WebhookEndpointRecord]] = {}
    for read in id_reads(actors):
        for row in await conn.execute(statement, read):
            found.setdefault(row.actor, []).append(WebhookEndpointRecord.of(row))
    return found


async def endpoints_of_card_owner(
    conn: LedgerConnection, card_id: str
) -> list[WebhookEndpointRecord]:
    return await _endpoints_of_owner(conn, cards.c.actor, cards.c.card_id, card_id)


async def endpoints_of_mandate_owners(
    conn: LedgerConnection, mandate_ids: Iterable[str]
) -> dict[str, list[WebhookEndpointRecord]]:
    """The live endpoints of each mandate's owner, for the mandates whose owner
    has any: one read, however many mandates (up to `IDS_PER_READ`)."""
    statement = _statements(conn.dialect.name == "postgresql").owners_listening
    found: dict[str, list[WebhookEndpointRecord]] = {}
    for read in id_reads(mandate_ids):
        for mandate_id, *endpoint in await conn.execute(statement, read):
            found.setdefault(mandate_id, []).append(WebhookEndpointRecord(*endpoint))
    return found


async def mandates_by_id(
    conn: LedgerConnection, mandate_ids: Iterable[str]
) -> dict[str, MandateRecord]:
    statement = _statements(conn.dialect.name == "postgresql").mandates
    found: dict[str, MandateRecord] = {}
    for read in id_reads(mandate_ids):
        found.update(
            (row.mandate_id, MandateRecord.of(row)) for row in await conn.execute(statement, read)
        )
    return found


async def _endpoints_of_owner(
    conn: LedgerConnection, owner: Column[Any], key: Column[Any], value: str
) -> list[WebhookEndpointRecord]:
    """The live endpoints of whoever owns the mandate or card `value`, in one read."""
    result = await conn.execute(
        select(webhook_endpoints)
        .join(owner.table, owner == webhook_endpoints.c.actor)
        .where(key == value, webhook_endpoints.c.deleted_at.is_(None))
    )
    return [WebhookEndpointRecord.of(row) for row in result]


_INSERT_EVENT = insert(merchant_events)
_INSERT_DELIVERY = insert(webhook_deliveries)
_EVENT_FIELDS = ("event_id", "actor", "type", "object_id", "payload")
_DELIVERY_FIELDS = ("event_id", "actor", "endpoint_id")


@cache
def _add_events_sql(dialect: Dialect) -> TextClause:
    """`add_events` on PostgreSQL as one statement, whatever the number of events:
    the events and their deliveries as two JSON parameters, read back typed as
    an INSERT of the same values types them, and `now` bound as the columns
    bind it (an instant without a zone is refused). The deliveries' foreign
    key to their events is checked at the statement's end, after both inserts."""
    events = ", ".join(_EVENT_FIELDS)
    deliveries = ", ".join(_DELIVERY_FIELDS)
    return text(
        f"""WITH new_events AS (
            INSERT INTO merchant_events ({events}, created_at)
            SELECT {events}, :now
            FROM jsonb_to_recordset(CAST(:events AS jsonb))
                AS e({recordset_columns(dialect, merchant_events, _EVENT_FIELDS)})
        )
        INSERT INTO webhook_deliveries
            ({deliveries}, status, due_at, lease_owner, attempts, created_at)
        SELECT {deliveries}, 'pending', :now, NULL, 0, :now
        FROM jsonb_to_recordset(CAST(:deliveries AS jsonb))
            AS d({recordset_columns(dialect, webhook_deliveries, _DELIVERY_FIELDS)}, n integer)
        ORDER BY n"""
    ).bindparams(bindparam("now", type_=UTCDateTime()))


@dataclass(frozen=True)
class NewEvent:
    """An event to write, and the endpoints that get a pending delivery of it."""

    event_id: str
    actor: str
    type: str
    object_id: str
    payload: str
    endpoint_ids: Sequence[str]


async def add_events(conn: LedgerConnection, events: Sequence[NewEvent], now: datetime) -> None:
    """The events, and a pending delivery of each to each of its endpoints, in the
    order given (the deliveries' ids follow it): one statement on PostgreSQL and
    two on SQLite, however many events there are."""
    if not events:
        return
    event_rows = [
        {
            "event_id": event.event_id,
            "actor": event.actor,
            "type": event.type,
            "object_id": event.object_id,
            "payload": event.payload,
        }
        for event in events
    ]
    delivery_rows = [
        {"event_id": event.event_id, "actor": event.actor, "endpoint_id": endpoint_id}
        for event in events
        for endpoint_id in event.endpoint_ids
    ]
    if conn.dialect.name == "postgresql":
        await conn.execute(
            _add_events_sql(conn.dialect),
            {
                "now": now,
                "events": json_rows(event_rows),
                "deliveries": json_rows([{**row, "n": n} for n, row in enumerate(delivery_rows)]),
            },
        )
        return
    await conn.execute(_INSERT_EVENT, [{**row, "created_at": now} for row in event_rows])
    await conn.execute(
        _INSERT_DELIVERY,
        [
            {
                **row,
                "status": "pending",
                "due_at": now,
                "lease_owner": None,
                "attempts": 0,
                "created_at": now,
            }
            for row in delivery_rows
        ],
    )


async def replace_payload(conn: LedgerConnection, event_id: str, payload: str) -> None:
    """An event not yet committed (so not yet sent) shows its object's latest state."""
    await conn.execute(
        update(merchant_events)
        .where(merchant_events.c.event_id == event_id)
        .values(payload=payload)
    )
