"""Request checks shared by every mutation endpoint."""

from __future__ import annotations

from intentledger.api.problems import Problem


def valid_idempotency_key(value: str | None) -> str:
    """1-255 visible ASCII characters (0x21-0x7E), as DESIGN.md's contract says."""
    if value is None:
        raise Problem(
            400,
            "idempotency-key-missing",
            "Bad Request",
            "this request needs an Idempotency-Key header",
        )
    # Starlette decodes header bytes as Latin-1, so non-ASCII shows up here as > 0x7E.
    if not 1 <= len(value) <= 255 or not all(0x21 <= ord(c) <= 0x7E for c in value):
        raise Problem(
            400,
            "idempotency-key-invalid",
            "Bad Request",
            "Idempotency-Key must be 1-255 visible ASCII characters (no spaces)",
        )
    return value
