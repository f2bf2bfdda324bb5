"""The Provider port: what the engine needs from a payment provider."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from intentledger.domain.transport import LookupAnswer, ProviderAnswer


@dataclass(frozen=True)
class ChargeRequest:
    reference: str  # our operation id: the provider's lookup key for reconciliation
    idempotency_key: str  # the provider-facing key of this attempt
    amount: int
    currency: str
    payment_method: str
    description: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)


class Provider(Protocol):
    name: str

    async def submit(self, request: ChargeRequest) -> ProviderAnswer:
        """Send one charge. Never raises for transport trouble: the answer says what happened."""
        ...

    async def lookup(self, reference: str) -> LookupAnswer:
        """Find what the provider holds under our reference. Never raises for transport trouble."""
        ...

    async def aclose(self) -> None: ...
