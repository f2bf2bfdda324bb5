"""Turning an httpx call into a ProviderAnswer, by the precise exception class.

httpx's base classes mix safe and unsafe cases (TimeoutException covers both
ConnectTimeout and ReadTimeout), so only the leaf classes below count as proof
that nothing was sent. Everything else that goes wrong is "no response".
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import httpx

from intentledger.domain.transport import Classification, ProviderAnswer, Transport

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


def error_fields(body: Any) -> dict[str, str]:
    """The provider's error object's scalar fields (`type`, `code`,
    `decline_code`...), as text: what an adapter maps a refusal by."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        error = body if isinstance(body, dict) else {}
    return {
        str(name): str(value)
        for name, value in error.items()
        if isinstance(value, str | int) and not isinstance(value, bool)
    }


def _error_code(body: Any) -> str | None:
    """The provider's error code, or its error type when it gives no code: the
    raw word recorded beside the adapter's verdict."""
    fields = error_fields(body)
    return fields.get("code") or fields.get("type")


def _reference(body: Any) -> str | None:
    return str(body["id"]) if isinstance(body, dict) and "id" in body else None


# httpx's own timeout fires first for a single slow phase (so the record names
# the exact class, e.g. httpx.ReadTimeout); the deadline only cuts off calls
# whose phases each stayed under it.
# A provider echoes what it was sent (a beneficiary's IBAN) and may show card
# data: what an answer's detail keeps of those fields is their last four
# characters, enough to tell two apart; a card's security code not at all. The
# answer is recorded as an observation and shown by the API: it is no place for
# a full account or card number. No adapter's mapping or lookup reads these
# fields (they read ids, statuses and error codes).
LAST_FOUR_FIELDS = frozenset({"iban", "account_number", "card_number", "number", "pan"})
DROPPED_FIELDS = frozenset({"cvc", "cvv", "cvc2", "cvv2"})
# Shapes in a body that is not JSON: an IBAN, spaced or not, and a run of 13-19
# digits (a card number, spaced or dashed).
_IBAN_SHAPE = re.compile(r"\b[A-Z]{2}[0-9]{2}(?:[ ]?[A-Z0-9]){11,30}\b")
_CARD_SHAPE = re.compile(r"\b(?:[0-9][ -]?){12,18}[0-9]\b")


def last_four(value: str) -> str:
    compact = value.replace(" ", "")
    return "****" + compact[-4:] if len(compact) > 4 else "****"


def redacted(value: Any) -> Any:
    """`value` (a parsed body) with account and card numbers cut to their last four."""
    if isinstance(value, dict):
        kept: dict[str, Any] = {}
        for name, item in value.items():
            lowered = name.lower() if isinstance(name, str) else name
            if lowered in DROPPED_FIELDS:
                kept[name] = "***"
            elif lowered in LAST_FOUR_FIELDS and isinstance(item, str | int):
                kept[name] = last_four(str(item))
            else:
                kept[name] = redacted(item)
        return kept
    if isinstance(value, list):
        return [redacted(item) for item in value]
    return value


def redacted_text(text: str) -> str:
    text = _IBAN_SHAPE.sub(lambda m: last_four(m.group(0)), text)
    return _CARD_SHAPE.sub(lambda m: last_four(re.sub("[ -]", "", m.group(0))), text)


CALL_GRACE = timedelta(milliseconds=200)


def call_deadline(timeout: timedelta) -> timedelta:
    """The longest any provider call may take, all phases together."""
    return timeout + CALL_GRACE


# An adapter's reading of a response: what it proves, and why (its documented mapping).
Mapping = Callable[[ProviderAnswer], Classification]


async def observe(
    call: Awaitable[httpx.Response],
    deadline: float | None = None,
    *,
    mapping: Mapping | None = None,
    keep_headers: tuple[str, ...] = (),
) -> ProviderAnswer:
    """Await one provider request and report what the wire showed.

    httpx's timeout applies to each phase (connect, each read...), so a provider
    that trickles its answer could hold a call open for ever; `deadline` bounds
    the whole call, which keeps it shorter than the sweeper's stale threshold.
    `mapping` is the adapter's reading of a response (a submit's); without it a
    response proves nothing. `keep_headers` are recorded in the detail (a
    provider's request id), lower-cased.
    """
    try:
        async with asyncio.timeout(deadline):
            # `call` reads the whole body (`ShardedClient.request`); a read that
            # fails mid-stream raises here too: still no (whole) answer.
            response = await call
    except NEVER_SENT as exc:
        return ProviderAnswer(
            Transport.NOT_SENT, error_class=_qualified(exc), detail={"error": str(exc)}
        )
    except Exception as exc:
        return ProviderAnswer(
            Transport.NO_RESPONSE, error_class=_qualified(exc), detail={"error": str(exc)}
        )
    detail: dict[str, Any] = {}
    body: Any = None  # what an unreadable body tells: nothing
    try:
        body = response.json()
        detail["body"] = redacted(body)
    except ValueError:
        detail["body_text"] = redacted_text(response.text[:2000])
    for name in keep_headers:
        if name in response.headers:
            detail[name.lower()] = response.headers[name]
    answer = ProviderAnswer(
        Transport.RESPONSE,
        status=response.status_code,
        error_code=_error_code(body) if response.status_code >= 400 else None,
        provider_reference=_reference(body) if response.is_success else None,
        retry_after=tuple(response.headers.get_list("retry-after")),
        detail=detail,
    )
    return replace(answer, mapped=mapping(answer)) if mapping is not None else answer


# httpcore's pool walks every one of its connections on each request and each
# response (encode/httpcore#1035, still open in httpcore 1.0.9): at 200
# connections that walk cost a worker more CPU than everything else it does.
# Several small pools keep each walk short.
SHARD_CONNECTIONS = 8

# An idle connection is dropped by the client after this long, before the
# server would close it: a server that closes an idle connection just as the
# client sends on it discards the request and hangs up ("Server disconnected
# without sending a response"), and a submit sent so ends UNKNOWN although it
# never reached the provider. httpx's default (5 s) equals uvicorn's and Node's
# keep-alive, so the two timers raced (docs/benchmarks.md, "the tails");
# nginx keeps 75 s, Apache 5 s.
IDLE_CONNECTION_SECONDS = 4.0

# Sent with every call in place of httpx.AsyncClient's defaults.
_HEADERS = {"Accept": "application/json", "User-Agent": "intentledger"}


@dataclass
class _Shard:
    transport: httpx.AsyncHTTPTransport
    in_flight: int = 0


class ShardedClient:
    """`max_connections` connections to one provider, as several small httpx pools.

    Each call takes the pool with the fewest calls in flight, so no call waits
    for a connection while another pool has one free: a call that queued would
    spend its deadline waiting and end as "no response".

    Calls go straight to each pool's `httpx.AsyncHTTPTransport`, not through an
    `httpx.AsyncClient`: the client's layers (URL merging, auth, redirects,
    cookies, event hooks) do nothing for a provider API and cost a worker about
    a tenth of its CPU (docs/benchmarks.md). The transport is where httpx maps
    httpcore's errors to its own classes, so `observe` sees the same exceptions
    (research S21, S22). Proxy variables from the environment are not read.
    """

    def __init__(
        self,
        max_connections: int,
        base_url: str = "",
        timeout: httpx.Timeout = httpx.Timeout(5.0),
    ) -> None:
        shards = max(1, math.ceil(max_connections / SHARD_CONNECTIONS))
        per_shard = math.ceil(max_connections / shards)
        # One TLS context for all the pools: each costs tens of milliseconds to
        # build (it loads the CA store), and they would all be the same.
        tls = httpx.create_ssl_context()
        limits = httpx.Limits(
            max_connections=per_shard,
            max_keepalive_connections=per_shard,
            keepalive_expiry=IDLE_CONNECTION_SECONDS,
        )
        self._shards = [
            _Shard(httpx.AsyncHTTPTransport(verify=tls, limits=limits)) for _ in range(shards)
        ]
        self._base_url = base_url.rstrip("/")
        # Without this extension httpcore would wait for ever: the per-phase timeouts
        # are what name a slow phase (httpx.ReadTimeout, httpx.ConnectTimeout...).
        self._extensions = {"timeout": timeout.as_dict()}
        self._closed = False

    @contextmanager
    def lease(self) -> Iterator[httpx.AsyncHTTPTransport]:
        shard = min(self._shards, key=lambda s: s.in_flight)
        shard.in_flight += 1
        try:
            yield shard.transport
        finally:
            shard.in_flight -= 1

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        data: dict[str, str] | None = None,
        params: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        """Send one request and read the whole answer, as `AsyncClient.request` would."""
        if self._closed:
            # A closed transport would quietly open a new pool that nothing closes.
            raise RuntimeError("the provider client is closed")
        request = httpx.Request(
            method,
            self._base_url + path,
            json=json,
            data=data,  # form-encoded (Stripe's wire format)
            params=params,
            headers=_HEADERS if headers is None else {**_HEADERS, **headers},
            extensions=self._extensions,
        )
        with self.lease() as transport:
            response = await transport.handle_async_request(request)
            response.request = request
            try:
                await response.aread()
            except BaseException:
                # Gives the connection back (or drops it) whatever cut the read short.
                await response.aclose()
                raise
        return response

    async def aclose(self) -> None:
        self._closed = True
        for shard in self._shards:
            await shard.transport.aclose()
