"""The HTTP edge: what every /v1 request must get past before any route runs.

A pure ASGI middleware, so the checks cost the intake hot path almost nothing
and happen *before* a body is read or a route writes anything:

1. ambiguous headers: a repeated `Idempotency-Key` or `Authorization` -> 400
   (a proxy and this service could otherwise read different values);
2. path segments: every id this service issues is 1-40 of `[A-Za-z0-9_-]`;
   anything else (too long, `%00`, other bytes) names nothing here -> 404,
   before it can reach a `VARCHAR(40)` column;
3. authentication, before the body is read: no work for strangers -> 401
   (provider webhooks prove themselves by their signature instead);
4. the body: `Content-Encoding` other than identity -> 415; a declared or
   streamed size over 64 KiB -> 413; not all there within the body timeout
   (a client trickling it) -> 408; a non-empty body that is not
   `application/json` (charset utf-8 or none) -> 415; then one strict JSON
   parse (UTF-8 only, no byte-order mark, no duplicate keys, no NaN or
   Infinity, integers of at most 40 digits, at most 32 levels of nesting, no
   NUL in any string) -> 400. A number whose value is whole (`1.0`, `1e2`) is
   that integer, as JSON Schema counts it; its text decides, not a float's
   rounding, so `1.0000000000000001` stays a fraction. The parsed value
   travels to the route in the request's state, and the bytes are replayed to
   routes that read them again.

Every refusal is an `application/problem+json` answer and writes nothing.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from decimal import Decimal
from typing import Any

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from intentledger.deadline import Deadline
from intentledger.web.auth import authenticate_scope
from intentledger.web.problems import Problem, problem_response

MAX_BODY_BYTES = 64 * 1024
DEFAULT_BODY_TIMEOUT = 30.0
MAX_JSON_DEPTH = 32
MAX_INTEGER_DIGITS = 40
# The ids this service issues (op_…, md_…, crd_…, ben_…) and its literal path
# segments all fit; the longest id column is VARCHAR(40).
PATH_SEGMENT = re.compile(r"[A-Za-z0-9_-]{1,40}")
GUARDED_PREFIX = "/v1/"
# Provider webhooks carry no bearer token: the route verifies their signature
# over the raw body (api/webhook_routes.py). Every other check still applies.
SIGNED_PREFIX = "/v1/provider-webhooks/"
SINGLETON_HEADERS = (b"idempotency-key", b"authorization")
BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
JSON_STATE = "json_body"
NO_BODY = object()


class EdgeGuard:
    def __init__(self, app: ASGIApp, body_timeout: float = DEFAULT_BODY_TIMEOUT) -> None:
        self.app = app
        self.body_timeout = body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(GUARDED_PREFIX):
            await self.app(scope, receive, send)
            return
        try:
            receive = await admit(scope, receive, self.body_timeout)
        except Problem as problem:
            await refusal(problem, scope)(scope, receive, send)
            return
        await self.app(scope, receive, send)


async def admit(
    scope: Scope, receive: Receive, body_timeout: float, *, path_checked: bool = False
) -> Receive:
    """Every check above, for one /v1 request: raises the Problem that refuses
    it, or returns the `receive` its route reads the body from. The intake
    route calls it directly (api/app.py: LedgerApp), with `path_checked` as
    it matched its one path exactly; the rest through EdgeGuard."""
    headers = _headers(scope)
    if not path_checked:
        _refuse_unknown_path(scope["path"])
    if not scope["path"].startswith(SIGNED_PREFIX):
        # Stored in the request's state: routes get it from there (auth.py).
        await authenticate_scope(scope)
    if scope["method"] not in BODY_METHODS:
        return receive
    body = await _read_body(headers, receive, body_timeout)
    scope.setdefault("state", {})[JSON_STATE] = (
        parse_json(body, headers.get(b"content-type")) if body else NO_BODY
    )
    return _replay(body, receive)


def refusal(problem: Problem, scope: Scope) -> Response:
    """The problem+json answer to a request the edge refused."""
    return problem_response(
        problem.status,
        problem.slug,
        problem.title,
        problem.detail,
        instance=scope["path"],
        headers=problem.headers,
    )


def _headers(scope: Scope) -> dict[bytes, bytes]:
    """The head's fields by lower-case name (a repeated one's last value), in one
    pass that refuses a repeated `Idempotency-Key` or `Authorization`."""
    headers: dict[bytes, bytes] = {}
    for name, value in scope["headers"]:
        name = name.lower()
        if name in headers and name in SINGLETON_HEADERS:
            raise _ambiguity(scope["headers"])
        headers[name] = value
    return headers


def _ambiguity(raw: list[tuple[bytes, bytes]]) -> Problem:
    """The refusal of a head that repeats a singleton field: it names the first
    of `SINGLETON_HEADERS` the head repeats."""
    names = [name.lower() for name, _ in raw]
    repeated = next(singleton for singleton in SINGLETON_HEADERS if names.count(singleton) > 1)
    header = repeated.decode().title()
    return Problem(
        400,
        "ambiguous-header",
        "Bad Request",
        f"{header} was sent more than once: send it once",
    )


def _refuse_unknown_path(path: str) -> None:
    for segment in path[len(GUARDED_PREFIX) :].split("/"):
        if segment and not PATH_SEGMENT.fullmatch(segment):
            raise Problem(
                404,
                "not-found",
                "Not Found",
                "no such resource: ids are 1-40 letters, digits, '_' or '-'",
            )


async def _read_body(headers: dict[bytes, bytes], receive: Receive, within: float) -> bytes:
    encoding = headers.get(b"content-encoding", b"identity").strip().lower()
    if encoding not in (b"", b"identity"):
        raise Problem(
            415,
            "unsupported-content-encoding",
            "Unsupported Media Type",
            f"Content-Encoding {encoding.decode('latin-1')!r} is not accepted: send the body as is",
        )
    declared = headers.get(b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large()
    body = bytearray()
    deadline = Deadline(within)
    try:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            body += message.get("body", b"")
            if len(body) > MAX_BODY_BYTES:
                raise too_large()
            if not message.get("more_body", False):
                break
    except asyncio.CancelledError as exc:
        if not deadline.expired():
            raise
        raise Problem(
            408,
            "body-timeout",
            "Request Timeout",
            f"the body did not arrive within {within:g} s",
            headers={"Connection": "close"},
        ) from exc
    finally:
        deadline.cancel()
    return bytes(body)


def too_large() -> Problem:
    return Problem(
        413, "body-too-large", "Content Too Large", f"the body exceeds {MAX_BODY_BYTES} bytes"
    )


def _replay(body: bytes, original: Receive) -> Receive:
    """The body once, as the route expects to read it; after that the server's
    own channel, so a real disconnect is still reported when it happens."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await original()

    return receive


# -- strict JSON ----------------------------------------------------------------------------


def _malformed(detail: str) -> Problem:
    return Problem(400, "malformed-json", "Bad Request", detail)


def require_json_media_type(content_type: bytes | None) -> None:
    """`application/json`, with `charset=utf-8` or no charset; anything else is 415."""
    if content_type is None:
        raise _unsupported("a body needs Content-Type: application/json")
    media, *parameters = content_type.decode("latin-1").split(";")
    if media.strip().lower() != "application/json":
        raise _unsupported(f"Content-Type {media.strip()!r} is not accepted: send application/json")
    for parameter in parameters:
        name, _, value = parameter.strip().partition("=")
        if name.strip().lower() == "charset" and value.strip().strip('"').lower() not in (
            "utf-8",
            "utf8",
        ):
            raise _unsupported(f"charset {value.strip()!r} is not accepted: JSON is UTF-8")


def _unsupported(detail: str) -> Problem:
    return Problem(415, "unsupported-media-type", "Unsupported Media Type", detail)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # A repeated key is a parser differential: a proxy may read the first value
    # where json.loads keeps the last. Refuse it rather than guess.
    document: dict[str, Any] = {}
    for key, value in pairs:
        if key in document:
            raise _malformed(f"the key {key!r} appears twice in one object")
        document[key] = value
    return document


def _integer(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INTEGER_DIGITS:
        raise _malformed(f"an integer of more than {MAX_INTEGER_DIGITS} digits")
    return int(text)


def _number(text: str) -> int | float:
    """A number written with a fraction or an exponent. JSON has one number
    type and JSON Schema's `integer` admits 1.0, so a whole value is an int;
    decided on the exact decimal, never on a float that rounded it."""
    try:
        exact = Decimal(text)
    except ArithmeticError as exc:  # an exponent past what any decimal holds
        raise _malformed(f"the number {text} is out of range") from exc
    if exact.adjusted() < MAX_INTEGER_DIGITS and exact == exact.to_integral_value():
        return int(exact)
    return _finite(text)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _malformed(f"the number {text} is out of range")
    return value


def _constant(text: str) -> Any:
    raise _malformed(f"{text} is not JSON")


# Built once: json.loads with these hooks builds a decoder on every call.
_STRICT_DECODER = json.JSONDecoder(
    object_pairs_hook=_no_duplicates,
    parse_int=_integer,
    parse_float=_number,
    parse_constant=_constant,
)


def parse_json(body: bytes, content_type: bytes | None) -> Any:
    """The body's one JSON value, parsed strictly (see the module docstring)."""
    require_json_media_type(content_type)
    if body.startswith(b"\xef\xbb\xbf"):
        raise _malformed("the body starts with a byte-order mark: send plain UTF-8")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _malformed(f"the body is not UTF-8: {exc}") from exc
    try:
        value = _STRICT_DECODER.decode(text)
    except json.JSONDecodeError as exc:
        raise _malformed(f"the body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise _malformed(f"the body nests deeper than {MAX_JSON_DEPTH} levels") from exc
    _check_shape(value)
    return value


def _check_shape(value: Any) -> None:
    """Depth and text: walked without recursion, so no input can exhaust the stack.
    Only containers wait their turn; the text in one is checked as it is met,
    which spares intake's flat objects a stack entry per value."""
    pending: list[tuple[Any, int]] = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, str):  # only a top-level value gets here
            if "\x00" in item:
                raise _nul()
        elif isinstance(item, dict | list):
            if depth > MAX_JSON_DEPTH:
                raise _malformed(f"the body nests deeper than {MAX_JSON_DEPTH} levels")
            children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
            for child in children:
                if isinstance(child, str):
                    if "\x00" in child:
                        raise _nul()
                elif isinstance(child, dict | list):
                    pending.append((child, depth + 1))


def _nul() -> Problem:
    return _malformed("text may not contain the NUL character (\\u0000)")
