"""Adyen's notification batches read as evidence (providers/adyen_notifications.py):
what each event code proves, a batch refused whole when one item is forged,
duplicates found by their id and a flipped `success` kept as its own event,
another merchant account's items proving nothing, and items Adyen's own
library signs accepted."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
from Adyen import util as adyen_util  # type: ignore[import-untyped]
from hypothesis import given
from hypothesis import strategies as st

from intentledger.domain.adyen_signatures import signed_adyen_item
from intentledger.domain.signatures import SignatureRefused
from intentledger.domain.transport import speaks_an_outcome
from intentledger.providers.adyen_notifications import (
    EVENT_MEANINGS,
    AdyenNotifications,
    hmac_keys,
)
from intentledger.providers.base import BatchWebhookReader, UnreadableEvent, read_events

KEY = "44782DEF547AAA06C910C43932B1EB0C71FC68D9D0C057550C48EC2ACF6BA056"
OLD_KEY = "0123456789ABCDEF0123456789ABCDEF"
ACCOUNT = "IntentLedgerTestECOM"
NOW = datetime(2026, 12, 4, 9, 0, tzinfo=UTC)


def item(code: str = "AUTHORISATION", success: str = "true", **fields: Any) -> dict[str, Any]:
    return {
        "pspReference": "PSP0000000000001",
        "merchantAccountCode": ACCOUNT,
        "merchantReference": "op_0000000000000000000000000001",
        "amount": {"value": 1000, "currency": "EUR"},
        "eventCode": code,
        "success": success,
        "eventDate": "2026-12-04T09:59:00+01:00",
        "reason": "",
        **fields,
    }


def batch(*items: dict[str, Any], key: str = KEY) -> bytes:
    signed = [signed_adyen_item(i, key) for i in items]
    return json.dumps(
        {"live": "false", "notificationItems": [{"NotificationRequestItem": i} for i in signed]}
    ).encode()


READER = AdyenNotifications((KEY,), ACCOUNT)


def test_it_is_a_batch_reader_answering_accepted() -> None:
    assert isinstance(READER, BatchWebhookReader)
    assert READER.acknowledgement == "[accepted]"


def test_the_webhook_route_reads_every_item_of_a_batch() -> None:
    body = batch(item(), item(success="false"))
    assert read_events(READER, body, {}, NOW) == READER.read_batch(body, {}, NOW)
    with pytest.raises(SignatureRefused):
        read_events(READER, batch(item(), key=OLD_KEY), {}, NOW)


@pytest.mark.parametrize(
    ("code", "success", "kind", "status", "needs_person"),
    [
        ("AUTHORISATION", "true", "payment", "succeeded", False),
        ("AUTHORISATION", "false", "payment", "failed", False),
        ("CANCELLATION", "true", "payment", "canceled", False),
        ("CANCELLATION", "false", None, None, False),
        ("REFUND", "true", "refund", "succeeded", False),
        ("REFUND", "false", "refund", "failed", False),
        ("REFUND_FAILED", "true", "refund", "failed", False),
        ("CHARGEBACK", "true", "payment", None, True),
        ("CAPTURE", "true", None, None, False),
        ("REPORT_AVAILABLE", "true", None, None, False),
    ],
)
def test_what_each_event_code_proves(
    code: str, success: str, kind: str | None, status: str | None, needs_person: bool
) -> None:
    original = "PSP0000000000000"  # the payment a modification is about
    (event,) = READER.read_batch(batch(item(code, success, originalReference=original)), {}, NOW)
    assert (event.object_kind, event.status, event.needs_person) == (kind, status, needs_person)
    assert event.type == code
    about_the_payment = code == "CANCELLATION" and success == "true"
    assert event.object_id == (original if about_the_payment else "PSP0000000000001")
    assert event.reference == "op_0000000000000000000000000001"
    assert event.signed_at == datetime.fromisoformat("2026-12-04T09:59:00+01:00")


@given(code=st.text(max_size=30), success=st.sampled_from(["true", "false"]))
def test_a_code_the_table_does_not_name_proves_nothing(code: str, success: str) -> None:
    if (code, success == "true") in EVENT_MEANINGS or (code, None) in EVENT_MEANINGS:
        return
    (event,) = READER.read_batch(batch(item(code or "X", success)), {}, NOW)
    if (event.type, None) in EVENT_MEANINGS or (event.type, success == "true") in EVENT_MEANINGS:
        return
    assert event.status is None and not speaks_an_outcome(event.status)
    assert event.object_kind is None and not event.needs_person


def test_one_forged_item_refuses_the_whole_batch() -> None:
    good = signed_adyen_item(item(pspReference="PSP0000000000001"), KEY)
    forged = signed_adyen_item(item(pspReference="PSP0000000000002"), KEY)
    forged["amount"] = {"value": 999999, "currency": "EUR"}  # changed after signing
    body = json.dumps(
        {"notificationItems": [{"NotificationRequestItem": i} for i in (good, forged)]}
    ).encode()
    with pytest.raises(SignatureRefused, match="notification item 2"):
        READER.read_batch(body, {}, NOW)
    unsigned = json.dumps({"notificationItems": [{"NotificationRequestItem": item()}]}).encode()
    with pytest.raises(SignatureRefused, match="no hmacSignature"):
        READER.read_batch(unsigned, {}, NOW)
    with pytest.raises(SignatureRefused, match="matches no configured"):
        READER.read_batch(batch(item(), key=OLD_KEY), {}, NOW)


def test_every_configured_key_verifies_while_rotating() -> None:
    rotating = AdyenNotifications(hmac_keys(f" {KEY} , {OLD_KEY} ,"), ACCOUNT)
    assert rotating.hmac_keys == (KEY, OLD_KEY)
    for key in (KEY, OLD_KEY):
        (event,) = rotating.read_batch(batch(item(), key=key), {}, NOW)
        assert event.status == "succeeded"


def test_a_duplicate_has_the_same_id_and_a_flipped_success_another() -> None:
    first, again, flipped = READER.read_batch(batch(item(), item(), item(success="false")), {}, NOW)
    assert first.event_id == again.event_id == "PSP0000000000001:AUTHORISATION:true:1000:EUR"
    assert flipped.event_id == "PSP0000000000001:AUTHORISATION:false:1000:EUR"
    (other_amount,) = READER.read_batch(
        batch(item(amount={"value": 1, "currency": "EUR"})), {}, NOW
    )
    assert other_amount.event_id == "PSP0000000000001:AUTHORISATION:true:1:EUR"
    assert other_amount.amount == (1, "EUR") and first.amount == (1000, "EUR")
    assert (first.status, flipped.status) == ("succeeded", "failed")


def test_a_cancellation_that_names_no_payment_proves_nothing() -> None:
    (event,) = READER.read_batch(batch(item("CANCELLATION")), {}, NOW)
    assert event.status is None and event.object_kind is None


def test_another_merchant_accounts_item_proves_nothing() -> None:
    (event,) = READER.read_batch(batch(item(merchantAccountCode="SomeoneElseECOM")), {}, NOW)
    assert event.status is None and event.object_kind is None
    (chargeback,) = READER.read_batch(
        batch(item("CHARGEBACK", merchantAccountCode="SomeoneElseECOM")), {}, NOW
    )
    assert not chargeback.needs_person


@pytest.mark.parametrize(
    "body",
    [
        b"[accepted]",
        b"{}",
        b'{"notificationItems": []}',
        b'{"notificationItems": [{"Other": {}}]}',
        b'{"notificationItems": "x"}',
    ],
)
def test_a_body_that_is_not_a_batch_is_unreadable(body: bytes) -> None:
    with pytest.raises(UnreadableEvent):
        READER.read_batch(body, {}, NOW)


def test_a_verified_item_without_its_identity_is_unreadable() -> None:
    with pytest.raises(UnreadableEvent, match="success"):
        READER.read_batch(batch(item(success="maybe")), {}, NOW)
    with pytest.raises(UnreadableEvent, match="pspReference"):
        READER.read_batch(batch(item(pspReference="")), {}, NOW)


def test_an_unreadable_event_date_is_the_time_of_receipt() -> None:
    (event,) = READER.read_batch(batch(item(eventDate="yesterday")), {}, NOW)
    assert event.signed_at == NOW


def test_what_adyens_own_library_signs_is_read() -> None:
    notification = item("REFUND", originalReference="PSP0000000000000")
    signature = adyen_util.generate_notification_sig(notification, KEY).decode()
    notification["additionalData"] = {"hmacSignature": signature}
    body = json.dumps({"notificationItems": [{"NotificationRequestItem": notification}]})
    (event,) = READER.read_batch(body.encode(), {}, NOW)
    assert (event.object_kind, event.status) == ("refund", "succeeded")
    assert adyen_util.is_valid_hmac_notification(
        json.loads(batch(notification))["notificationItems"][0]["NotificationRequestItem"], KEY
    )
