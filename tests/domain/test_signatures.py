"""Stripe-Signature, ours against the official `stripe` SDK in both directions,
and every way a signature must be refused."""

from __future__ import annotations

import json
import time

import pytest
import stripe
from hypothesis import given
from hypothesis import strategies as st

from intentledger.domain.signatures import (
    SignatureRefused,
    stripe_signature_header,
    verify_stripe_signature,
)

SECRET = "whsec_test_current"
OLD_SECRET = "whsec_test_previous"
EVENT = json.dumps(
    {
        "id": "evt_1",
        "object": "event",
        "type": "payment_intent.succeeded",
        "data": {"object": {"id": "pi_1", "object": "payment_intent", "status": "succeeded"}},
    }
).encode()


def test_the_sdk_accepts_what_we_sign() -> None:
    header = stripe_signature_header(EVENT, SECRET, int(time.time()))
    event = stripe.Webhook.construct_event(EVENT, header, SECRET)
    assert event.id == "evt_1"


def test_we_accept_what_the_sdk_signs() -> None:
    now = int(time.time())
    header = stripe.WebhookSignature.generate_signature_header(EVENT.decode(), SECRET, now)
    assert verify_stripe_signature(EVENT, header, [SECRET], now) == now


def test_during_a_rotation_either_secret_and_either_signature_verifies() -> None:
    now = 1_800_000_000
    old = stripe_signature_header(EVENT, OLD_SECRET, now)
    new = stripe_signature_header(EVENT, SECRET, now).split(",")[1]
    both = f"{old},{new}"  # Stripe sends one v1 per secret while both are live
    assert verify_stripe_signature(EVENT, both, [SECRET], now) == now
    assert verify_stripe_signature(EVENT, both, [OLD_SECRET], now) == now
    assert verify_stripe_signature(EVENT, old, [SECRET, OLD_SECRET], now) == now


@pytest.mark.parametrize(
    ("header", "why"),
    [
        (None, "no Stripe-Signature"),
        ("", "no Stripe-Signature"),
        ("v1=abc", "timestamp"),
        ("t=1800000000", "no v1"),
        ("t=1800000000,t=1800000001,v1=abc", "timestamp"),
        ("t=soon,v1=abc", "timestamp"),
        ("t=1800000000,v0=" + "0" * 64, "no v1"),
        ("t=1800000000,v1=" + "0" * 64, "matches"),
        ("t=\u00b2,v1=abc", "timestamp"),  # a digit to str.isdigit(), not to int()
        ("t=" + "1" * 5000 + ",v1=abc", "timestamp"),  # beyond int()'s digit limit
    ],
)
def test_malformed_or_wrong_headers_are_refused(header: str | None, why: str) -> None:
    with pytest.raises(SignatureRefused, match=why):
        verify_stripe_signature(EVENT, header, [SECRET], 1_800_000_000)


def test_a_stale_or_future_signature_is_refused() -> None:
    signed_at = 1_800_000_000
    header = stripe_signature_header(EVENT, SECRET, signed_at)
    assert verify_stripe_signature(EVENT, header, [SECRET], signed_at + 300) == signed_at
    for now in (signed_at + 301, signed_at - 301):
        with pytest.raises(SignatureRefused, match="tolerance"):
            verify_stripe_signature(EVENT, header, [SECRET], now)


def test_without_a_secret_nothing_verifies() -> None:
    header = stripe_signature_header(EVENT, SECRET, 1_800_000_000)
    for secrets in ([], [""], [SECRET, ""]):
        with pytest.raises(SignatureRefused, match="no webhook secret"):
            verify_stripe_signature(EVENT, header, secrets, 1_800_000_000)


@given(flip=st.integers(min_value=0, max_value=len(EVENT) - 1))
def test_any_changed_byte_of_the_body_is_refused(flip: int) -> None:
    now = 1_800_000_000
    header = stripe_signature_header(EVENT, SECRET, now)
    tampered = bytearray(EVENT)
    tampered[flip] ^= 0x01
    with pytest.raises(SignatureRefused):
        verify_stripe_signature(bytes(tampered), header, [SECRET], now)


def test_the_refusal_never_names_a_secret() -> None:
    with pytest.raises(SignatureRefused) as refused:
        verify_stripe_signature(EVENT, "t=1800000000,v1=00", [SECRET, OLD_SECRET], 1_800_000_000)
    assert SECRET not in str(refused.value) and OLD_SECRET not in str(refused.value)


# -- Standard Webhooks: ours against the reference library, both ways -------------------------


def test_the_reference_library_verifies_what_we_sign_and_we_verify_what_it_signs() -> None:
    from datetime import UTC, datetime

    import standardwebhooks

    from intentledger.domain.signatures import (
        standard_signature,
        verify_standard_signature,
    )
    from intentledger.engine.webhook_endpoints import new_secret

    secret = new_secret()
    body = b'{"type":"operation.outcome_known","data":{"id":"op_1"}}'
    now = datetime.now(UTC)
    stamp = int(now.timestamp())
    headers = {
        "webhook-id": "evt_1",
        "webhook-timestamp": str(stamp),
        "webhook-signature": standard_signature("evt_1", stamp, body, secret),
    }
    assert standardwebhooks.Webhook(secret).verify(body, headers)["data"]["id"] == "op_1"

    theirs = standardwebhooks.Webhook(secret).sign("evt_2", now, body.decode())
    assert verify_standard_signature("evt_2", str(stamp), theirs, body, secret, stamp) == stamp
    with pytest.raises(SignatureRefused):
        verify_standard_signature("evt_3", str(stamp), theirs, body, secret, stamp)
    with pytest.raises(SignatureRefused):
        verify_standard_signature("evt_2", str(stamp), theirs, body + b" ", secret, stamp)
    with pytest.raises(SignatureRefused, match="tolerance"):
        verify_standard_signature("evt_2", str(stamp), theirs, body, secret, stamp + 301)
    with pytest.raises(SignatureRefused):
        verify_standard_signature("evt_2", str(stamp), theirs, body, new_secret(), stamp)
