"""Adyen's standard notifications, read as evidence (`/v1/provider-webhooks/adyen`).

Adyen posts a JSON batch, `{"live": ..., "notificationItems":
[{"NotificationRequestItem": {...}}]}`, and signs each item on its own
(domain/adyen_signatures.py), not the body, and with no timestamp
(https://docs.adyen.com/development-resources/webhooks,
https://docs.adyen.com/development-resources/webhooks/verify-hmac-signatures).
It resends a batch until it is answered HTTP 200 with the body `[accepted]`
(https://docs.adyen.com/development-resources/webhooks/#accept-webhooks), so a
batch is acknowledged only once every item in it is stored.

One item that fails verification refuses the whole batch and stores nothing:
a sender caught forging one item is trusted for none, and Adyen's own items
come again with its retries once the keys are right (a refusal is counted and
logged by the route, so a wrong key does not go unseen).

An item's event id is its `pspReference`, `eventCode`, `success` and amount
together: Adyen's duplicates repeat all of them, while an item whose `success`
(or amount) differs from an earlier one for the same object is another
statement, stored and judged on its own (the funnel settles on the first, and
flags the second if it contradicts it).

What each event code proves (docs/providers.md, "Adyen notifications"):

    AUTHORISATION  success true   the payment `merchantReference` succeeded
                   success false  it failed (refused, or an error Adyen reports)
    CANCELLATION   success true   the payment `originalReference` was cancelled: it
                                  cannot succeed
                   success false  the cancellation failed: says nothing of the payment
    REFUND         success true   the refund `merchantReference` succeeded
                   success false  it failed
    REFUND_FAILED                 the refund failed after it was sent to the scheme
    CHARGEBACK                    the shopper's bank took the money back: recorded
                                  on its payment and flagged for a person
    anything else                 stored and acknowledged; proves nothing

An item for another merchant account than the one configured is stored and
proves nothing: a company account's HMAC key may be shared by several. An
item that names an amount other than its operation's (a partial
authorisation, a refund of another sum) settles nothing and is flagged for a
person (engine/provider_events.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from intentledger.domain.adyen_signatures import verify_adyen_signature
from intentledger.domain.signatures import SignatureRefused
from intentledger.providers.base import UnreadableEvent, WebhookEvent, read_event_json

# The body Adyen waits for before it stops resending a batch.
ACCEPTED = "[accepted]"


@dataclass(frozen=True)
class EventMeaning:
    """What an event code with a `success` value proves, in the lookup's words."""

    object_kind: str | None  # payment | refund; None: about nothing we judge
    status: str | None  # succeeded | failed | canceled; None: proves nothing
    needs_person: bool = False
    # A modification (a cancel) has a pspReference of its own; the object it
    # speaks for is the payment, named in `originalReference`.
    about_original: bool = False


# (eventCode, success) -> meaning; `None` as success: either value.
EVENT_MEANINGS: dict[tuple[str, bool | None], EventMeaning] = {
    ("AUTHORISATION", True): EventMeaning("payment", "succeeded"),
    ("AUTHORISATION", False): EventMeaning("payment", "failed"),
    ("CANCELLATION", True): EventMeaning("payment", "canceled", about_original=True),
    ("CANCELLATION", False): EventMeaning(None, None),
    ("REFUND", True): EventMeaning("refund", "succeeded"),
    ("REFUND", False): EventMeaning("refund", "failed"),
    ("REFUND_FAILED", None): EventMeaning("refund", "failed"),
    ("CHARGEBACK", None): EventMeaning("payment", None, needs_person=True),
}
UNMAPPED = EventMeaning(None, None)


def meaning_of(event_code: str, success: bool) -> EventMeaning:
    return EVENT_MEANINGS.get(
        (event_code, success), EVENT_MEANINGS.get((event_code, None), UNMAPPED)
    )


@dataclass(frozen=True)
class AdyenNotifications:
    """Verifies and reads a batch of Adyen's standard notifications."""

    # Secrets: never in a repr (a traceback's locals, a debug line).
    hmac_keys: tuple[str, ...] = field(repr=False)
    merchant_account: str | None = None
    acknowledgement: str = ACCEPTED

    def read_batch(
        self, body: bytes, headers: Mapping[str, str], now: datetime
    ) -> list[WebhookEvent]:
        batch = read_event_json(body)
        items = batch.get("notificationItems") if isinstance(batch, dict) else None
        if not isinstance(items, list) or not items:
            raise UnreadableEvent("the body is not a batch of Adyen notification items")
        wrapped = [
            entry.get("NotificationRequestItem") if isinstance(entry, dict) else None
            for entry in items
        ]
        if not all(isinstance(item, dict) for item in wrapped):
            raise UnreadableEvent("a notification item is not a NotificationRequestItem object")
        # Every item verified before any is read: a forged one refuses them all.
        for number, item in enumerate(wrapped, start=1):
            assert isinstance(item, dict)
            try:
                verify_adyen_signature(item, self.hmac_keys)
            except SignatureRefused as exc:
                raise SignatureRefused(f"notification item {number}: {exc}") from exc
        return [self._event(item, now) for item in wrapped if isinstance(item, dict)]

    def _event(self, item: dict[str, Any], now: datetime) -> WebhookEvent:
        psp = item.get("pspReference")
        code = item.get("eventCode")
        success = item.get("success")
        if not isinstance(psp, str) or not psp or not isinstance(code, str) or not code:
            raise UnreadableEvent("a notification item has no pspReference or eventCode")
        if success not in ("true", "false"):
            raise UnreadableEvent(f"notification item {psp}: success is {success!r}")
        meaning = meaning_of(code, success == "true")
        ours = self.merchant_account is None or item.get("merchantAccountCode") == (
            self.merchant_account
        )
        if not ours:
            meaning = UNMAPPED
        reference = item.get("merchantReference")
        about = psp
        if meaning.about_original:
            original = item.get("originalReference")
            if isinstance(original, str) and original:
                about = original
            else:
                meaning = UNMAPPED  # a cancel that names no payment speaks for none
        amount = _amount(item.get("amount"))
        # Adyen's duplicates repeat all of it; another success or amount is
        # another statement, judged (or flagged) on its own.
        said = f":{amount[0]}:{amount[1]}" if amount is not None else ""
        return WebhookEvent(
            event_id=f"{psp}:{code}:{success}{said}",
            type=code,
            signed_at=_event_date(item.get("eventDate"), now),
            object_id=about,
            reference=reference if isinstance(reference, str) else None,
            status=meaning.status,
            payload=item,
            object_kind=meaning.object_kind,
            needs_person=meaning.needs_person and ours,
            amount=amount,
        )


def _amount(value: Any) -> tuple[int, str] | None:
    """The signed amount (minor units, currency), if the item has a readable one."""
    if not isinstance(value, dict):
        return None
    minor, currency = value.get("value"), value.get("currency")
    if isinstance(minor, int) and not isinstance(minor, bool) and isinstance(currency, str):
        return minor, currency
    return None


def _event_date(value: Any, now: datetime) -> datetime:
    """When Adyen says the event happened; the receipt's time when it gives
    none we can read (the date is not signed, so it decides nothing)."""
    if isinstance(value, str):
        try:
            parsed = datetime.fromisoformat(value)
        except ValueError:
            return now
        if parsed.tzinfo is not None:
            return parsed
    return now


def hmac_keys(configured: str | None) -> tuple[str, ...]:
    """The configured HMAC keys: several, comma-separated, while rotating."""
    if configured is None:
        return ()
    return tuple(key.strip() for key in configured.split(",") if key.strip())
