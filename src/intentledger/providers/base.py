"""The Provider port: what the engine needs from a payment provider.

An adapter owns its provider's semantics: what each of its answers proves (its
mapping, applied to every submit's response), which operation kinds it can
carry, how long the provider keeps idempotency keys, and how consistent its
lookup by our reference is. Adapters are found through the entry-point group
`intentledger.providers` (providers/registry.py).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol, runtime_checkable

from intentledger.domain.canonical import canonical_json
from intentledger.domain.quick_init import quick_init
from intentledger.domain.transport import REFERENCE_WIDTH, LookupAnswer, ProviderAnswer

KINDS = ("payment", "beneficiary", "card_issue", "card_freeze", "card_unfreeze", "refund")


@quick_init
@dataclass(frozen=True)
class ProviderRequest:
    """One write to the provider: a charge, a beneficiary, a card or a card action."""

    kind: str  # payment | beneficiary | card_issue | card_freeze | card_unfreeze | refund
    reference: str  # our operation id: the provider's lookup key for reconciliation
    idempotency_key: str  # the provider-facing key of this attempt
    body: dict[str, object] = field(default_factory=dict)
    # The provider's object the write acts on (a card for freeze/unfreeze, the
    # charge a refund reverses).
    target: str | None = None
    # The payment runs under a mandate: the customer is not present (off-session).
    under_mandate: bool = False
    # The operation's currency: a refund's body does not carry it (it is its
    # payment's), and a provider that wants it with every amount reads it here.
    currency: str | None = None


@dataclass(frozen=True)
class ProviderLookup:
    """A read that shows whether the write under `reference` executed."""

    kind: str
    reference: str
    target: str | None = None
    # The provider's ids some answer already named: read directly (strongly
    # consistent where a search may lag).
    known: tuple[str, ...] = ()
    # A verification look (the audit): look for every execution, not just one.
    exhaustive: bool = False


@dataclass(frozen=True)
class LookupConsistency:
    """How far a lookup by our reference can be trusted to show a fresh write."""

    # None: strongly consistent. Otherwise "nothing found" within this long of
    # the last attempt is inconclusive.
    lag: timedelta | None
    note: str
    # False: the provider cannot be asked what became of a write (Adyen's
    # Checkout API has no read by our reference). Reconciliation then never
    # calls `lookup`: the safety review decides at once whether a same-key
    # resend is still deduplicated, and notifications are the other evidence.
    available: bool = True


class Provider(Protocol):
    name: str

    async def submit(self, request: ProviderRequest) -> ProviderAnswer:
        """Send one write. Never raises for transport trouble: the answer says
        what happened, with the adapter's reading of any response (`mapped`)."""
        ...

    async def lookup(self, query: ProviderLookup) -> LookupAnswer:
        """Report executions of the write under a reference, as `ChargeSeen` entries
        whose status is the adapter's word ("succeeded" when it took effect).
        Never raises for transport trouble."""
        ...

    async def aclose(self) -> None: ...


# The widest event id and type the ledger keeps (provider_events' columns); an
# event's object id and reference are kept to REFERENCE_WIDTH, as answers' are.
EVENT_ID_WIDTH = 255
EVENT_TYPE_WIDTH = 100


@dataclass(frozen=True)
class WebhookEvent:
    """A provider's webhook, verified and read by its adapter: its ids, type
    and reference kept to their columns' widths, whichever reader made it (a
    longer one, refused by PostgreSQL, would answer every redelivery with an
    error)."""

    event_id: str
    type: str
    signed_at: datetime
    object_id: str | None  # the provider's object it is about (a PaymentIntent id)
    reference: str | None  # our reference, as the object carries it
    # The object's status in the lookup's words (succeeded, failed, canceled,
    # processing, unmapped:<status>); None for an event type the adapter does not map.
    status: str | None
    payload: dict[str, Any]
    # What kind of object the event is about (payment | refund | card), decided
    # by the adapter from the event's type; None for a type it does not map.
    # An event speaks only for operations of its kind (domain/evidence.py,
    # `speaks_for`): a mapped event without it is stored as `wrong_kind`.
    object_kind: str | None = None
    # An event that settles nothing but a person must see (Adyen's CHARGEBACK:
    # the shopper's bank took the money back). Recorded on the operation it
    # names, and flagged.
    needs_person: bool = False
    # The amount the event says moved (minor units, currency), where it names
    # one: an event about another amount than the operation's settles nothing.
    amount: tuple[int, str] | None = None

    def __post_init__(self) -> None:
        for name, width in _EVENT_WIDTHS:
            value = getattr(self, name)
            if value is None:
                continue
            # Text, as the built-in readers make it: a plug-in's integer id
            # would otherwise fail here, or be cast by one database and not
            # the other.
            text = value if type(value) is str else str(value)
            if len(text) > width:
                text = _event_id_kept(text) if name == "event_id" else text[:width]
            if text is not value:
                object.__setattr__(self, name, text)


_EVENT_WIDTHS = (
    ("event_id", EVENT_ID_WIDTH),
    ("type", EVENT_TYPE_WIDTH),
    ("object_id", REFERENCE_WIDTH),
    ("reference", REFERENCE_WIDTH),
)


def _event_id_kept(event_id: str) -> str:
    """An event id wider than its column, kept unique: its start and a digest
    of all of it. The id is what a redelivery is known by, and two ids cut
    alike would make a second event read as the first one redelivered, its
    evidence dropped; a redelivery of either keeps its own."""
    digest = hashlib.sha256(event_id.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return f"{event_id[: EVENT_ID_WIDTH - len(digest) - 1]}~{digest}"


class UnreadableEvent(ValueError):
    """A verified body that is not an event the adapter can read."""


class WebhookReader(Protocol):
    def read(self, body: bytes, headers: Mapping[str, str], now: datetime) -> WebhookEvent:
        """Verify the signature (SignatureRefused) and read the event (UnreadableEvent)."""
        ...


@runtime_checkable
class BatchWebhookReader(Protocol):
    """A provider that posts several events in one signed body (Adyen), and
    waits for a particular answer once all of them are stored."""

    @property
    def acknowledgement(self) -> str:
        """The body that tells the provider to stop resending."""
        ...

    def read_batch(
        self, body: bytes, headers: Mapping[str, str], now: datetime
    ) -> list[WebhookEvent]:
        """Verify every item (SignatureRefused refuses them all) and read each."""
        ...


# What an adapter's `webhooks` gives: a reader of one event per body, or of a batch.
Webhooks = WebhookReader | BatchWebhookReader


def read_events(
    reader: Webhooks, body: bytes, headers: Mapping[str, str], now: datetime
) -> list[WebhookEvent]:
    """The events of one signed body, through whichever reader it is: a batch
    reader's all, or a one-event reader's one. Raises as the reader does
    (SignatureRefused, UnreadableEvent)."""
    if isinstance(reader, BatchWebhookReader):
        return reader.read_batch(body, headers, now)
    return [reader.read(body, headers, now)]


def read_event_json(body: bytes) -> Any:
    """A verified webhook body as JSON that every database can store: no lone
    surrogate, NaN or infinity anywhere (PostgreSQL refuses each, where SQLite
    keeps them), nested no deeper than Python reads. A NUL character, which
    PostgreSQL refuses too, never reaches a reader: the edge's strict parse
    refuses it in every body (api/edge.py).

    Refused rather than changed as a call's answer is (providers/http.py):
    Adyen signs the values read from an event, not its bytes, so a changed
    value would no longer be what its provider signed."""
    try:
        event = json.loads(body)
        canonical_json(event)
    except (ValueError, TypeError, RecursionError) as exc:
        raise UnreadableEvent(f"the body is not storable JSON: {exc}") from exc
    return event
