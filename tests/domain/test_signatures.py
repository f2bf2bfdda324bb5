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
