"""Turning an httpx call into a ProviderAnswer, by the precise exception class.

httpx's base classes mix safe and unsafe cases (TimeoutException covers both
ConnectTimeout and ReadTimeout), so only the leaf classes below count as proof
that nothing was sent. Everything else that goes wrong is "no response".
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import httpx

from intentledger.domain.transport import KEY_CONFLICT_CODES, ProviderAnswer, Transport

# The connection was never established, so the provider cannot have read the
# request (research S21, S22: raised from TCP connect, TLS start, pool wait).
NEVER_SENT: tuple[type[Exception], ...] = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.PoolTimeout,
)


def _qualified(exc: BaseException) -> str:
    module = type(exc).__module__.split(".")[0]
    return f"{module}.{type(exc).__name__}"


def _error_code(response: httpx.Response) -> str | None:
    """The provider's error code, or its error type when it gives no code.

    A key-conflict marker may sit in either field (Stripe: type
    `idempotency_error`), so when one of them names a key conflict, that wins.
    """
    try:
        body = response.json()
    except ValueError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        error = body if isinstance(body, dict) else {}
    fields = [str(error[name]) for name in ("code", "type") if error.get(name) is not None]
    conflict = [value for value in fields if value in KEY_CONFLICT_CODES]
    chosen = conflict or fields
    return chosen[0] if chosen else None


def _reference(response: httpx.Response) -> str | None:
    try:
        body = response.json()
    except ValueError:
        return None
    return str(body["id"]) if isinstance(body, dict) and "id" in body else None


# httpx's own timeout fires first for a single slow phase (so the record names
# the exact class, e.g. httpx.ReadTimeout); the deadline only cuts off calls
# whose phases each stayed under it.
CALL_GRACE = timedelta(milliseconds=200)


def call_deadline(timeout: timedelta) -> timedelta:
    """The longest any provider call may take, all phases together."""
    return timeout + CALL_GRACE


async def observe(call: Awaitable[httpx.Response], deadline: float | None = None) -> ProviderAnswer:
    """Await one provider request and report what the wire showed.

    httpx's timeout applies to each phase (connect, each read...), so a provider
    that trickles its answer could hold a call open for ever; `deadline` bounds
    the whole call, which keeps it shorter than the sweeper's stale threshold.
    """
    try:
        async with asyncio.timeout(deadline):
            response = await call
            # Reading the body can itself fail mid-stream: still no (whole) answer.
            await response.aread()
    except NEVER_SENT as exc:
        return ProviderAnswer(
            Transport.NOT_SENT, error_class=_qualified(exc), detail={"error": str(exc)}
        )
    except Exception as exc:
        return ProviderAnswer(
            Transport.NO_RESPONSE, error_class=_qualified(exc), detail={"error": str(exc)}
        )
    detail: dict[str, Any] = {}
    try:
        detail["body"] = response.json()
    except ValueError:
        detail["body_text"] = response.text[:2000]
    return ProviderAnswer(
        Transport.RESPONSE,
        status=response.status_code,
        error_code=_error_code(response) if response.status_code >= 400 else None,
        provider_reference=_reference(response) if response.is_success else None,
        retry_after=tuple(response.headers.get_list("retry-after")),
        detail=detail,
    )


# httpcore's pool walks every one of its connections on each request and each
# response (encode/httpcore#1035, still open in httpcore 1.0.9): at 200
# connections that walk cost a worker more CPU than everything else it does.
# Several small pools keep each walk short.
SHARD_CONNECTIONS = 8


@dataclass
class _Shard:
    client: httpx.AsyncClient
    in_flight: int = 0


class ShardedClient:
    """`max_connections` connections to one provider, as several small httpx pools.

    Each call takes the pool with the fewest calls in flight, so no call waits
    for a connection while another pool has one free: a call that queued would
    spend its deadline waiting and end as "no response".
    """

    def __init__(self, max_connections: int, **client_options: Any) -> None:
        shards = max(1, math.ceil(max_connections / SHARD_CONNECTIONS))
        per_shard = math.ceil(max_connections / shards)
        # One TLS context for all the pools: each costs tens of milliseconds to
        # build (it loads the CA store), and they would all be the same.
        client_options.setdefault("verify", httpx.create_ssl_context())
        self._shards = [
            _Shard(
                httpx.AsyncClient(
                    limits=httpx.Limits(
                        max_connections=per_shard, max_keepalive_connections=per_shard
                    ),
                    **client_options,
                )
            )
            for _ in range(shards)
        ]

    @contextmanager
    def lease(self) -> Iterator[httpx.AsyncClient]:
        shard = min(self._shards, key=lambda s: s.in_flight)
        shard.in_flight += 1
        try:
            yield shard.client
        finally:
            shard.in_flight -= 1

    async def aclose(self) -> None:
        for shard in self._shards:
            await shard.client.aclose()
