"""Merchant webhook endpoints and the deliveries of their events, on one connection."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cache
from typing import Any

from sqlalchemy import Integer, Select, Update, bindparam, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from intentledger.store.direct import LedgerConnection
from intentledger.store.ids import IDS, among_ids
from intentledger.store.records import (
    ListedDeliveryRecord,
    WebhookAttemptRecord,
    WebhookEndpointRecord,
)
from intentledger.store.tables import (
    UTCDateTime,
    merchant_events,
    webhook_attempts,
    webhook_deliveries,
    webhook_endpoints,
)


@dataclass(frozen=True)
class Claimed:
    """A delivery leased for one attempt, with what that attempt needs."""

    delivery_id: int
    attempts: int
    event_id: str
    event_created_at: datetime
    payload: str
    endpoint_id: str
    url: str
    secret: str
    actor: str


@dataclass(frozen=True)
class AttemptResult:
    at: datetime
    duration_ms: int
    http_status: int | None
    error: str | None
    delivered: bool
    # None with `delivered` False: given up.
    next_attempt_at: datetime | None


# A delivery an attempt holds (its lease may have run out).
_LEASED = webhook_deliveries.c.lease_owner.is_not(None) & (webhook_deliveries.c.status == "pending")


@cache
def _candidates(is_postgres: bool) -> Select[Any]:
    """The due deliveries a claim may take, earliest due first (of equal due
    times, the first made), built once (a busy sender claims as often as an
    attempt ends). Endpoints already at their limit are left out, so one
    endpoint with a long backlog cannot fill every claim with rows it may not
    take (read through the small index of leased rows)."""
    saturated = (
        select(webhook_deliveries.c.endpoint_id)
        .where(_LEASED, webhook_deliveries.c.due_at > bindparam("now"))
        .group_by(webhook_deliveries.c.endpoint_id)
        .having(func.count() >= bindparam("in_flight_limit", type_=Integer()))
    )
    due = (
        select(webhook_deliveries.c.id, webhook_deliveries.c.endpoint_id)
        .where(
            webhook_deliveries.c.status == "pending",
            webhook_deliveries.c.due_at <= bindparam("now"),
            webhook_deliveries.c.endpoint_id.not_in(saturated),
        )
        .order_by(webhook_deliveries.c.due_at, webhook_deliveries.c.id)
        .limit(bindparam("candidates", type_=Integer()))
    )
    return due.with_for_update(skip_locked=True) if is_postgres else due


@dataclass(frozen=True)
class _ClaimStatements:
    lock_endpoints: Select[Any]
    in_flight: Select[Any]
    lease: Update
    leased: Select[Any]


@cache
def _claim_statements(is_postgres: bool) -> _ClaimStatements:
    """The rest of a claim's statements, built once, their keys one parameter."""
    lock = select(webhook_endpoints.c.endpoint_id, webhook_endpoints.c.deleted_at).where(
        among_ids(webhook_endpoints.c.endpoint_id, is_postgres)
    )
    if is_postgres:
        # FOR NO KEY UPDATE: claimers of one endpoint exclude each other, but a
        # payment's transaction inserting a delivery (whose foreign key takes a
        # key-share lock on the endpoint) never waits for a claim.
        lock = lock.order_by(webhook_endpoints.c.endpoint_id).with_for_update(key_share=True)
    return _ClaimStatements(
        lock_endpoints=lock,
        in_flight=select(webhook_deliveries.c.endpoint_id, func.count())
        .where(
            among_ids(webhook_deliveries.c.endpoint_id, is_postgres),
            _LEASED,
            webhook_deliveries.c.due_at > bindparam("now", type_=UTCDateTime()),
        )
        .group_by(webhook_deliveries.c.endpoint_id),
        lease=update(webhook_deliveries)
        .where(among_ids(webhook_deliveries.c.id, is_postgres))
        .values(
            lease_owner=bindparam("owner", type_=webhook_deliveries.c.lease_owner.type),
            due_at=bindparam("lease_until", type_=webhook_deliveries.c.due_at.type),
        ),
        leased=select(
            webhook_deliveries.c.id,
            webhook_deliveries.c.attempts,
            merchant_events.c.event_id,
            merchant_events.c.created_at,
            merchant_events.c.payload,
            webhook_endpoints.c.endpoint_id,
            webhook_endpoints.c.url,
            webhook_endpoints.c.secret,
            webhook_deliveries.c.actor,
        )
        .join(merchant_events, merchant_events.c.event_id == webhook_deliveries.c.event_id)
        .join(
            webhook_endpoints,
            webhook_endpoints.c.endpoint_id == webhook_deliveries.c.endpoint_id,
        )
        .where(among_ids(webhook_deliveries.c.id, is_postgres))
        .order_by(webhook_deliveries.c.id),
    )


# The attempt's statements, built once: a worker records one per delivery.
_INSERT_ATTEMPT = insert(webhook_attempts)
# Only a delivery `owner` still holds moves on (see `record_attempt`).
_MOVE_ON = (
    update(webhook_deliveries)
    .where(
        webhook_deliveries.c.id == bindparam("delivery_id"),
        webhook_deliveries.c.lease_owner == bindparam("owner"),
        webhook_deliveries.c.status == "pending",
    )
    .values(
        status=bindparam("new_status", type_=webhook_deliveries.c.status.type),
        due_at=bindparam("new_due_at", type_=webhook_deliveries.c.due_at.type),
        finished_at=bindparam("new_finished_at", type_=webhook_deliveries.c.finished_at.type),
        lease_owner=None,
        attempts=webhook_deliveries.c.attempts + 1,
    )
)


def _attempt_row(claimed: Claimed, result: AttemptResult) -> dict[str, Any]:
    return {
        "delivery_id": claimed.delivery_id,
        "actor": claimed.actor,
        "at": result.at,
        "duration_ms": result.duration_ms,
        "http_status": result.http_status,
        "error": result.error,
        "delivered": result.delivered,
        "next_attempt_at": result.next_attempt_at,
    }


def _move_on(claimed: Claimed, owner: str, result: AttemptResult) -> dict[str, Any]:
    """The delivery after the attempt: delivered, given up, or due again."""
    if result.delivered:
        status, due_at, finished_at = "delivered", result.at, result.at
    elif result.next_attempt_at is None:
        status, due_at, finished_at = "failed", result.at, result.at
    else:
        status, due_at, finished_at = "pending", result.next_attempt_at, None
    return {
        "delivery_id": claimed.delivery_id,
        "owner": owner,
        "new_status": status,
        "new_due_at": due_at,
        "new_finished_at": finished_at,
    }


async def any_due(conn: LedgerConnection, now: datetime) -> bool:
    """Whether a delivery is due: the sender's idle look, the one read of
    these tables a worker's own connections (store/direct.py) send."""
    query = select(webhook_deliveries.c.id).where(
        webhook_deliveries.c.status == "pending", webhook_deliveries.c.due_at <= now
    )
    return (await conn.execute(query.limit(1))).first() is not None


class WebhookStore:
    def __init__(self, conn: AsyncConnection) -> None:
        self.conn = conn
        self._is_postgres = conn.dialect.name == "postgresql"

    # -- endpoints ----------------------------------------------------------

    async def insert_endpoint(self, **values: Any) -> None:
        await self.conn.execute(insert(webhook_endpoints).values(**values))

    async def endpoint_of(self, actor: str, endpoint_id: str) -> WebhookEndpointRecord | None:
        """The actor's endpoint, deleted or not (its history stays readable);
        another actor's is as missing as one never made."""
        found = await self.endpoint_by_id(endpoint_id)
        return found if found is not None and found.actor == actor else None

    async def endpoint_by_id(self, endpoint_id: str) -> WebhookEndpointRecord | None:
        """Deleted or not (an idempotent replay of a creation finds it so)."""
        query = select(webhook_endpoints).where(webhook_endpoints.c.endpoint_id == endpoint_id)
        found = (await self.conn.execute(query)).first()
        return None if found is None else WebhookEndpointRecord.of(found)

    async def endpoints(self, actor: str) -> list[WebhookEndpointRecord]:
        result = await self.conn.execute(
            select(webhook_endpoints)
            .where(webhook_endpoints.c.actor == actor, webhook_endpoints.c.deleted_at.is_(None))
            .order_by(webhook_endpoints.c.created_at, webhook_endpoints.c.endpoint_id)
        )
        return [WebhookEndpointRecord.of(row) for row in result]

    async def delete_endpoint(self, actor: str, endpoint_id: str, now: datetime) -> bool:
        """Stop the endpoint and cancel what it has not yet received; False if
        the actor has no such endpoint. Deleting a deleted endpoint changes
        nothing and is True: DELETE is idempotent (RFC 9110, 9.2.2), so a
        client whose first answer was lost can ask again.

        Deliveries first, then the endpoint: the order a claim locks them in,
        so a deletion and a claim can never wait for each other in a circle."""
        found = await self.endpoint_of(actor, endpoint_id)
        if found is None:
            return False
        if found.deleted_at is not None:
            return True
        await self.conn.execute(
            update(webhook_deliveries)
            .where(
                webhook_deliveries.c.endpoint_id == endpoint_id,
                webhook_deliveries.c.status == "pending",
            )
            .values(status="cancelled", finished_at=now, lease_owner=None)
        )
        # Updating no row is no failure: a concurrent DELETE of the same
        # endpoint (a client retrying its own slow first request) committed
        # first, and deleted is deleted.
        await self.conn.execute(
            update(webhook_endpoints)
            .where(
                webhook_endpoints.c.endpoint_id == endpoint_id,
                webhook_endpoints.c.actor == actor,
                webhook_endpoints.c.deleted_at.is_(None),
            )
            .values(deleted_at=now)
        )
        return True

    # -- what a merchant may read back ----------------------------------------

    async def deliveries(
        self, endpoint_id: str, limit: int, starting_after: int | None
    ) -> list[ListedDeliveryRecord]:
        """Newest first, `limit` of them, older than delivery `starting_after`."""
        query = (
            select(
                webhook_deliveries,
                merchant_events.c.type,
                merchant_events.c.object_id,
                merchant_events.c.created_at.label("event_created_at"),
            )
            .join(merchant_events, merchant_events.c.event_id == webhook_deliveries.c.event_id)
            .where(webhook_deliveries.c.endpoint_id == endpoint_id)
            .order_by(webhook_deliveries.c.id.desc())
            .limit(limit)
        )
        if starting_after is not None:
            query = query.where(webhook_deliveries.c.id < starting_after)
        return [ListedDeliveryRecord.of(row) for row in await self.conn.execute(query)]

    async def attempts_of(
        self, delivery_ids: Sequence[int]
    ) -> dict[int, list[WebhookAttemptRecord]]:
        found: dict[int, list[WebhookAttemptRecord]] = {i: [] for i in delivery_ids}
        if not delivery_ids:
            return found
        rows = await self.conn.execute(
            select(webhook_attempts)
            .where(webhook_attempts.c.delivery_id.in_(list(delivery_ids)))
            .order_by(webhook_attempts.c.id)
        )
        for row in rows:
            found[row.delivery_id].append(WebhookAttemptRecord.of(row))
        return found

    # -- the workers' side ------------------------------------------------------

    async def any_due(self, now: datetime) -> bool:
        return await any_due(self.conn, now)

    async def claim_due(
        self, now: datetime, lease: timedelta, owner: str, limit: int, in_flight_limit: int
    ) -> list[Claimed]:
        """Lease up to `limit` due deliveries, none making its endpoint's
        leased (in-flight) count exceed `in_flight_limit`.

        The endpoints of the candidates are locked (in key order, so two
        claimers cannot deadlock) before their in-flight counts are read: two
        processes cannot both see a free slot and both take it.
        """
        candidates = (
            await self.conn.execute(
                _candidates(self._is_postgres),
                {"now": now, "in_flight_limit": in_flight_limit, "candidates": limit * 4},
            )
        ).all()
        if not candidates:
            return []
        endpoint_ids = sorted({c.endpoint_id for c in candidates})
        statements = _claim_statements(self._is_postgres)
        locked = await self.conn.execute(statements.lock_endpoints, {IDS: endpoint_ids})
        deleted = {row.endpoint_id for row in locked if row.deleted_at}
        if deleted:
            # A change that read the endpoint before its deletion committed may
            # have queued a delivery after the deletion cancelled the others.
            await self.conn.execute(
                update(webhook_deliveries)
                .where(
                    webhook_deliveries.c.id.in_(
                        [c.id for c in candidates if c.endpoint_id in deleted]
                    )
                )
                .values(status="cancelled", finished_at=now, lease_owner=None)
            )
            candidates = [c for c in candidates if c.endpoint_id not in deleted]
        in_flight: dict[str, int] = dict(
            (await self.conn.execute(statements.in_flight, {IDS: endpoint_ids, "now": now})).all()
        )
        chosen: list[int] = []
        for candidate in candidates:
            if len(chosen) == limit:
                break
            if in_flight.get(candidate.endpoint_id, 0) < in_flight_limit:
                in_flight[candidate.endpoint_id] = in_flight.get(candidate.endpoint_id, 0) + 1
                chosen.append(candidate.id)
        if not chosen:
            return []
        await self.conn.execute(
            statements.lease, {IDS: chosen, "owner": owner, "lease_until": now + lease}
        )
        rows = await self.conn.execute(statements.leased, {IDS: chosen})
        return [Claimed(*row) for row in rows]

    async def record_attempt(
        self, claimed: Claimed, owner: str, result: AttemptResult, *, unless_kept: bool = False
    ) -> bool:
        """Keep the attempt, and move the delivery on if `owner` still holds it
        (a lease that ran out may have passed it to another worker, whose
        attempt then decides). True if the delivery moved on. `unless_kept`:
        keep it only if no attempt of the delivery ended at the same instant
        (a retry of a write whose commit may have landed)."""
        if not unless_kept or not await self._attempt_kept(claimed, result):
            await self.conn.execute(_INSERT_ATTEMPT, _attempt_row(claimed, result))
        moved = await self.conn.execute(_MOVE_ON, _move_on(claimed, owner, result))
        return bool(moved.rowcount == 1)

    async def _attempt_kept(self, claimed: Claimed, result: AttemptResult) -> bool:
        found = await self.conn.execute(
            select(webhook_attempts.c.id).where(
                webhook_attempts.c.delivery_id == claimed.delivery_id,
                webhook_attempts.c.actor == claimed.actor,
                webhook_attempts.c.at == result.at,
            )
        )
        return found.first() is not None

    async def record_attempts(
        self, attempts: Sequence[tuple[Claimed, AttemptResult]], owner: str
    ) -> None:
        """`record_attempt` for many, in two calls however many there are (an
        insert of every attempt, an update of every delivery, each handed its
        rows at once; the server runs it once a row). The deliveries in key
        order, so two recorders updating the same two (their leases having
        passed from one to the other) cannot deadlock; a claim skips what is
        locked."""
        if not attempts:
            return
        ordered = sorted(attempts, key=lambda attempt: attempt[0].delivery_id)
        await self.conn.execute(
            _INSERT_ATTEMPT, [_attempt_row(claimed, result) for claimed, result in ordered]
        )
        await self.conn.execute(
            _MOVE_ON, [_move_on(claimed, owner, result) for claimed, result in ordered]
        )
