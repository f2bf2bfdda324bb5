"""Request checks shared by every mutation endpoint."""

from __future__ import annotations

import re

from intentledger.web.problems import Problem

SF_STRING = re.compile(r'"[\x21\x23-\x5b\x5d-\x7e]+"')
VISIBLE_ASCII_KEY = re.compile(r"[\x21-\x7e]{1,255}")


def first_field(raw: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    """The first value of the head's field `name`, as Starlette's `Headers.get`
    reads it (names compared as they are: ASGI servers send them in lower
    case; values decoded as Latin-1), without building a `Headers` for one
    field."""
    for field, value in raw:
        if field == name:
            return value.decode("latin-1")
    return None


def valid_idempotency_key(value: str | None) -> str:
    """1-255 visible ASCII characters (0x21-0x7E), (docs/design.md#idempotency-keys)."""
    if value is None:
        raise Problem(
            400,
            "idempotency-key-missing",
            "Bad Request",
            "this request needs an Idempotency-Key header",
        )
    # The IETF draft writes the key as a structured-field string ("abc"); Stripe
    # and most clients send it bare (abc). Both name the same key: a quoted
    # string with no quote or backslash inside is unwrapped; anything else is
    # taken verbatim, as before.
    if SF_STRING.fullmatch(value):
        value = value[1:-1]
    # Starlette decodes header bytes as Latin-1, so non-ASCII shows up here as > 0x7E.
    if not VISIBLE_ASCII_KEY.fullmatch(value):
        raise Problem(
            400,
            "idempotency-key-invalid",
            "Bad Request",
            "Idempotency-Key must be 1-255 visible ASCII characters (no spaces), bare "
            'or as a quoted string: abc or "abc"',
        )
    return value
