"""Adyen's notification signature (domain/adyen_signatures.py) against Adyen's
own Python library, `Adyen.util`: what it signs we accept, what we sign it
verifies, and a changed field or a wrong key is refused by both."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from Adyen import util as adyen_util  # type: ignore[import-untyped]
from hypothesis import assume, given
from hypothesis import strategies as st

from intentledger.domain.adyen_signatures import (
    SIGNED_FIELDS,
    adyen_signature,
    adyen_signing_string,
    signed_adyen_item,
    verify_adyen_signature,
)
from intentledger.domain.signatures import SignatureRefused

# Any text Adyen could carry, separators and escapes included (surrogates cannot
# be encoded as UTF-8 by either side).
texts = st.text(st.characters(exclude_categories=("Cs",)), max_size=30)
hex_keys = (
    st.binary(min_size=1, max_size=64)
    .map(bytes.hex)
    .flatmap(lambda key: st.sampled_from([key, key.upper()]))
)


@st.composite
def items(draw: st.DrawFn) -> dict[str, Any]:
    item: dict[str, Any] = {
        "pspReference": draw(texts),
        "merchantAccountCode": draw(texts),
        "merchantReference": draw(texts),
        "amount": {"value": draw(st.integers(-(10**12), 10**12)), "currency": draw(texts)},
        "eventCode": draw(st.sampled_from(["AUTHORISATION", "REFUND", "CANCELLATION"]) | texts),
        "success": draw(st.sampled_from(["true", "false"]) | texts),
        "eventDate": "2024-01-01T00:00:00+01:00",
    }
    # A modification's notification names the payment; a payment's has no such field.
    if draw(st.booleans()):
        item["originalReference"] = draw(texts)
    if draw(st.booleans()):
        item["additionalData"] = {"paymentMethodVariant": draw(texts)}
    return item


def _with_signature(item: dict[str, Any], signature: str) -> dict[str, Any]:
    return {
        **item,
        "additionalData": {**item.get("additionalData", {}), "hmacSignature": signature},
    }


def _changed(item: dict[str, Any], field: str, value: str | int) -> dict[str, Any]:
    changed = copy.deepcopy(item)
    if field.startswith("amount."):
        changed["amount"][field.removeprefix("amount.")] = value
    else:
        changed[field] = value
    return changed


def _adyen_accepts(item: dict[str, Any], key: str) -> bool:
    return bool(adyen_util.is_valid_hmac_notification(item, key))


def _we_accept(item: dict[str, Any], keys: list[str]) -> bool:
    try:
        verify_adyen_signature(item, keys)
    except SignatureRefused:
        return False
    return True


@given(items(), hex_keys, hex_keys)
def test_what_adyen_signs_we_accept_under_any_of_the_keys(
    item: dict[str, Any], key: str, other: str
) -> None:
    theirs = adyen_util.generate_notification_sig(item, key).decode()
    assert adyen_signature(item, key) == theirs
    signed = _with_signature(item, theirs)
    assert _we_accept(signed, [key])
    # A rotation: the old key and the new one are both configured, in either order.
    assert _we_accept(signed, [other, key])
    assert _we_accept(signed, [key, other])


@given(items(), hex_keys)
def test_what_we_sign_adyen_verifies_alone_and_in_a_batch(item: dict[str, Any], key: str) -> None:
    signed = signed_adyen_item(item, key)
    assert _adyen_accepts(signed, key)
    batch = {"live": "false", "notificationItems": [{"NotificationRequestItem": signed}]}
    assert _adyen_accepts(batch, key)
    # Signing keeps the rest of additionalData, and changes nothing else.
    assert {k: v for k, v in signed.items() if k != "additionalData"} == {
        k: v for k, v in item.items() if k != "additionalData"
    }
    for name, value in (item.get("additionalData") or {}).items():
        assert signed["additionalData"][name] == value


@given(items(), hex_keys, st.sampled_from(SIGNED_FIELDS), texts, st.integers())
def test_a_changed_field_is_refused_by_both(
    item: dict[str, Any], key: str, field: str, text: str, number: int
) -> None:
    signed = signed_adyen_item(item, key)
    value: str | int = number if field == "amount.value" else text
    changed = _changed(signed, field, value)
    assume(adyen_signing_string(changed) != adyen_signing_string(signed))
    assert not _we_accept(changed, [key])
    assert not _adyen_accepts(changed, key)


@given(items(), hex_keys, hex_keys)
def test_a_wrong_key_is_refused_by_both(item: dict[str, Any], key: str, wrong: str) -> None:
    assume(bytes.fromhex(key) != bytes.fromhex(wrong))
    signed = signed_adyen_item(item, key)
    assert not _we_accept(signed, [wrong])
    assert not _adyen_accepts(signed, wrong)


def test_a_missing_field_signs_as_empty_as_adyen_does() -> None:
    item = {
        "pspReference": "7914073381342284",
        "merchantAccountCode": "TestMerchant",
        "merchantReference": "op_1",
        "amount": {"value": 1130, "currency": "EUR"},
        "eventCode": "AUTHORISATION",
        "success": "true",
    }
    assert (
        adyen_signing_string(item)
        == "7914073381342284::TestMerchant:op_1:1130:EUR:AUTHORISATION:true"
    )


@pytest.mark.parametrize(
    ("keys", "reason"),
    [([], "no Adyen HMAC key"), (["abc"], "even-length hex"), (["ab cd"], "even-length hex")],
)
def test_unusable_keys_are_refused(keys: list[str], reason: str) -> None:
    item = signed_adyen_item(
        {"pspReference": "p", "amount": {"value": 1, "currency": "EUR"}}, "00ff"
    )
    with pytest.raises(SignatureRefused, match=reason):
        verify_adyen_signature(item, keys)


def test_an_item_without_a_signature_or_with_an_undocumented_shape_is_refused() -> None:
    item: dict[str, Any] = {"pspReference": "p", "amount": {"value": 1, "currency": "EUR"}}
    with pytest.raises(SignatureRefused, match="no hmacSignature"):
        verify_adyen_signature(item, ["00ff"])
    with pytest.raises(SignatureRefused, match="no hmacSignature"):
        verify_adyen_signature({**item, "additionalData": {"hmacSignature": ""}}, ["00ff"])
    # A JSON boolean would sign "True" in Adyen's library and "true" at Adyen.
    with pytest.raises(SignatureRefused, match="success"):
        signed_adyen_item({**item, "success": True}, "00ff")
    with pytest.raises(SignatureRefused, match="amount"):
        signed_adyen_item({"pspReference": "p"}, "00ff")
