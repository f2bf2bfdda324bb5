"""Adyen's HMAC signature of a standard notification item, pure.

Adyen signs each `NotificationRequestItem` of a batch on its own, not the body
(https://docs.adyen.com/development-resources/webhooks/verify-hmac-signatures):
the signing string is the item's

    pspReference:originalReference:merchantAccountCode:merchantReference:
    amount.value:amount.currency:eventCode:success

joined by ':' (a field the item lacks is the empty string), HMAC-SHA256 under
the key given as hex in the Customer Area, base64 in
`additionalData.hmacSignature`. Values are not escaped: the `\\` and `:`
escaping of Adyen's documentation belongs to the retired Hosted Payment Pages
signature over sorted key-value pairs, and Adyen's own libraries (Python's
`Adyen.util`, proven in tests/test_adyen_signatures.py) join the raw values.
There is no timestamp: a replayed item verifies for ever, so deduplication is
the receiver's job, not the signature's. During a key rotation Adyen may still
sign with the previous key, so several keys are tried.

Kept apart from signatures.py: Stripe's and Standard Webhooks' schemes sign the
raw body with a timestamp, this one signs parsed fields and has none. A refusal
is the same SignatureRefused, so a webhook route catches one exception.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
from collections.abc import Mapping, Sequence
from typing import Any

from intentledger.domain.signatures import SignatureRefused

# The item's fields in signing order; `amount` contributes value then currency.
SIGNED_FIELDS = (
    "pspReference",
    "originalReference",
    "merchantAccountCode",
    "merchantReference",
    "amount.value",
    "amount.currency",
    "eventCode",
    "success",
)
HEX_KEY = re.compile(r"(?:[0-9a-fA-F]{2})+")


def adyen_hmac_key(hex_key: str) -> bytes:
    """The HMAC key Adyen shows as hex; SignatureRefused for anything else
    (bytes.fromhex alone would take spaces)."""
    if not HEX_KEY.fullmatch(hex_key):
        raise SignatureRefused("the Adyen HMAC key is not an even-length hex string")
    return bytes.fromhex(hex_key)


def _field_text(item: Mapping[str, Any], name: str) -> str:
    if name.startswith("amount."):
        amount = item.get("amount")
        if not isinstance(amount, Mapping):
            raise SignatureRefused("the notification item has no amount object")
        value = amount.get(name.removeprefix("amount."))
    else:
        value = item.get(name)
    if value is None:
        return ""
    # JSON gives strings, and an integer amount; a boolean (`success` is the
    # string "true" or "false") or a float is not the documented shape, and
    # str() would sign "True" where Adyen signs "true".
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise SignatureRefused(f"the notification item's {name} is not a string or an integer")
    return str(value)


def adyen_signing_string(item: Mapping[str, Any]) -> str:
    """The string Adyen signs for one `NotificationRequestItem`."""
    return ":".join(_field_text(item, name) for name in SIGNED_FIELDS)


def adyen_signature(item: Mapping[str, Any], hex_key: str) -> str:
    """The base64 `hmacSignature` of `item` under `hex_key`."""
    signed = adyen_signing_string(item).encode()
    digest = hmac.new(adyen_hmac_key(hex_key), signed, hashlib.sha256).digest()
    return base64.b64encode(digest).decode()


def signed_adyen_item(item: Mapping[str, Any], hex_key: str) -> dict[str, Any]:
    """A copy of `item` with its `additionalData.hmacSignature` set, as Adyen sends it."""
    additional = dict(item.get("additionalData") or {})
    additional["hmacSignature"] = adyen_signature(item, hex_key)
    return {**item, "additionalData": additional}


def verify_adyen_signature(item: Mapping[str, Any], hex_keys: Sequence[str]) -> None:
    """Nothing if `item`'s `additionalData.hmacSignature` matches under one of
    `hex_keys`; otherwise SignatureRefused."""
    if not hex_keys:
        raise SignatureRefused("no Adyen HMAC key is configured")
    keys = [adyen_hmac_key(hex_key) for hex_key in hex_keys]
    additional = item.get("additionalData")
    signature = additional.get("hmacSignature") if isinstance(additional, Mapping) else None
    if not isinstance(signature, str) or not signature:
        raise SignatureRefused("the notification item carries no hmacSignature")
    signed = adyen_signing_string(item).encode()
    # Every key is compared, each in constant time: no early exit tells which came close.
    matched = False
    for key in keys:
        wanted = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest())
        matched |= hmac.compare_digest(signature.encode(), wanted)
    if not matched:
        raise SignatureRefused("the hmacSignature matches no configured Adyen HMAC key")
