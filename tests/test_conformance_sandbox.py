"""The conformance kit (intentledger.testing.conformance) run for the sandbox
adapter, on both databases: what a plug-in's own tests would look like. Each
check of the adapter's wire is also shown failing on a deliberately broken
copy of it."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Mapping
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import ClassVar

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.signatures import STRIPE_TOLERANCE_SECONDS, stripe_signature_header
from intentledger.domain.transport import (
    Classification,
    LookupAnswer,
    ProviderAnswer,
    Transport,
    Verdict,
)
from intentledger.providers.base import ProviderLookup, ProviderRequest
from intentledger.providers.registry import ProviderConfig
from intentledger.providers.sandbox.webhooks import (
    EVENT_STATUS,
    SandboxWebhookReader,
    charge_event,
)
from intentledger.providers.sandbox_client import (
    PLUGIN,
    SandboxProvider,
    map_answer,
    seen_in_listing,
)
from intentledger.service import provider_config
from intentledger.settings import Settings
from intentledger.store.database import create_ledger_engine
from intentledger.testing import conformance
from intentledger.testing.chaos import check_chaos
from intentledger.testing.conformance import ConformanceError, EventAbout
from intentledger.testing.truth import Truth
from intentledger_tools import chaos
from tests.conftest import Databases

SECRET = "whsec_sandbox_conformance"


def sign(body: bytes, secret: str, at: int) -> Mapping[str, str]:
    return {"Stripe-Signature": stripe_signature_header(body, secret, at)}


def event(about: EventAbout) -> bytes:
    assert about.object_kind == "payment", "the sandbox's events are about charges only"
    status = "succeeded" if about.final else "pending"
    charge_id = "ch_" + about.event_id.removeprefix("evt_kit_")
    body = charge_event(f"charge.{status}", charge_id, about.reference, status, about.created)
    body["id"] = about.event_id
    return json.dumps(body).encode()


WEBHOOKS = conformance.Webhooks(
    provider="sandbox",
    reader=SandboxWebhookReader(SECRET),
    secrets=(SECRET,),
    sign=conformance.signed_in_headers(sign),
    event=event,
    object_kinds=frozenset({"payment"}),
    tolerance=timedelta(seconds=STRIPE_TOLERANCE_SECONDS),
)


async def test_a_charge_event_settles_no_refund_and_no_card(engine: AsyncEngine) -> None:
    await conformance.check_kind(engine, WEBHOOKS)


async def test_the_sandboxs_webhooks_verify_and_deduplicate(engine: AsyncEngine) -> None:
    await conformance.check_webhook_verification(engine, WEBHOOKS)


def charge_event_in(status: str) -> str | None:
    """The reader's word for a signed charge event whose charge is in `status`."""
    body = json.dumps(charge_event("charge.updated", "ch_1", "op_x", status, 0)).encode()
    now = datetime.now(UTC)
    signed = sign(body, SECRET, int(now.timestamp()))
    return WEBHOOKS.reader.read(body, {"stripe-signature": signed["Stripe-Signature"]}, now).status


def test_no_status_the_sandbox_does_not_name_is_an_outcome() -> None:
    conformance.check_status_mapping(charge_event_in, EVENT_STATUS)
    for kind in ("payment", "refund"):
        conformance.check_status_mapping(
            lambda status, kind=kind: seen_in_listing({"id": "x", "status": status}, kind).status,
            EVENT_STATUS,
        )


# The sandbox maps a write's answer by HTTP status alone (docs/providers.md, "The sandbox").
SUBMIT_ANSWERS = conformance.SubmitAnswers(
    mapping=map_answer,
    accepted=lambda word: {"id": "ch_1", "status": word},
    refused=lambda code: {"error": {"type": code, "code": code}},
    named={
        **{status: None for status in range(200, 300)},
        **{status: None for status in (400, 402, 409, 422, 429)},
        **{status: None for status in range(500, 600)},
    },
)


def test_no_answer_the_sandbox_does_not_name_is_an_outcome() -> None:
    conformance.check_submit_mapping(SUBMIT_ANSWERS)


def test_a_mapping_that_calls_any_refusal_a_failure_fails_the_kit() -> None:
    def any_4xx_failed(answer: ProviderAnswer) -> Classification:
        if answer.status is not None and 400 <= answer.status < 500:
            return Classification(Verdict.FAILED, "every refusal, read as final")
        return map_answer(answer)

    with pytest.raises(ConformanceError, match="is mapped failed"):
        conformance.check_submit_mapping(replace(SUBMIT_ANSWERS, mapping=any_4xx_failed))


PAYMENT = ProviderRequest(
    "payment",
    "op_000000000000000000000001",
    "op_000000000000000000000001:1",
    {"amount": 500, "currency": "EUR", "payment_method": "pm_card_visa", "metadata": {}},
)


def build(api_base: str, timeout: timedelta) -> SandboxProvider:
    return SandboxProvider(api_base + "/_sandbox", timeout)


async def test_the_sandbox_says_never_sent_only_when_nothing_was_sent() -> None:
    await conformance.check_transport(build, PAYMENT)


class LostAnswerReadAsNeverSent(SandboxProvider):
    """The mistake the check is for: every connection error taken as "not sent"."""

    async def submit(self, request: ProviderRequest) -> ProviderAnswer:
        answer = await super().submit(request)
        if answer.transport is Transport.NO_RESPONSE:
            return replace(answer, transport=Transport.NOT_SENT)
        return answer


async def test_an_adapter_taking_a_lost_answer_for_never_sent_fails_the_kit() -> None:
    with pytest.raises(ConformanceError, match="closed the connection: the answer is not_exec"):
        await conformance.check_transport(LostAnswerReadAsNeverSent, PAYMENT)


def config() -> ProviderConfig:
    return provider_config(Settings(provider="sandbox"))


async def test_the_sandboxs_lookup_keeps_its_declaration(engine: AsyncEngine, sandbox: str) -> None:
    provider = SandboxProvider(sandbox, timedelta(seconds=5))
    try:
        await conformance.check_lookup(
            engine, provider, PLUGIN.consistency(config()), PLUGIN.retention(config())
        )
    finally:
        await provider.aclose()


class LaggingLookup(SandboxProvider):
    """A lookup whose answers say it lags while the plug-in declares it strong."""

    async def lookup(self, query: ProviderLookup) -> LookupAnswer:
        return replace(await super().lookup(query), lag=timedelta(minutes=5))


async def test_a_lookup_that_lags_against_its_declaration_fails_the_kit(
    engine: AsyncEngine, sandbox: str
) -> None:
    provider = LaggingLookup(sandbox, timedelta(seconds=5))
    try:
        with pytest.raises(ConformanceError, match="strongly consistent"):
            await conformance.check_lookup(
                engine, provider, PLUGIN.consistency(config()), PLUGIN.retention(config())
            )
    finally:
        await provider.aclose()


# -- the chaos check -----------------------------------------------------------------------------


class SandboxChaos:
    """The sandbox as the kit's chaos check drives it: its scenarios are the
    payment methods (all but the black hole, whose answers and lookups never
    come, and the late webhook, which the standalone sandbox does not send);
    it acts only when asked, and its truth is its own store."""

    payment_methods: ClassVar[dict[str, int]] = {
        name: weight
        for name, weight in chaos.SCENARIOS.items()
        if name not in ("pm_blackhole", "pm_webhook_late")
    }
    currency = "EUR"

    def __init__(self, url: str) -> None:
        self.url = url
        self.upstream = url.removesuffix("/_sandbox")

    async def prepare(self, notify_url: str, seed: int) -> None:
        """A fresh sandbox (the fixture's), which sends no webhooks."""

    async def step(self) -> None:
        """It does nothing later on its own."""

    async def quiet(self) -> bool:
        return True

    async def truth(self) -> Truth:
        return await asyncio.to_thread(chaos.sandbox_truth, self.url)


async def test_the_sandbox_survives_a_short_chaos_run(
    engine_on_one_backend: AsyncEngine, sandbox: str
) -> None:
    report = await check_chaos(
        engine_on_one_backend,
        SandboxChaos(sandbox),
        build,
        reader=None,
        consistency=PLUGIN.consistency(config()),
        retention=PLUGIN.retention(config()),
    )
    assert report["faults"].keys() >= {"error_after", "reset_after", "hold_after"}, report


class LostAnswerReadAsDecline(SandboxProvider):
    """An adapter that takes a lost answer for a decline."""

    async def submit(self, request: ProviderRequest) -> ProviderAnswer:
        answer = await super().submit(request)
        if answer.transport is Transport.NO_RESPONSE:
            declined = Classification(Verdict.FAILED, "no answer: declined")
            return replace(answer, transport=Transport.RESPONSE, status=402, mapped=declined)
        return answer


class FreshKeyEverySend(SandboxProvider):
    """An adapter that sends every attempt under a key of its own making, so a
    same-key resend of a lost answer is a new request to the provider."""

    async def submit(self, request: ProviderRequest) -> ProviderAnswer:
        fresh = f"{request.idempotency_key}:{secrets.token_hex(4)}"
        return await super().submit(replace(request, idempotency_key=fresh))


class ChargesDouble(SandboxProvider):
    """An adapter that charges twice the amount asked."""

    async def submit(self, request: ProviderRequest) -> ProviderAnswer:
        if request.kind == "payment":
            doubled = {**request.body, "amount": 2 * int(str(request.body["amount"]))}
            request = replace(request, body=doubled)
        return await super().submit(request)


class RefundsHalf(SandboxProvider):
    """An adapter that refunds half of what the ledger asked."""

    async def submit(self, request: ProviderRequest) -> ProviderAnswer:
        if request.kind == "refund":
            halved = {**request.body, "amount": int(str(request.body["amount"])) // 2}
            request = replace(request, body=halved)
        return await super().submit(request)


@pytest.mark.parametrize(
    ("broken", "found"),
    [
        (LostAnswerReadAsDecline, "contradictions"),
        (FreshKeyEverySend, "duplicates"),
        (ChargesDouble, "wrong_amounts"),
        (RefundsHalf, "wrong_amounts"),
    ],
)
async def test_a_broken_adapter_fails_the_chaos_check(
    databases: Databases, sandbox: str, broken: type[SandboxProvider], found: str
) -> None:
    """What the adapter gets wrong does not depend on the database: one is enough."""

    def build_broken(api_base: str, timeout: timedelta) -> SandboxProvider:
        return broken(api_base + "/_sandbox", timeout)

    engine = create_ledger_engine(databases.create("sqlite"))
    try:
        with pytest.raises(ConformanceError, match=found):
            await check_chaos(
                engine,
                SandboxChaos(sandbox),
                build_broken,
                reader=None,
                consistency=PLUGIN.consistency(config()),
                retention=PLUGIN.retention(config()),
            )
    finally:
        await engine.dispose()


async def test_a_reader_no_notification_ever_reached_fails_the_chaos_check(
    databases: Databases, sandbox: str
) -> None:
    """The standalone sandbox posts nothing: a run given a reader must say that
    the reader was never exercised, not pass on its silence."""
    engine = create_ledger_engine(databases.create("sqlite"))
    try:
        with pytest.raises(ConformanceError, match="no notification reached the ledger"):
            await check_chaos(
                engine,
                SandboxChaos(sandbox),
                build,
                reader=SandboxWebhookReader(SECRET),
                consistency=PLUGIN.consistency(config()),
                retention=PLUGIN.retention(config()),
                payments=10,
            )
    finally:
        await engine.dispose()
