"""The adapter for the built-in sandbox provider (a Stripe-v1-like API)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import httpx

from intentledger.domain.transport import ChargeSeen, LookupAnswer, ProviderAnswer, Transport
from intentledger.providers.base import ProviderLookup, ProviderRequest
from intentledger.providers.http import ShardedClient, call_deadline, observe

# What a card must show for each card action to have taken effect.
CARD_STATUS_AFTER = {"card_freeze": "frozen", "card_unfreeze": "active"}


class UnknownKind(ValueError):
    pass


class SandboxProvider:
    name = "sandbox"

    def __init__(self, base_url: str, timeout: timedelta, max_connections: int = 200) -> None:
        # The whole call, not just each phase of it, ends within `timeout`.
        self._deadline = call_deadline(timeout).total_seconds()
        self._clients = ShardedClient(
            max_connections, base_url, httpx.Timeout(timeout.total_seconds())
        )

    async def submit(self, request: ProviderRequest) -> ProviderAnswer:
        path = self._write_path(request)
        body = {"reference": request.reference, **request.body}
        headers = {"Idempotency-Key": request.idempotency_key}
        call = self._clients.request("POST", path, json=body, headers=headers)
        return await observe(call, self._deadline)

    @staticmethod
    def _write_path(request: ProviderRequest) -> str:
        if request.kind == "payment":
            return "/v1/charges"
        if request.kind == "beneficiary":
            return "/v1/beneficiaries"
        if request.kind == "card_issue":
            return "/v1/cards"
        if request.kind in CARD_STATUS_AFTER and request.target:
            action = request.kind.removeprefix("card_")
            return f"/v1/cards/{request.target}/{action}"
        raise UnknownKind(f"the sandbox has no write for {request.kind!r}")

    async def lookup(self, query: ProviderLookup) -> LookupAnswer:
        if query.kind in CARD_STATUS_AFTER:
            return await self._card_action_lookup(query)
        path = {
            "payment": "/v1/charges",
            "beneficiary": "/v1/beneficiaries",
            "card_issue": "/v1/cards",
        }.get(query.kind)
        if path is None:
            raise UnknownKind(f"the sandbox has no lookup for {query.kind!r}")
        call = self._clients.request("GET", path, params={"reference": query.reference})
        answer = await observe(call, self._deadline)
        items = _listed(answer)
        if items is None:
            # A 200 without a readable list is no evidence of absence.
            unreadable_200 = answer.transport is Transport.RESPONSE and answer.status == 200
            return LookupAnswer(answer, readable=not unreadable_200)
        return LookupAnswer(answer, tuple(_seen(item, query.kind) for item in items))

    async def _card_action_lookup(self, query: ProviderLookup) -> LookupAnswer:
        """A card action is evidenced by the card's state: frozen after a freeze."""
        call = self._clients.request("GET", f"/v1/cards/{query.target}")
        answer = await observe(call, self._deadline)
        body = answer.detail.get("body")
        if answer.transport is not Transport.RESPONSE or answer.status != 200:
            return LookupAnswer(answer)
        if not isinstance(body, dict) or "status" not in body:
            return LookupAnswer(answer, readable=False)
        took_effect = body["status"] == CARD_STATUS_AFTER[query.kind]
        seen = (ChargeSeen(str(body.get("id")), "succeeded"),) if took_effect else ()
        return LookupAnswer(answer, seen)

    async def aclose(self) -> None:
        await self._clients.aclose()


def _listed(answer: ProviderAnswer) -> list[Any] | None:
    """The `data` list of a 200 lookup, or None when there is none to read."""
    if answer.transport is not Transport.RESPONSE or answer.status != 200:
        return None
    body = answer.detail.get("body")
    data = body.get("data") if isinstance(body, dict) else None
    return data if isinstance(data, list) else None


def _seen(item: Any, kind: str) -> ChargeSeen:
    if not isinstance(item, dict):
        return ChargeSeen("?", "unreadable")
    if kind == "payment":
        return ChargeSeen(str(item.get("id")), str(item.get("status")))
    # A beneficiary or card that exists under our reference is the write's success.
    return ChargeSeen(str(item.get("id")), "succeeded")
