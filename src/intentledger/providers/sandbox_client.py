"""The adapter for the built-in sandbox provider (a Stripe-v1-like API)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from intentledger.domain.retention import sandbox_policy
from intentledger.domain.transport import (
    ChargeSeen,
    Classification,
    LookupAnswer,
    ProviderAnswer,
    Transport,
    Verdict,
)
from intentledger.providers.base import KINDS, LookupConsistency, ProviderLookup, ProviderRequest
from intentledger.providers.http import ProviderClient, call_deadline, error_fields, observe
from intentledger.providers.registry import (
    BuildArguments,
    ProviderNotConfigured,
    ProviderPlugin,
)
from intentledger.providers.sandbox.webhooks import SandboxWebhookReader, status_word

# What a card must show for each card action to have taken effect.
CARD_STATUS_AFTER = {"card_freeze": "frozen", "card_unfreeze": "active"}


class UnknownKind(ValueError):
    pass


# The sandbox's error types that mean "something already happened under this
# key": a 4xx carrying one is not a final decline of this request.
KEY_CONFLICT_TYPES = frozenset(
    {"idempotency_error", "idempotency_key_reused", "idempotency_key_in_use"}
)
# Statuses the sandbox answers only for a final refusal of this very request.
FINAL_REFUSAL_STATUSES = frozenset({400, 402, 422})


def map_answer(answer: ProviderAnswer) -> Classification:
    """What a sandbox response proves (its API is documented in
    providers/sandbox/app.py and docs/providers.md)."""
    status = answer.status
    assert status is not None, "only a response is mapped"
    if 200 <= status < 300:
        return Classification(Verdict.SUCCEEDED, f"provider answered {status}")
    if status == 429:
        return Classification(Verdict.NOT_EXECUTED, "provider refused with 429 before processing")
    if status == 409:
        # The earlier request under this key reached the provider and is still
        # being processed: neither failed nor resendable.
        return Classification(Verdict.KEY_CONFLICT, "provider reports the key in use (409)")
    if status in FINAL_REFUSAL_STATUSES:
        error = error_fields(answer.detail.get("body"))
        conflict = next(
            (v for v in (error.get("code"), error.get("type")) if v in KEY_CONFLICT_TYPES), None
        )
        if conflict is not None:
            return Classification(
                Verdict.KEY_CONFLICT, f"{status} {conflict}: the key was used before"
            )
        return Classification(
            Verdict.FAILED, f"provider refused with {status} ({answer.error_code})"
        )
    if status >= 500:
        return Classification(Verdict.UNKNOWN, f"provider error {status}: outcome indeterminate")
    # The sandbox documents no other status for a write: not an outcome.
    return Classification(Verdict.UNKNOWN, f"undocumented status {status}")


class SandboxProvider:
    name = "sandbox"

    def __init__(self, base_url: str, timeout: timedelta, max_connections: int = 200) -> None:
        # The whole call, not just each phase of it, ends within `timeout`.
        self._deadline = call_deadline(timeout).total_seconds()
        self._client = ProviderClient(max_connections, base_url, timeout)

    async def submit(self, request: ProviderRequest) -> ProviderAnswer:
        path = self._write_path(request)
        body = {"reference": request.reference, **request.body}
        if request.kind == "refund":
            body["charge"] = request.target
        headers = {"Idempotency-Key": request.idempotency_key}
        call = self._client.request("POST", path, json=body, headers=headers)
        return await observe(call, self._deadline, mapping=map_answer)

    @staticmethod
    def _write_path(request: ProviderRequest) -> str:
        if request.kind == "payment":
            return "/v1/charges"
        if request.kind == "beneficiary":
            return "/v1/beneficiaries"
        if request.kind == "card_issue":
            return "/v1/cards"
        if request.kind == "refund" and request.target:
            return "/v1/refunds"
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
            "refund": "/v1/refunds",
        }.get(query.kind)
        if path is None:
            raise UnknownKind(f"the sandbox has no lookup for {query.kind!r}")
        call = self._client.request("GET", path, params={"reference": query.reference})
        answer = await observe(call, self._deadline)
        items = _listed(answer)
        if items is None:
            # A 200 without a readable list is no evidence of absence.
            unreadable_200 = answer.transport is Transport.RESPONSE and answer.status == 200
            return LookupAnswer(answer, readable=not unreadable_200)
        return LookupAnswer(answer, tuple(seen_in_listing(item, query.kind) for item in items))

    async def _card_action_lookup(self, query: ProviderLookup) -> LookupAnswer:
        """A card action is evidenced by the card's state: frozen after a freeze."""
        call = self._client.request("GET", f"/v1/cards/{query.target}")
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
        await self._client.aclose()


def _listed(answer: ProviderAnswer) -> list[Any] | None:
    """The `data` list of a 200 lookup, or None when there is none to read."""
    if answer.transport is not Transport.RESPONSE or answer.status != 200:
        return None
    body = answer.detail.get("body")
    data = body.get("data") if isinstance(body, dict) else None
    return data if isinstance(data, list) else None


def seen_in_listing(item: Any, kind: str) -> ChargeSeen:
    """One listed object in the lookup's words."""
    if not isinstance(item, dict):
        return ChargeSeen("?", "unreadable")
    if kind in ("payment", "refund"):
        status = item.get("status")
        return ChargeSeen(str(item.get("id")), status_word(status), raw_status=str(status))
    # A beneficiary or card that exists under our reference is the write's success.
    return ChargeSeen(str(item.get("id")), "succeeded")


def _build(arguments: BuildArguments) -> SandboxProvider:
    url = arguments.config.provider_url or arguments.default_url
    if url is None:
        raise ProviderNotConfigured(
            "INTENTLEDGER_PROVIDER_URL is required when no sandbox runs in this process"
        )
    return SandboxProvider(url, arguments.timeout, max_connections=arguments.max_connections)


PLUGIN = ProviderPlugin(
    name="sandbox",
    summary="the built-in sandbox provider (Stripe-v1-like charges, refunds, beneficiaries, cards)",
    kinds=frozenset(KINDS),
    retention=lambda config: sandbox_policy(config.sandbox_key_retention),
    consistency=lambda _config: LookupConsistency(
        None,
        "list by reference, read from the sandbox's own store; its pm_lookup_lag scenario "
        "hides a charge for a while as a fault the safety review must survive",
    ),
    build=_build,
    webhooks=lambda config: (
        SandboxWebhookReader(config.sandbox_webhook_secret)
        if config.sandbox_webhook_secret
        else None
    ),
)
