"""Provider calls over aiohttp, and turning each into a ProviderAnswer by the
precise exception class.

Only the exceptions below count as proof that nothing was sent; everything
else that goes wrong is "no response".
"""

from __future__ import annotations

import asyncio
import functools
import json as jsonlib
import math
import re
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import aiohttp
import certifi
import orjson
from multidict import CIMultiDictProxy

from intentledger.deadline import Deadline
from intentledger.domain.quick_init import quick_init
from intentledger.domain.transport import Classification, ProviderAnswer, Transport

# The request was never written, so the provider cannot have read it. In
# aiohttp (3.10 and later; read in 3.14's client.py and connector.py):
# - ClientConnectorError and its subclasses (DNS, TLS, certificate) are raised
#   only by the connector while it opens a connection;
# - ConnectionTimeoutError is raised only around `connector.connect`: the wait
#   for a free connection in the pool, and the TCP and TLS connect.
# A request is written only after `connect` returns. Everything past that point
# (ServerDisconnectedError, ClientOSError, SocketTimeoutError on the read,
# ClientPayloadError, a malformed answer) is "no response". ServerTimeoutError,
# the base of both timeouts, is deliberately not here: a read timeout is one.
NEVER_SENT: tuple[type[Exception], ...] = (
    aiohttp.ClientConnectorError,
    aiohttp.ConnectionTimeoutError,
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


# The client's own timeout fires first for a single slow phase (so the record
# names the exact class, e.g. aiohttp.SocketTimeoutError); the deadline only cuts
# off calls whose phases each stayed under it.
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


# What PostgreSQL stores of none of its text and jsonb values, though SQLite
# keeps them: the NUL character and a lone surrogate (and in jsonb, a number
# JSON cannot hold: NaN, an infinity, or a number too large for a double, which
# Python reads as one). A provider's answer is recorded whatever it holds: an
# answer the ledger could not store would leave its payment SUBMITTING
# although the provider moved the money, and the same answer replayed at every
# look (tests/test_unstorable_answers.py). So each such character of an answer
# is read as U+FFFD, the replacement character, and such a number as its text
# ("NaN", "1e400").
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def storable_text(text: str) -> str:
    """`text` with each character a database of ours cannot store as U+FFFD."""
    return _UNSTORABLE.sub("\ufffd", text)


def _number(text: str) -> float | str:
    """A JSON number with a fraction or an exponent: a float, or its text when
    no double holds it (an overflow reads as an infinity)."""
    value = float(text)
    return value if math.isfinite(value) else text


# The deepest an answer's body is read as JSON; a deeper one is kept as text.
# Every walk of a body after its reading (the redaction, the adapters' own,
# the writers' JSON) recurses, a level or two of Python's stack a level, and
# a body a few hundred levels deep ran them out of it: an answer nobody could
# record. No provider's answer nests near this (the edge takes requests to 32).
MAX_ANSWER_DEPTH = 64
# The body's own reading, made once: a decoder made at every call cost about
# a microsecond an answer.
_DECODER = jsonlib.JSONDecoder(parse_constant=str, parse_float=_number)


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether `value` nests containers deeper than `limit` (without recursing)."""
    pending: list[tuple[Any, int]] = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict | list):
            if depth > limit:
                return True
            children = item.values() if isinstance(item, dict) else item
            pending.extend((child, depth + 1) for child in children)
    return False


def _storable(value: Any) -> Any:
    if isinstance(value, str):
        return storable_text(value)
    if isinstance(value, dict):
        return {
            storable_text(name) if isinstance(name, str) else name: _storable(item)
            for name, item in value.items()
        }
    if isinstance(value, list):
        return [_storable(item) for item in value]
    return value


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
            elif isinstance(item, dict | list):
                kept[name] = redacted(item)
            else:
                # A scalar is kept as it is, without a call: every provider
                # answer's body passes here.
                kept[name] = item
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
    call: Awaitable[ProviderResponse],
    deadline: float | None = None,
    *,
    mapping: Mapping | None = None,
    keep_headers: tuple[str, ...] = (),
) -> ProviderAnswer:
    """Await one provider request and report what the wire showed.

    The client's timeout applies to each phase (connect, each read...), so a provider
    that trickles its answer could hold a call open for ever; `deadline` bounds
    the whole call, which keeps it shorter than the sweeper's stale threshold.
    `mapping` is the adapter's reading of a response (a submit's); without it a
    response proves nothing. `keep_headers` are recorded in the detail (a
    provider's request id), lower-cased.
    """
    # A timer, not `asyncio.timeout`: the same rule at a fraction of its CPU,
    # on every call (intentledger/deadline.py).
    whole_call = Deadline(deadline)
    try:
        # `call` reads the whole body (`ProviderClient.request`); a read that
        # fails mid-stream raises here too: still no (whole) answer.
        response = await call
    except asyncio.CancelledError:
        if not whole_call.expired():
            raise
        # What `asyncio.timeout` raised in its place, recorded as it recorded it.
        return _no_response(TimeoutError())
    except NEVER_SENT as exc:
        return ProviderAnswer(
            Transport.NOT_SENT,
            error_class=_qualified(exc),
            detail={"error": storable_text(str(exc))},
        )
    except Exception as exc:
        return _no_response(exc)
    finally:
        whole_call.cancel()
    return answer_of(response, mapping=mapping, keep_headers=keep_headers)


def _no_response(exc: Exception) -> ProviderAnswer:
    return ProviderAnswer(
        Transport.NO_RESPONSE,
        error_class=_qualified(exc),
        detail={"error": storable_text(str(exc))},
    )


def answer_of(
    response: ProviderResponse,
    *,
    mapping: Mapping | None = None,
    keep_headers: tuple[str, ...] = (),
) -> ProviderAnswer:
    """What a whole answer shows, read as `observe` reads every response (the
    conformance kit reads made-up answers through it too)."""
    detail: dict[str, Any] = {}
    body: Any = None  # what an unreadable body tells: nothing
    try:
        body = response.json()
        detail["body"] = redacted(body)
    except (ValueError, RecursionError):
        # Not JSON, nested deeper than `MAX_ANSWER_DEPTH`, or deeper than the
        # parser itself goes (about a thousand levels, a RecursionError):
        # recorded as text, never left unrecorded.
        body = None
        detail["body_text"] = storable_text(redacted_text(response.text[:2000]))
    for name in keep_headers:
        if name in response.headers:
            detail[name.lower()] = storable_text(response.headers[name])
    seen: dict[str, Any] = {
        "status": response.status_code,
        "error_code": _error_code(body) if response.status_code >= 400 else None,
        "provider_reference": _reference(body) if response.is_success else None,
        # A header's bytes beyond UTF-8 come as lone surrogates (aiohttp's
        # reading), which no database of ours stores.
        "retry_after": tuple(storable_text(v) for v in response.headers.getall("retry-after", ())),
        "detail": detail,
    }
    answer = ProviderAnswer(Transport.RESPONSE, **seen)
    if mapping is None:
        return answer
    # Built again rather than by `dataclasses.replace`, which walks every field:
    # this runs for every provider answer.
    return ProviderAnswer(Transport.RESPONSE, **seen, mapped=mapping(answer))


# An idle connection is dropped by the client after this long, before the
# server would close it: a server that closes an idle connection just as the
# client sends on it discards the request and hangs up ("Server disconnected"),
# and a submit sent so ends UNKNOWN although it never reached the provider.
# uvicorn's and Node's keep-alive is 5 s, nginx's 75 s, Apache's 5 s
# (docs/benchmarks.md, "the tails").
IDLE_CONNECTION_SECONDS = 4.0

# Sent with every call, in place of aiohttp's defaults.
_HEADERS = {"Accept": "application/json", "User-Agent": "intentledger"}


def request_body(value: Any) -> bytes:
    """A request's JSON body. orjson: the standard library's encoder was
    nearly a tenth of a worker's CPU. A value orjson refuses (an integer
    beyond 64 bits) goes through the standard library as before. Only the
    bytes' spacing and escaping differ, never the JSON a provider parses (a
    body is a validated request's, where the API refused NaN and infinities:
    api/edge.py)."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        return jsonlib.dumps(value).encode()


@functools.cache
def _tls_context() -> ssl.SSLContext:
    # The Mozilla CA bundle, as httpx used before: trust does not change with the
    # machine's CA store. Built once a process, and shared by its clients (aiohttp
    # never changes it): loading the store costs about 17 ms of CPU.
    return ssl.create_default_context(cafile=certifi.where())


@quick_init
@dataclass(frozen=True)
class ProviderResponse:
    """A whole answer, read before the connection went back to its pool."""

    status_code: int
    headers: CIMultiDictProxy[str]
    content: bytes

    @property
    def is_success(self) -> bool:
        return 200 <= self.status_code < 300

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        """The body parsed; ValueError when it is not JSON (or not text).

        The standard library's parser, not orjson: orjson reads an integer
        beyond 64 bits as a float, its digits lost, and a guard sending such
        bodies here (a search for a run of 19 digits) cost more instructions
        than orjson saved: 29,200 against 25,000 per answer of the bench's
        stand-in (docs/benchmarks.md, step 52).

        What it reads is what every database of ours can store (`_UNSTORABLE`
        above): NaN, the infinities and a number no double holds as their
        text, a NUL or a lone surrogate in a string or a name as U+FFFD. In
        UTF-8 only a `\\u` escape or a byte beyond ASCII can make either
        character (the parser refuses a raw control character in a string,
        and reads UTF-8's bytes of a surrogate as one); a body in UTF-16 or
        UTF-32, which the parser also reads, has NUL bytes or a byte-order
        mark beyond ASCII. So an answer with none of these is not walked
        again.

        A body nested deeper than `MAX_ANSWER_DEPTH` is not JSON here (a
        ValueError): it cannot be deeper than it has brackets, so only one
        with more is measured."""
        content = self.content
        # What `json.loads` does with bytes, with the decoder made once.
        body = _DECODER.decode(content.decode(jsonlib.detect_encoding(content), "surrogatepass"))
        if content.count(b"{") + content.count(b"[") > MAX_ANSWER_DEPTH and _deeper_than(
            body, MAX_ANSWER_DEPTH
        ):
            raise ValueError(f"the body nests deeper than {MAX_ANSWER_DEPTH} levels")
        if b"\\u" in content or b"\x00" in content or not content.isascii():
            return _storable(body)
        return body


class ProviderClient:
    """Up to `max_connections` connections to one provider, in one aiohttp pool.

    aiohttp over httpx: its C parser and plain asyncio streams cost a call about
    a fifth of the CPU httpx's transport did (httpcore, h11 and anyio were more
    than half of a worker; docs/benchmarks.md). Each call reads its whole answer
    before returning. Redirects are not followed, cookies not kept, proxy
    variables from the environment not read; aiohttp resends a request on a
    reused connection the server closed only for idempotent methods (GET here:
    a lookup), never a POST.

    `timeout` bounds each phase: the wait for a connection and its connect
    (together, then a ConnectionTimeoutError: not sent), and each read of the
    answer (SocketTimeoutError: no response). `observe`'s deadline bounds the
    whole call. The session is opened on first use, in the running event loop.
    """

    def __init__(
        self,
        max_connections: int,
        base_url: str = "",
        timeout: timedelta = timedelta(seconds=5),
    ) -> None:
        self._max_connections = max_connections
        self._base_url = base_url.rstrip("/")
        seconds = timeout.total_seconds()
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=seconds, sock_connect=seconds, sock_read=seconds
        )
        # Made with the client, not at its first call: loading the CA bundle
        # there would hold the event loop, and every call of the first claim
        # with it, for as long.
        self._tls = _tls_context()
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=self._max_connections,
                limit_per_host=0,
                keepalive_timeout=IDLE_CONNECTION_SECONDS,
                ssl=self._tls,
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                headers=_HEADERS,
                timeout=self._timeout,
                cookie_jar=aiohttp.DummyCookieJar(),
                json_serialize_bytes=request_body,
                trust_env=False,
            )
        return self._session

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        data: dict[str, str] | None = None,
        params: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
    ) -> ProviderResponse:
        """Send one request and read the whole answer."""
        if self._closed:
            # A closed client would quietly open a new pool that nothing closes.
            raise RuntimeError("the provider client is closed")
        async with self._open().request(
            method,
            self._base_url + path,
            json=json,
            data=data,  # form-encoded (Stripe's wire format)
            params=params,
            headers=headers,
            allow_redirects=False,
        ) as response:
            content = await response.read()
            return ProviderResponse(response.status, response.headers, content)

    async def aclose(self) -> None:
        self._closed = True
        if self._session is not None:
            await self._session.close()
