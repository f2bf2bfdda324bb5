"""The Provider port: what the engine needs from a payment provider."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from intentledger.domain.transport import LookupAnswer, ProviderAnswer


@dataclass(frozen=True)
class ProviderRequest:
    """One write to the provider: a charge, a beneficiary, a card or a card action."""

    kind: str  # payment | beneficiary | card_issue | card_freeze | card_unfreeze
    reference: str  # our operation id: the provider's lookup key for reconciliation
    idempotency_key: str  # the provider-facing key of this attempt
    body: dict[str, object] = field(default_factory=dict)
    # The provider's object the write acts on (a card id for freeze/unfreeze).
    target: str | None = None


@dataclass(frozen=True)
class ProviderLookup:
    """A read that shows whether the write under `reference` executed."""

    kind: str
    reference: str
    target: str | None = None


class Provider(Protocol):
    name: str

    async def submit(self, request: ProviderRequest) -> ProviderAnswer:
        """Send one write. Never raises for transport trouble: the answer says what happened."""
        ...

    async def lookup(self, query: ProviderLookup) -> LookupAnswer:
        """Report executions of the write under a reference, as `ChargeSeen` entries
        whose status is the provider's word ("succeeded" when it took effect).
        Never raises for transport trouble."""
        ...

    async def aclose(self) -> None: ...
