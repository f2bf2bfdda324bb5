"""Merchant webhook endpoints: create (idempotent), read, delete, and what was sent.

A target is checked before anything is written: its form, and — unless private
targets are allowed — that every address its name resolves to is public
(domain/webhook_targets.py). The signing secret is made here and shown in the
creation's answer (and an idempotent replay of it: a client whose first answer
was lost would otherwise never learn it), never by a read.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.signatures import STANDARD_SECRET_PREFIX
from intentledger.domain.webhook_targets import (
    TargetRefused,
    literal_address,
    parse_target,
    refuse_private,
)
from intentledger.engine.clock import Clock
from intentledger.engine.mandates import Keyed
from intentledger.engine.refusal import Refusal, claim_key, find_replay, retry_key_races
from intentledger.store.ledger import Ledger
from intentledger.store.tables import Record
from intentledger.store.webhooks import WebhookStore

CREATE_ROUTE = "POST /v1/webhook-endpoints"
# How long a target's name may take to resolve before it is refused.
RESOLVE_TIMEOUT_SECONDS = 5.0

Resolver = Callable[[str, int], Awaitable[list[str]]]


class EndpointRefused(Refusal):
    """A target we will not send to; nothing is written."""

    def __init__(self, detail: str) -> None:
        super().__init__(422, "webhook-url-refused", detail)


def new_endpoint_id() -> str:
    return "we_" + secrets.token_hex(12)


def new_secret() -> str:
    """A Standard Webhooks secret: `whsec_` and 24 random bytes in base64."""
    return STANDARD_SECRET_PREFIX + base64.b64encode(secrets.token_bytes(24)).decode()


async def resolve(host: str, port: int) -> list[str]:
    """Every address `host` resolves to, as the connection would."""
    loop = asyncio.get_running_loop()
    infos = await asyncio.wait_for(
        loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), RESOLVE_TIMEOUT_SECONDS
    )
    return sorted({str(info[4][0]) for info in infos})


async def check_target(url: str, allow_private: bool, resolver: Resolver = resolve) -> None:
    """TargetRefused unless webhooks may be sent to `url`."""
    parts = parse_target(url, allow_private)
    if allow_private:
        return
    host = parts.hostname
    assert host is not None
    literal = literal_address(host)
    if literal is not None:
        refuse_private(host, [str(literal)])
        return
    port = parts.port or 443
    try:
        addresses = await resolver(host, port)
    except (OSError, TimeoutError) as exc:
        raise TargetRefused(f"{host} does not resolve ({type(exc).__name__})") from None
    refuse_private(host, addresses)


@dataclass(frozen=True)
class Created:
    endpoint: Record
    replayed: bool


async def create_endpoint(
    engine: AsyncEngine,
    clock: Clock,
    keyed: Keyed,
    url: str,
    events: list[str] | None,
    allow_private: bool,
    resolver: Resolver = resolve,
) -> Created:
    try:
        await check_target(url, allow_private, resolver)
    except TargetRefused as exc:
        raise EndpointRefused(str(exc)) from None

    async def attempt() -> Created:
        async with engine.begin() as conn:
            ledger = Ledger(conn)
            store = WebhookStore(conn)
            replayed = await find_replay(
                ledger, keyed.actor, keyed.route, keyed.idempotency_key, keyed.request_hash
            )
            if replayed is not None:
                found = await store.endpoint_by_id(replayed)
                assert found is not None
                return Created(found, True)
            now = clock()
            endpoint_id = new_endpoint_id()
            await claim_key(
                ledger,
                keyed.actor,
                keyed.route,
                keyed.idempotency_key,
                keyed.request_hash,
                endpoint_id,
                now,
            )
            await store.insert_endpoint(
                endpoint_id=endpoint_id,
                actor=keyed.actor,
                url=url,
                events=events,
                secret=new_secret(),
                created_at=now,
            )
            created = await store.endpoint_by_id(endpoint_id)
            assert created is not None
            return Created(created, False)

    return await retry_key_races(attempt)


async def list_endpoints(engine: AsyncEngine, actor: str) -> Sequence[Record]:
    async with engine.connect() as conn:
        return await WebhookStore(conn).endpoints(actor)


async def read_endpoint(engine: AsyncEngine, actor: str, endpoint_id: str) -> Record | None:
    async with engine.connect() as conn:
        return await WebhookStore(conn).endpoint(actor, endpoint_id)


async def delete_endpoint(engine: AsyncEngine, clock: Clock, actor: str, endpoint_id: str) -> bool:
    async with engine.begin() as conn:
        return await WebhookStore(conn).delete_endpoint(actor, endpoint_id, clock())


@dataclass(frozen=True)
class DeliveryPage:
    deliveries: Sequence[Record]
    attempts: dict[int, list[Record]]
    has_more: bool


async def deliveries_page(
    engine: AsyncEngine, actor: str, endpoint_id: str, limit: int, starting_after: int | None
) -> DeliveryPage | None:
    """A page of the endpoint's deliveries, newest first; None if the actor has
    no such endpoint (deleted ones included: their history stays readable)."""
    async with engine.connect() as conn:
        store = WebhookStore(conn)
        endpoint = await store.endpoint_by_id(endpoint_id)
        if endpoint is None or endpoint.actor != actor:
            return None
        rows = await store.deliveries(endpoint_id, limit + 1, starting_after)
        page = rows[:limit]
        attempts = await store.attempts_of([row.id for row in page])
    return DeliveryPage(page, attempts, has_more=len(rows) > limit)
