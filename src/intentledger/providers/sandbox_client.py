"""The adapter for the built-in sandbox provider (Stripe-v1-like charges API)."""

from __future__ import annotations

from datetime import timedelta

import httpx

from intentledger.domain.transport import ChargeSeen, LookupAnswer, ProviderAnswer, Transport
from intentledger.providers.base import ChargeRequest
from intentledger.providers.http import observe


class SandboxProvider:
    name = "sandbox"

    def __init__(self, base_url: str, timeout: timedelta, max_connections: int = 200) -> None:
        seconds = timeout.total_seconds()
        self._client = httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
            timeout=httpx.Timeout(seconds),
            limits=httpx.Limits(max_connections=max_connections),
        )

    async def submit(self, request: ChargeRequest) -> ProviderAnswer:
        body: dict[str, object] = {
            "reference": request.reference,
            "amount": request.amount,
            "currency": request.currency,
            "payment_method": request.payment_method,
            "metadata": request.metadata,
        }
        if request.description is not None:
            body["description"] = request.description
        return await observe(
            self._client.post(
                "/v1/charges", json=body, headers={"Idempotency-Key": request.idempotency_key}
            )
        )

    async def lookup(self, reference: str) -> LookupAnswer:
        answer = await observe(self._client.get("/v1/charges", params={"reference": reference}))
        if answer.transport is not Transport.RESPONSE or answer.status != 200:
            return LookupAnswer(answer)
        body = answer.detail.get("body")
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list):
            return LookupAnswer(answer, readable=False)
        charges = tuple(
            ChargeSeen(str(item.get("id")), str(item.get("status")))
            for item in data
            if isinstance(item, dict)
        )
        return LookupAnswer(answer, charges)

    async def aclose(self) -> None:
        await self._client.aclose()
