"""Webhook signatures, pure: Stripe's `Stripe-Signature` scheme (what we verify)
and Standard Webhooks (what we sign for merchants, at the end).

Stripe signs `"{timestamp}.{raw body}"` with HMAC-SHA256 under the endpoint's
secret and sends `Stripe-Signature: t=<timestamp>,v1=<hex>[,v1=<hex>...]`;
during a secret rotation several `v1` signatures (and several secrets here)
are valid at once. A signature is accepted only if one of the `v1` values
matches under one of our secrets (compared in constant time) and the timestamp
is within the tolerance of now, either way: an old signature replayed later is
refused. Other schemes (`v0`, a test-mode scheme) are ignored.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
from collections.abc import Sequence

TIMESTAMP = re.compile(r"[0-9]{1,12}")
# Stripe's documented default tolerance: five minutes.
STRIPE_TOLERANCE_SECONDS = 300


class SignatureRefused(ValueError):
    """Why a webhook's signature was not accepted (never includes a secret)."""


def stripe_signature(payload: bytes, secret: str, timestamp: int) -> str:
    """The `v1` signature Stripe computes for `payload` at `timestamp`."""
    signed = f"{timestamp}.".encode() + payload
    return hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()


def stripe_signature_header(payload: bytes, secret: str, timestamp: int) -> str:
    """A whole `Stripe-Signature` header value, as Stripe (and our sandbox) sends it."""
    return f"t={timestamp},v1={stripe_signature(payload, secret, timestamp)}"


def verify_stripe_signature(
    payload: bytes,
    header: str | None,
    secrets: Sequence[str],
    now: int,
    tolerance: int = STRIPE_TOLERANCE_SECONDS,
) -> int:
    """The signed timestamp, if `header` signs `payload` under one of `secrets`
    within `tolerance` seconds of `now`; otherwise SignatureRefused."""
    if not secrets or not all(secrets):
        raise SignatureRefused("no webhook secret, or an empty one, is configured")
    if not header:
        raise SignatureRefused("no Stripe-Signature header")
    timestamps: list[str] = []
    signatures: list[str] = []
    for part in header.split(","):
        name, _, value = part.strip().partition("=")
        if name == "t":
            timestamps.append(value)
        elif name == "v1":
            signatures.append(value)
    # ASCII digits only, and few of them: str.isdigit() takes "²", and int() of
    # thousands of digits raises.
    if len(timestamps) != 1 or not TIMESTAMP.fullmatch(timestamps[0]):
        raise SignatureRefused("the header does not carry exactly one numeric timestamp")
    if not signatures:
        raise SignatureRefused("the header carries no v1 signature")
    timestamp = int(timestamps[0])
    if abs(now - timestamp) > tolerance:
        raise SignatureRefused(
            f"the timestamp is {now - timestamp} s from now, outside the {tolerance} s tolerance"
        )
    expected = [stripe_signature(payload, secret, timestamp) for secret in secrets]
    # Every pair is compared, each in constant time: no early exit tells which came close.
    matched = False
    for candidate in signatures:
        for wanted in expected:
            matched |= hmac.compare_digest(candidate.encode(), wanted.encode())
    if not matched:
        raise SignatureRefused("no v1 signature matches a configured secret")
    return timestamp


# -- Standard Webhooks (what we sign for merchants) ---------------------------
#
# The Standard Webhooks specification: the signed content is
# "{webhook-id}.{webhook-timestamp}.{body}", HMAC-SHA256 under the key that is
# the base64 text after `whsec_`, sent as `webhook-signature: v1,<base64>`
# (several, space-separated, during a rotation).

STANDARD_SECRET_PREFIX = "whsec_"
STANDARD_TOLERANCE_SECONDS = 300


def standard_secret_key(secret: str) -> bytes:
    """The HMAC key of a `whsec_` secret (padding optional, as the reference
    library reads it); SignatureRefused for anything else."""
    encoded = secret.removeprefix(STANDARD_SECRET_PREFIX)
    try:
        key = base64.b64decode(encoded + "=" * (-len(encoded) % 4), validate=True)
    except ValueError as exc:
        raise SignatureRefused("the secret is not a whsec_ base64 key") from exc
    if not key:
        raise SignatureRefused("the secret is empty")
    return key


def standard_signature(message_id: str, timestamp: int, body: bytes, secret: str) -> str:
    """The `webhook-signature` value for one message: `v1,<base64>`."""
    signed = f"{message_id}.{timestamp}.".encode() + body
    digest = hmac.new(standard_secret_key(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def verify_standard_signature(
    message_id: str | None,
    timestamp: str | None,
    signatures: str | None,
    body: bytes,
    secret: str,
    now: float,
    tolerance: int = STANDARD_TOLERANCE_SECONDS,
) -> int:
    """The signed timestamp if one `v1` signature matches within `tolerance`
    seconds of `now`, either way; otherwise SignatureRefused."""
    key = standard_secret_key(secret)
    stamp = timestamp or ""
    if not message_id or not TIMESTAMP.fullmatch(stamp):
        raise SignatureRefused("missing webhook-id or a numeric webhook-timestamp")
    if abs(now - int(stamp)) > tolerance:
        raise SignatureRefused("webhook-timestamp is outside the tolerance")
    signed = f"{message_id}.{stamp}.".encode() + body
    expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest())
    matched = False
    for candidate in (signatures or "").split():
        version, _, value = candidate.partition(",")
        if version == "v1":
            matched |= hmac.compare_digest(value.encode(), expected)
    if not matched:
        raise SignatureRefused("no v1 signature matches")
    return int(stamp)
