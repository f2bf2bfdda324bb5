"""Refusals: requests the rules do not allow, and the one idempotency check.

A refusal is raised inside the transaction that would have written the
request, so nothing is written for it and its Idempotency-Key stays unused.
The API turns every refusal into a problem+json answer with its status.
"""

from __future__ import annotations

from intentledger.store.ledger import Ledger


class Refusal(Exception):
    def __init__(self, status: int, slug: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.slug = slug
        self.detail = detail


class IdempotencyKeyReused(Refusal):
    """The key was used for a different request by this actor on this route."""

    def __init__(self, resource_id: str) -> None:
        super().__init__(
            409,
            "idempotency-key-reused",
            "this Idempotency-Key was already used with a different request",
        )
        self.resource_id = resource_id


async def find_replay(
    ledger: Ledger, actor: str, route: str, key: str, request_hash: str
) -> str | None:
    """The resource an equal earlier request made, None for a first request;
    IdempotencyKeyReused when the key came with a different request."""
    existing = await ledger.find_idempotency_record(actor, route, key)
    if existing is None:
        return None
    if existing.request_hash != request_hash:
        raise IdempotencyKeyReused(existing.resource_id)
    return str(existing.resource_id)
