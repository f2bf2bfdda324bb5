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
import functools
import secrets
import socket
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from urllib.parse import SplitResult

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
from intentledger.engine.refusal import Refusal, claim_key, find_keyed_replay, retry_key_races
from intentledger.store.direct import engine_connection
from intentledger.store.ledger import Ledger
from intentledger.store.records import (
    ListedDeliveryRecord,
    WebhookAttemptRecord,
    WebhookEndpointRecord,
)
from intentledger.store.webhooks import WebhookStore

CREATE_ROUTE = "POST /v1/webhook-endpoints"
# How long a target's name may take to resolve before it is refused.
RESOLVE_TIMEOUT_SECONDS = 5.0
# Live endpoints one actor may have (Stripe allows 16): each change that is
# news writes a row per endpoint, in the payment's own transaction.
MAX_ENDPOINTS_PER_ACTOR = 16
# Resolving merchants' names gets threads of its own: a name server that never
# answers holds a thread past any timeout, and must not hold the default pool
# that the provider's connections resolve through.
_RESOLVER_THREADS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="webhook-dns")

Resolver = Callable[[str, int], Awaitable[list[str]]]


class EndpointRefused(Refusal):
    """A target we will not send to; nothing is written."""

    def __init__(self, detail: str, slug: str = "webhook-url-refused") -> None:
        super().__init__(422, slug, detail)


def new_endpoint_id() -> str:
    return "we_" + secrets.token_hex(12)


def new_secret() -> str:
    """A Standard Webhooks secret: `whsec_` and 24 random bytes in base64."""
    return STANDARD_SECRET_PREFIX + base64.b64encode(secrets.token_bytes(24)).decode()


async def resolve(host: str, port: int) -> list[str]:
    """Every address `host` resolves to, as a connection would see them."""
    loop = asyncio.get_running_loop()
    infos = await asyncio.wait_for(
        loop.run_in_executor(
            _RESOLVER_THREADS,
            functools.partial(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM),
        ),
        RESOLVE_TIMEOUT_SECONDS,
    )
    return sorted({str(info[4][0]) for info in infos})


@dataclass(frozen=True)
class Target:
    parts: SplitResult
    # The checked public address to connect to (None: connect by name, private
    # targets allowed). Connecting to it, not to the name again, leaves no
    # second lookup for a rebinding name server to answer differently.
    address: str | None


async def check_target(url: str, allow_private: bool, resolver: Resolver = resolve) -> Target:
    """Where webhooks to `url` may go; TargetRefused if nowhere."""
    parts = parse_target(url, allow_private)
    if allow_private:
        return Target(parts, None)
    host = parts.hostname
    assert host is not None
    literal = literal_address(host)
    if literal is not None:
        refuse_private(host, [str(literal)])
        return Target(parts, str(literal))
    try:
        addresses = await resolver(host, parts.port or 443)
    except (OSError, TimeoutError, UnicodeError, ValueError) as exc:
        raise TargetRefused(f"{host} does not resolve ({type(exc).__name__})") from None
    return Target(parts, str(refuse_private(host, addresses)[0]))


@dataclass(frozen=True)
class Created:
    endpoint: WebhookEndpointRecord
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
    # An equal retry is answered from the record first: a client whose answer
    # was lost gets its endpoint and secret even if the name resolves
    # differently (or not at all) now.
    async with engine.connect() as conn:
        original = await _replay(Ledger(conn), keyed, clock())
        if original is not None:
            return Created(original, True)
    try:
        await check_target(url, allow_private, resolver)
    except TargetRefused as exc:
        raise EndpointRefused(str(exc)) from None

    async def attempt() -> Created:
        async with engine.begin() as conn:
            ledger = Ledger(conn)
            store = WebhookStore(conn)
            now = clock()
            replayed = await _replay(ledger, keyed, now)
            if replayed is not None:
                return Created(replayed, True)
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
            if len(await store.endpoints(keyed.actor)) >= MAX_ENDPOINTS_PER_ACTOR:
                raise EndpointRefused(
                    f"an actor may have at most {MAX_ENDPOINTS_PER_ACTOR} endpoints; "
                    "delete one first",
                    slug="webhook-endpoint-limit",
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


async def _replay(ledger: Ledger, keyed: Keyed, now: datetime) -> WebhookEndpointRecord | None:
    """The endpoint an equal earlier request made (IdempotencyKeyReused if the
    key came with another request)."""
    found = await find_keyed_replay(ledger, keyed, now)
    if found is None:
        return None
    endpoint = await WebhookStore(engine_connection(ledger.conn)).endpoint_by_id(found)
    assert endpoint is not None, "an idempotency record names its endpoint"
    return endpoint


async def list_endpoints(engine: AsyncEngine, actor: str) -> Sequence[WebhookEndpointRecord]:
    async with engine.connect() as conn:
        return await WebhookStore(conn).endpoints(actor)


async def read_endpoint(
    engine: AsyncEngine, actor: str, endpoint_id: str
) -> WebhookEndpointRecord | None:
    """The actor's endpoint, deleted ones included (with their `deleted_at`): a
    replayed creation answers with a deleted endpoint, which must then read back
    as what it is rather than as missing. Another actor's is None."""
    async with engine.connect() as conn:
        return await WebhookStore(conn).endpoint_of(actor, endpoint_id)


async def delete_endpoint(engine: AsyncEngine, clock: Clock, actor: str, endpoint_id: str) -> bool:
    async with engine.begin() as conn:
        return await WebhookStore(conn).delete_endpoint(actor, endpoint_id, clock())


@dataclass(frozen=True)
class DeliveryPage:
    deliveries: Sequence[ListedDeliveryRecord]
    attempts: dict[int, list[WebhookAttemptRecord]]
    has_more: bool


async def deliveries_page(
    engine: AsyncEngine, actor: str, endpoint_id: str, limit: int, starting_after: int | None
) -> DeliveryPage | None:
    """A page of the endpoint's deliveries, newest first; None if the actor has
    no such endpoint (deleted ones included: their history stays readable)."""
    async with engine.connect() as conn:
        store = WebhookStore(conn)
        if await store.endpoint_of(actor, endpoint_id) is None:
            return None
        rows = await store.deliveries(endpoint_id, limit + 1, starting_after)
        page = rows[:limit]
        attempts = await store.attempts_of([row.id for row in page])
    return DeliveryPage(page, attempts, has_more=len(rows) > limit)
